"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, seeded)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: most output tokens (>= 1).
        temperature: 0 = greedy (argmax); > 0 divides the logits.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set with cumulative probability >= top_p (1.0 = all).
        seed: per-request generator seed (same seed, same sampled tokens in any batch); None
            uses the engine's generator (``EngineConfig.seed``).
        stop: strings ending the output (finish_reason "stop"); the text is cut before them.
        stop_token_ids: token ids ending the output (kept in output_token_ids).
        ignore_eos: keep going past the EOS token.

    Raises:
        ValueError: any value out of range, naming the field.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Seq[str] = ()
    stop_token_ids: Seq[int] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = disabled), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None (what "
                             f"torch.Generator takes), got {self.seed!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside top-k / top-p to -inf. ``logits [vocab]`` float32 -> ``[vocab]``."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    return logits


class Sampler:
    """Picks one token per row of logits.

    Args:
        seed: seed of the shared generator used by requests without their own seed.
    """

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        """Token ids for ``logits [n, vocab]`` (float32), one ``params``/generator per row."""
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        out = []
        for row, p, gen in zip(logits, params, generators):
            if p.greedy:
                out.append(int(row.argmax()))
                continue
            row = filter_logits(row / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            out.append(int(torch.multinomial(probs, 1, generator=gen or self.generator)))
        return out

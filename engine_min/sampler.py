"""Sampling parameters and the sampler (penalties, greedy, temperature, min-p, top-k, top-p,
seeded).

Order (vLLM's v1 sampler): the penalties (``apply_penalties``: repetition, frequency, presence)
change the raw logits, greedy rows included; then a sampled row is divided by its temperature,
and ``min_p``, ``top_k`` and ``top_p`` drop tokens, ``top_p`` on what the others kept.

Greedy below an epsilon: a temperature under ``SAMPLING_EPS`` (1e-5) samples greedily, exactly
as temperature 0 (argmax; top_k and top_p do not apply; no generator draw). This is vLLM's rule
(``_SAMPLING_EPS = 1e-5`` in ``vllm/sampling_params.py``, where ``temperature <
_SAMPLING_EPS`` makes a request ``SamplingType.GREEDY``, and in ``vllm/v1/sample/sampler.py``).
vLLM also raises temperatures in ``(0, 1e-2)`` to 1e-2 (``_MAX_TEMP``); we do not: a tiny
temperature asks for the most likely token, and argmax is that token.

Numerics: a sampled row is ``(logits - max(logits)) / temperature`` in float64, every value
``<= 0`` with the most likely token at exactly 0, so no accepted temperature (1e-5 up to the
largest float) overflows it or makes a NaN, and softmax always sees a finite maximum (dividing
raw float32 logits by 1e-40 gave inf - inf = NaN, and ``torch.multinomial`` raised for the
whole batch). A row holding a NaN or infinite logit is an error for that row
only (``Sampler.sample_rows``).

Devices: logits may live on the engine's device (CUDA). A greedy batch is decided there
(argmax and the finiteness check) and only its token ids come back, in one copy; a batch with a
non-greedy row copies its logits to the host once and samples there, with CPU generators, so a
seed draws the same tokens on every device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

#: temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: most output tokens (>= 1).
        temperature: a finite number >= 0. Below ``SAMPLING_EPS`` (1e-5; 0 included) the
            sampling is greedy (argmax of the penalized logits; min_p, top_k and top_p
            ignored); otherwise the logits are divided by it.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set with cumulative probability >= top_p (1.0 = all).
        seed: per-request generator seed (same seed, same sampled tokens in any batch); None
            uses the engine's generator (``EngineConfig.seed``).
        stop: strings ending the output (finish_reason "stop"); the text is cut before them.
        stop_token_ids: token ids ending the output (kept in output_token_ids; their text is
            left out of ``text`` unless ``include_stop_str_in_output``).
        ignore_eos: keep going past the EOS token.
        min_tokens: the EOS and ``stop_token_ids`` cannot be sampled, and stop strings are not
            looked for, until this many tokens were generated (vLLM's rule); 0..max_tokens.
        include_stop_str_in_output: keep a matched stop string (or a stop token's text) in
            ``text`` instead of cutting it off.
        repetition_penalty: finite, > 0 (1 = off). The logit of every token in the prompt or
            the output so far is divided by it when positive, multiplied by it otherwise.
        frequency_penalty: in [-2, 2] (0 = off); subtracted once per occurrence of the token in
            the output so far.
        presence_penalty: in [-2, 2] (0 = off); subtracted from every token that occurs in the
            output so far.
        min_p: in [0, 1] (0 = off); after temperature, tokens whose probability is below
            ``min_p`` times the most likely token's are dropped (not for greedy rows).

    Raises:
        ValueError: any value out of range (a NaN or infinite temperature too), naming the
            field.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Seq[str] = ()
    stop_token_ids: Seq[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
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
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, "
                             f"got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")

    @property
    def penalized(self) -> bool:
        """Any of repetition, frequency or presence penalty is on."""
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0
                or self.presence_penalty != 0)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: ``temperature < SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS


def _finite(v) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float,
                  min_p: float = 0.0) -> torch.Tensor:
    """Set logits outside min-p / top-k / top-p to -inf. ``logits [vocab]`` (float32 or
    float64, after temperature) -> ``[vocab]`` of the same dtype.

    ``min_p`` drops a token when ``exp(logit - max) < min_p``: its probability is below
    ``min_p`` times the most likely token's (vLLM's ``probs < min_p * max(probs)``, without the
    rounding of a softmax). ``top_p`` then counts the mass of what min-p and top-k kept.
    The most likely token is always kept; ``logits`` must hold a finite maximum."""
    if min_p > 0:
        logits = logits.masked_fill(torch.exp(logits - logits.max()) < min_p, float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    histories: list[tuple[list[int], int]]) -> torch.Tensor:
    """vLLM's penalties on raw ``logits [n, vocab]`` (float32, any device), one row per
    ``params`` and ``histories`` entry (``(token_ids, num_prompt_tokens)``: the prompt then the
    output so far). Returns ``logits`` itself when no row is penalized (whatever it is: None
    when nothing samples), else a float32 copy.

    Per penalized row, vectorised over the vocabulary: a token in the prompt or the output has
    its logit divided by ``repetition_penalty`` when > 0, else multiplied by it; then
    ``frequency_penalty`` times its count in the output and ``presence_penalty`` (once, if it
    occurs in the output) are subtracted. Results are clamped to float32's finite range (a
    logit that ``min_tokens`` pushed to the lowest float stays there instead of becoming
    -inf: neither is ever picked). A row holding a NaN or infinite logit is left as it is, for
    ``Sampler.sample_rows`` to report.

    Raises:
        ValueError: a row is penalized and ``params`` or ``histories`` differ in length from
            ``logits``' rows.
    """
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    if not len(params) == len(histories) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, "
                         f"{len(histories)} histories")
    dev, vocab, n = logits.device, logits.shape[-1], len(rows)
    prompt_ids, output_ids = [], []
    for i in rows:
        ids, n_prompt = histories[i]
        prompt_ids.append(ids[:n_prompt])
        output_ids.append(ids[n_prompt:])
    in_prompt = _bin_counts(prompt_ids, vocab, dev) > 0                  # [n, vocab] bool
    out_counts = _bin_counts(output_ids, vocab, dev)                      # [n, vocab] float32
    pen = torch.tensor([[params[i].repetition_penalty, params[i].frequency_penalty,
                         params[i].presence_penalty] for i in rows],
                       dtype=torch.float32, device=dev)                     # [n, 3]
    rep = torch.where(in_prompt | (out_counts > 0), pen[:, :1], 1.0)
    idx = torch.tensor(rows, device=dev)
    raw = logits.index_select(0, idx).float()                              # [n, vocab]
    x = torch.where(raw > 0, raw / rep, raw * rep)
    x = x - pen[:, 1:2] * out_counts - pen[:, 2:3] * (out_counts > 0)
    info = torch.finfo(torch.float32)
    x = torch.where(torch.isfinite(raw).all(dim=-1, keepdim=True),
                    x.clamp(info.min, info.max), raw)
    return logits.float().index_copy(0, idx, x)


def _bin_counts(seqs: list[list[int]], vocab: int, device) -> torch.Tensor:
    """``[len(seqs), vocab]`` float32: how often each id occurs in each list (ids outside
    ``[0, vocab)`` are not counted)."""
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    row = torch.repeat_interleave(torch.arange(len(seqs), device=device),
                                  torch.tensor([len(s) for s in seqs], device=device))
    ok = (flat >= 0) & (flat < vocab)
    counts = torch.bincount(row[ok] * vocab + flat[ok], minlength=len(seqs) * vocab)
    return counts.view(len(seqs), vocab).float()


class Sampler:
    """Picks one token per row of logits.

    Args:
        seed: seed of the shared generator used by requests without their own seed.
    """

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        """Token ids for ``logits [n, vocab]`` (float32), one ``params``/generator per row.

        Raises:
            ValueError: the first row that cannot be sampled (``sample_rows`` keeps going).
        """
        tokens = self.sample_rows(logits, params, generators)
        for t in tokens:
            if isinstance(t, Exception):
                raise t
        return tokens

    def sample_rows(self, logits: torch.Tensor, params: list[SamplingParams],
                    generators: list[torch.Generator | None]) -> list[int | Exception]:
        """Per row of ``logits [n, vocab]`` (any device): its token id, or the exception raised
        sampling it.

        Rows are sampled in order, each at most once (a seeded row draws from its generator
        exactly as it would alone), and one row's error never changes another row's token.
        One device-to-host copy: the token ids and finiteness of an all-greedy batch, else the
        logits.
        """
        if all(p.greedy for p in params):
            finite = torch.isfinite(logits).all(dim=-1)                       # [n] bool
            ids, ok = torch.stack([logits.argmax(dim=-1), finite.long()]).tolist()
            if all(ok):
                return ids
        logits = logits.cpu()   # CPU generators: the same seeded draws on every device
        out: list[int | Exception] = []
        for row, p, gen in zip(logits, params, generators):
            try:
                out.append(self.sample_row(row, p, gen))
            except Exception as exc:  # noqa: BLE001 - reported for this row only
                out.append(exc)
        return out

    def sample_row(self, row: torch.Tensor, p: SamplingParams,
                   generator: torch.Generator | None) -> int:
        """One token id from ``row [vocab]`` (float32) under ``p``; ``generator`` None uses the
        shared one.

        Raises:
            ValueError: the row holds a NaN or infinite logit (a fault of the forward pass).
        """
        finite = torch.isfinite(row)
        if not bool(finite.all()):
            n_nan = int(torch.isnan(row).sum())
            raise ValueError(f"logits hold {n_nan} NaN and {int((~finite).sum()) - n_nan} "
                             f"infinite values of {row.numel()}; cannot sample")
        if p.greedy:
            return int(row.argmax())
        row = row.double()
        scaled = (row - row.max()) / p.temperature   # [vocab] float64, <= 0, the max at 0
        if 0 < p.top_k < row.numel():  # on the raw order: a huge temperature rounds ties
            scaled = scaled.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        probs = torch.softmax(filter_logits(scaled, 0, p.top_p, p.min_p), dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator or self.generator))

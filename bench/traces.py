"""Real-trace loaders: Mooncake (prefix-sharing structure) and Azure LLM (arrivals and lengths).

Mooncake JSONL rows are ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}`` with one chained hash id per 512-token block of the prompt (the last block
partial). Replaying on a small model maps each hash id deterministically to ``tokens_per_block``
token ids (fewer than 512 to fit), so equal ids give equal tokens and the trace's reuse
structure is preserved exactly; every length is scaled by ``tokens_per_block / 512``:

    published:  | block 0 (512) | block 1 (512) | ... | last (1..512) |   output_length
    replayed:   | tpb           | tpb           | ... | round(last*s) |   round(output*s)

Azure CSV rows are ``TIMESTAMP,ContextTokens,GeneratedTokens`` with no prefix information:
they give an arrival process and a length distribution; prompts get unique random tokens.
See ``shared/data/traces/SOURCES.md`` for sources and licenses.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.workloads import TOKEN_HIGH, TOKEN_LOW, Request, random_tokens

#: Tokens per hash block in the published Mooncake traces.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class MooncakeRecord:
    """One row of a Mooncake trace, as published (ms, tokens, block hash ids)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: str | Path, limit: int | None = None) -> list[MooncakeRecord]:
    """Read the first ``limit`` rows (all when ``None``) of a Mooncake JSONL trace.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: a row is not valid JSON, misses a field, or its ``hash_ids`` count is not
            ``ceil(input_length / 512)``; the message names the file and line.
    """
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    out: list[MooncakeRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rec = MooncakeRecord(int(row["timestamp"]), int(row["input_length"]),
                                     int(row["output_length"]),
                                     tuple(int(h) for h in row["hash_ids"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: bad Mooncake row ({e!r})") from None
            expected = math.ceil(rec.input_length / MOONCAKE_BLOCK_TOKENS)
            if len(rec.hash_ids) != expected or rec.input_length <= 0:
                raise ValueError(f"{path}:{lineno}: {len(rec.hash_ids)} hash ids for "
                                 f"input_length {rec.input_length}, expected {expected}")
            out.append(rec)
    return out


@lru_cache(maxsize=65536)
def block_tokens(hash_id: int, tokens_per_block: int, seed: int = 0) -> tuple[int, ...]:
    """The token ids standing for Mooncake block ``hash_id``: ``tokens_per_block`` ids in
    ``[TOKEN_LOW, TOKEN_HIGH)``, the same for the same (hash_id, tokens_per_block, seed)."""
    return random_tokens(np.random.default_rng([seed, 20, hash_id]), tokens_per_block)


def scaled_lengths(rec: MooncakeRecord, tokens_per_block: int) -> tuple[list[int], int]:
    """Per-block token counts of the replayed prompt and the replayed output length.

    Full blocks get ``tokens_per_block``; the last block ``max(1, round(last * s))`` with
    ``s = tokens_per_block / 512``; output ``max(1, round(output_length * s))``.
    """
    s = tokens_per_block / MOONCAKE_BLOCK_TOKENS
    n = len(rec.hash_ids)
    last = rec.input_length - (n - 1) * MOONCAKE_BLOCK_TOKENS
    sizes = [tokens_per_block] * (n - 1) + [max(1, min(tokens_per_block, round(last * s)))]
    return sizes, max(1, round(rec.output_length * s))


def mooncake_prompt(rec: MooncakeRecord, tokens_per_block: int, seed: int = 0) -> tuple[int, ...]:
    """Token ids of the replayed prompt of ``rec`` (a partial last block is the head of that
    id's full block)."""
    sizes, _ = scaled_lengths(rec, tokens_per_block)
    out: list[int] = []
    for h, n in zip(rec.hash_ids, sizes):
        out.extend(block_tokens(h, tokens_per_block, seed)[:n])
    return tuple(out)


def arrival_times(timestamps_ms: Sequence[int], time_scale: float, mode: str) -> list[float]:
    """Send times in seconds: ``timestamp * time_scale / 1000``, re-based to start at 0.

    ``mode="burst"`` sends all rows sharing a timestamp at once; ``"spread"`` spaces them evenly
    over the step to the next distinct timestamp (the last group uses the median step).
    """
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    if mode not in ("burst", "spread"):
        raise ValueError(f"mode must be 'burst' or 'spread', got {mode!r}")
    if not timestamps_ms:
        return []
    t0 = timestamps_ms[0]
    base = [(t - t0) / 1000.0 for t in timestamps_ms]
    if mode == "spread":
        distinct = sorted(set(base))
        steps = [b - a for a, b in zip(distinct, distinct[1:])]
        default_step = float(np.median(steps)) if steps else 0.0
        nxt = {a: b for a, b in zip(distinct, distinct[1:])}
        i = 0
        while i < len(base):
            j = i
            while j < len(base) and base[j] == base[i]:
                j += 1
            step = nxt.get(base[i], base[i] + default_step) - base[i]
            for k in range(i, j):
                base[k] = base[i] + step * (k - i) / (j - i)
            i = j
    return [t * time_scale for t in base]


@dataclass(frozen=True)
class MooncakeReplay:
    """A Mooncake trace as a replayable workload.

    Attributes:
        path: the JSONL trace.
        tokens_per_block: tokens per hash block in the replay (512 = as published).
        time_scale: multiplies the trace's inter-arrival times (0.1 = ten times faster).
        limit: first N rows only.
        mode: ``"burst"`` or ``"spread"`` for rows sharing one timestamp (see ``arrival_times``).
        max_output_tokens: cap on the scaled output length (``None`` = no cap).
        max_input_tokens: prompts longer than this keep their first tokens only (the prefix
            structure is unchanged; ``None`` = no cap).
        sessions: keep only the rows of this many conversations, sampled with ``seed`` from all
            conversations of the trace (a conversation = rows sharing their first
            ``session_blocks`` hash ids; in the Kimi trace every row shares block 0, a system
            prompt, so 2 is the default), before ``limit`` applies. ``None`` = every row.
        seed: salt of the hash-id -> tokens map and of the session sample.
    """

    path: str
    tokens_per_block: int = 16
    time_scale: float = 1.0
    limit: int | None = 40
    mode: str = "spread"
    max_output_tokens: int | None = 16
    max_input_tokens: int | None = None
    sessions: int | None = None
    session_blocks: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.sessions is not None and self.sessions <= 0:
            raise ValueError(f"sessions must be > 0, got {self.sessions}")
        if not 1 <= self.tokens_per_block <= MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"tokens_per_block must be in [1, 512], got {self.tokens_per_block}")

    def records(self) -> list[MooncakeRecord]:
        """The trace rows replayed: the sampled conversations' rows, then the first ``limit``."""
        if self.sessions is None:
            return load_mooncake(self.path, self.limit)
        rows = load_mooncake(self.path)
        keys = sorted({r.hash_ids[:self.session_blocks] for r in rows})
        if self.sessions < len(keys):
            pick = np.random.default_rng([self.seed, 21]).choice(len(keys), self.sessions,
                                                                 replace=False)
            chosen = {keys[i] for i in pick}
            rows = [r for r in rows if r.hash_ids[:self.session_blocks] in chosen]
        return rows[:self.limit] if self.limit is not None else rows

    def requests(self) -> list[Request]:
        """One ``Request`` per row; ``session`` names its conversation (first
        ``session_blocks`` hash ids)."""
        recs = self.records()
        times = arrival_times([r.timestamp_ms for r in recs], self.time_scale, self.mode)
        out = []
        for i, (rec, t) in enumerate(zip(recs, times)):
            _, n_out = scaled_lengths(rec, self.tokens_per_block)
            if self.max_output_tokens is not None:
                n_out = min(n_out, self.max_output_tokens)
            prompt = mooncake_prompt(rec, self.tokens_per_block, self.seed)
            out.append(Request(request_id=f"t{i}", arrival_s=t,
                               prompt=prompt[:self.max_input_tokens],
                               max_tokens=n_out, index=i, session="h" + "-".join(
                                   str(h) for h in rec.hash_ids[:self.session_blocks])))
        return out


def ideal_hit_tokens(records: Sequence[MooncakeRecord], tokens_per_block: int,
                     align: int = 1, max_input_tokens: int | None = None) -> list[int]:
    """Reusable prompt tokens of each row with an infinite cache: the leading blocks whose
    hash id appeared in an earlier row, in replayed tokens, rounded down to a multiple of
    ``align`` (the store's chunk size or the engine's block size) and never the whole prompt
    (the last token is always computed), prompts cut at ``max_input_tokens`` as the replay
    does. This is the trace's own reuse structure."""
    seen: set[int] = set()
    out = []
    for rec in records:
        sizes, _ = scaled_lengths(rec, tokens_per_block)
        hit = 0
        for h, n in zip(rec.hash_ids, sizes):
            if h not in seen:
                break
            hit += n
        total = min(sum(sizes), max_input_tokens or sum(sizes))
        hit = min(hit, total - 1)
        out.append(hit // align * align)
        seen.update(rec.hash_ids)
    return out


@dataclass(frozen=True)
class AzureRecord:
    """One row of an Azure LLM trace: arrival (seconds since the first row) and lengths."""

    arrival_s: float
    context_tokens: int
    generated_tokens: int


def _parse_ts(text: str) -> datetime:
    # "2023-11-16 18:17:03.9799600": 7 fractional digits; datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")


def load_azure(path: str | Path, limit: int | None = None) -> list[AzureRecord]:
    """Read the first ``limit`` rows of an Azure LLM inference trace CSV.

    Raises:
        ValueError: wrong header or a bad row (message names file and line).
    """
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be > 0, got {limit}")
    out: list[AzureRecord] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: unexpected header {header}")
        t0 = None
        for lineno, row in enumerate(reader, 2):
            if limit is not None and len(out) >= limit:
                break
            try:
                ts = _parse_ts(row[0])
                t0 = ts if t0 is None else t0
                out.append(AzureRecord((ts - t0).total_seconds(), int(row[1]), int(row[2])))
            except (IndexError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: bad Azure row {row} ({e})") from None
    return out


@dataclass(frozen=True)
class AzureReplay:
    """An Azure trace as a workload: its arrivals (times ``time_scale``) and its lengths (times
    ``length_scale``, at least 1, capped by ``max_input_tokens``/``max_output_tokens``), with
    unique seeded prompts (the trace has no prefix information, so nothing is shared)."""

    path: str
    length_scale: float = 0.125
    time_scale: float = 1.0
    limit: int | None = 40
    max_input_tokens: int | None = 4096
    max_output_tokens: int | None = 16
    seed: int = 0

    def requests(self) -> list[Request]:
        """One ``Request`` per row, each its own session."""
        out = []
        for i, rec in enumerate(load_azure(self.path, self.limit)):
            n_in = max(1, round(rec.context_tokens * self.length_scale))
            n_out = max(1, round(rec.generated_tokens * self.length_scale))
            if self.max_input_tokens is not None:
                n_in = min(n_in, self.max_input_tokens)
            if self.max_output_tokens is not None:
                n_out = min(n_out, self.max_output_tokens)
            prompt = random_tokens(np.random.default_rng([self.seed, 30, i]), n_in)
            out.append(Request(request_id=f"a{i}", arrival_s=rec.arrival_s * self.time_scale,
                               prompt=prompt, max_tokens=n_out, session=f"a{i}", index=i))
        return out


__all__ = ["MooncakeRecord", "load_mooncake", "block_tokens", "scaled_lengths", "mooncake_prompt",
           "arrival_times", "MooncakeReplay", "ideal_hit_tokens", "AzureRecord", "load_azure",
           "AzureReplay", "TOKEN_LOW", "TOKEN_HIGH"]

"""A trace as prefix-chunk accesses, for the eviction simulator (``bench.policy_sim``).

One chunk per Mooncake hash block (512 tokens, the last of a prompt partial), keyed by the
block's hash id. The ids are chained (an id names its block together with every block before
it), so equal ids mean equal prefixes, each id has one parent (the id before it in any row
that holds it) and a row's blocks are accessed in order, head first::

    row r:   keys[start[r]] ... keys[start[r+1] - 1]      (chunk ids, head first)
             tokens[...]                                  (tokens of each chunk: 512, ..., last)

Azure rows carry no prefix information (only lengths): each prompt becomes
``ceil(context / 512)`` chunks with ids of its own, so nothing is shared and every policy's
hit rate, and the bound, is 0 at every capacity. The replay is kept for that fact (a policy
must not invent hits) and for the trace's byte volume.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from bench.traces import MOONCAKE_BLOCK_TOKENS, load_azure, load_mooncake

#: Traces shipped in ``shared/data/traces/``: name -> (file, kind).
TRACES = {
    "mooncake-conv": ("mooncake_conversation_trace.jsonl", "mooncake"),
    "mooncake-synth": ("mooncake_synthetic_trace.jsonl", "mooncake"),
    "azure-conv": ("azure_llm_2023_conv.csv", "azure"),
    "azure-code": ("azure_llm_2023_code.csv", "azure"),
}


@dataclass(frozen=True)
class ChunkTrace:
    """Flattened chunk accesses of a trace (see the module docstring for the layout).

    Attributes:
        name: the trace's name.
        keys: chunk id of each access, rows concatenated in arrival order.
        tokens: tokens of each access's chunk (same length as ``keys``).
        start: offset of each row in ``keys``, plus ``len(keys)`` at the end.
        parent: chunk id -> the id before it in its rows (absent for a first chunk).
    """

    name: str
    keys: list[int]
    tokens: list[int]
    start: list[int]
    parent: dict[int, int]

    @property
    def num_rows(self) -> int:
        return len(self.start) - 1

    @property
    def total_tokens(self) -> int:
        """Prompt tokens over all rows (the hit rate's denominator)."""
        return sum(self.tokens)

    def unique_tokens(self) -> int:
        """Tokens of the distinct chunks (each chunk counted once)."""
        return sum({k: t for k, t in zip(self.keys, self.tokens)}.values())


def _block_tokens(input_length: int, num_blocks: int) -> list[int]:
    last = input_length - (num_blocks - 1) * MOONCAKE_BLOCK_TOKENS
    return [MOONCAKE_BLOCK_TOKENS] * (num_blocks - 1) + [last]


def from_rows(name: str, rows: list[tuple[list[int], list[int]]]) -> ChunkTrace:
    """A ``ChunkTrace`` from rows of (chunk ids head first, tokens per chunk).

    Raises:
        ValueError: a row's two lists differ in length, a row is empty, a chunk has no
            positive token count, or a chunk id follows two different parents (not chained).
    """
    keys: list[int] = []
    tokens: list[int] = []
    start = [0]
    parent: dict[int, int] = {}
    for i, (ks, ts) in enumerate(rows):
        if len(ks) != len(ts) or not ks or min(ts) <= 0:
            raise ValueError(f"{name} row {i}: {len(ks)} ids, token counts {ts[:4]}...")
        for j in range(1, len(ks)):
            if parent.setdefault(ks[j], ks[j - 1]) != ks[j - 1]:
                raise ValueError(f"{name} row {i}: chunk {ks[j]} follows {ks[j - 1]} here and "
                                 f"{parent[ks[j]]} before; ids are not chained prefix hashes")
        keys.extend(ks)
        tokens.extend(ts)
        start.append(len(keys))
    return ChunkTrace(name, keys, tokens, start, parent)


def load_chunk_trace(name: str, traces_dir: str | Path, limit: int | None = None) -> ChunkTrace:
    """Load shipped trace ``name`` (a key of ``TRACES``) from ``traces_dir``, its first
    ``limit`` rows (all when None).

    Raises:
        ValueError: unknown name (the message lists the known ones) or a bad trace row.
        FileNotFoundError: the file is missing.
    """
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; choose one of {sorted(TRACES)}")
    fname, kind = TRACES[name]
    path = Path(traces_dir) / fname
    if kind == "mooncake":
        rows = [(list(r.hash_ids), _block_tokens(r.input_length, len(r.hash_ids)))
                for r in load_mooncake(path, limit)]
    else:
        rows, next_id = [], 0
        for r in load_azure(path, limit):
            n = max(1, math.ceil(r.context_tokens / MOONCAKE_BLOCK_TOKENS))
            rows.append((list(range(next_id, next_id + n)),
                         _block_tokens(max(r.context_tokens, 1), n)))
            next_id += n
    return from_rows(name, rows)


def prefix_reuse_tokens(trace: ChunkTrace) -> int:
    """Tokens an infinite cache serves: per row, the leading chunks seen in an earlier row
    (a prefix lookup stops at the first chunk never seen)."""
    seen: set[int] = set()
    hit = 0
    keys, tokens, start = trace.keys, trace.tokens, trace.start
    for r in range(trace.num_rows):
        a, b = start[r], start[r + 1]
        j = a
        while j < b and keys[j] in seen:
            hit += tokens[j]
            j += 1
        seen.update(keys[a:b])
    return hit

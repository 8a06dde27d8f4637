"""Belady's offline optimum (MIN) over a ``ChunkTrace``: evict the chunk whose next use is
furthest in the future, and do not store a chunk whose next use is further than every stored
one's (bypass).

Prefix note: no constraint is added, none is needed. Every row that reads a chunk reads its
parent first, so a parent's next use is never after its child's; ties go to the deeper chunk
(the one later in its row), so a child always leaves before its parent and the stored set
stays closed under parents: a prefix lookup finds every stored chunk it asks for. A row whose
chunk was bypassed stores none of its later chunks (they would be unreachable).

Optimality: MIN is optimal for equal-sized chunks. Here sizes are bytes (tokens times bytes
per token), equal except a row's partial last chunk, so MIN is the classical bound, not a
proven one, on the token-weighted hit rate; no online policy in ``bench.policy_sim`` beat it
on the shipped traces.
"""
from __future__ import annotations

import heapq

from bench.policy_trace import ChunkTrace


def next_uses(trace: ChunkTrace) -> list[int]:
    """For each access position, the position of the next access of the same chunk
    (``len(trace.keys)`` when there is none)."""
    n = len(trace.keys)
    out = [n] * n
    last: dict[int, int] = {}
    keys = trace.keys
    for p in range(n - 1, -1, -1):
        k = keys[p]
        out[p] = last.get(k, n)
        last[k] = p
    return out


def belady_hit_tokens(trace: ChunkTrace, capacity_bytes: int, token_bytes: int,
                      nxt: list[int] | None = None, bypass: bool = True) -> int:
    """Tokens served by MIN with ``capacity_bytes`` of cache (chunk bytes = tokens times
    ``token_bytes``), rows in order, each row's prefix looked up before its misses are stored.
    ``nxt``: ``next_uses(trace)`` when already computed. ``bypass=False``: the textbook
    demand-paging variant, every miss is stored (evicting the furthest of the others); it
    can only do worse, and keeps prefixes closed only for one-chunk rows.

    Raises:
        ValueError: a negative capacity or a non-positive ``token_bytes``.
    """
    if capacity_bytes < 0 or token_bytes <= 0:
        raise ValueError(f"capacity_bytes {capacity_bytes} must be >= 0 and token_bytes "
                         f"{token_bytes} > 0")
    nxt = next_uses(trace) if nxt is None else nxt
    keys, tokens, start = trace.keys, trace.tokens, trace.start
    cached: dict[int, tuple[int, int]] = {}  # key -> (next use, depth): its live heap entry
    size: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key), stale entries skipped
    used = hit = 0
    for r in range(len(start) - 1):
        a, b = start[r], start[r + 1]
        prefix, stored = True, True
        for p in range(a, b):
            k, depth, nu = keys[p], p - a, nxt[p]
            if k in cached:
                if prefix:
                    hit += tokens[p]
                cached[k] = (nu, depth)
                heapq.heappush(heap, (-nu, -depth, k))
                continue
            prefix = False
            if not stored:
                continue
            nbytes = tokens[p] * token_bytes
            while used + nbytes > capacity_bytes and heap:
                neg_nu, neg_depth, v = heap[0]
                if cached.get(v) != (-neg_nu, -neg_depth):
                    heapq.heappop(heap)  # stale
                    continue
                if bypass and (-neg_nu, -neg_depth) <= (nu, depth):
                    break  # every stored chunk is needed sooner than this one: bypass
                heapq.heappop(heap)
                del cached[v]
                used -= size.pop(v)
            if used + nbytes > capacity_bytes:
                stored = False
                continue
            cached[k] = (nu, depth)
            size[k] = nbytes
            used += nbytes
            heapq.heappush(heap, (-nu, -depth, k))
            if len(heap) > 4 * len(cached) + 64:  # mostly stale: rebuild
                heap = [(-c[0], -c[1], key) for key, c in cached.items()]
                heapq.heapify(heap)
    return hit

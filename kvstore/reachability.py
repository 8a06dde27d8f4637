"""Reachability of stored chunks over all tiers: a prefix lookup walks a prompt's chunks
from the first one, so a chunk is served only while its parent, grandparent, ... are stored.
"""
from __future__ import annotations

from typing import Sequence

from kvstore.keys import ChunkKey
from kvstore.tiers.base import Tier


def unreachable_bytes(tiers: Sequence[Tier], doomed: set[ChunkKey]) -> int:
    """Bytes (over all tiers) of chunks that a prefix lookup can never reach: some ancestor
    (parent, grandparent, ... as recorded at put) is stored in no tier. Chunks in ``doomed``
    (removed while pinned) count as absent."""
    present = {k for t in tiers for k in t.keys()} - doomed
    parent = {}
    for t in reversed(tiers):  # the fastest tier's record wins, unless it records none
        for k in t.keys():
            parent[k] = t.parent_of(k) or parent.get(k)
    reachable: dict[ChunkKey, bool] = {}

    def ok(k: ChunkKey) -> bool:
        path, on_path = [], set()
        while k not in reachable:
            p = parent.get(k)
            if p is None:
                reachable[k] = True
                break
            if p not in present or k in on_path:  # (a parent cycle never reaches a root)
                reachable[k] = False
                break
            path.append(k)
            on_path.add(k)
            k = p
        verdict = reachable[k]
        for q in path:
            reachable[q] = verdict
        return verdict

    return sum(t.nbytes_of(k) for t in tiers for k in t.keys() if k in present and not ok(k))

"""Movement of chunks between the store's tiers: insert with eviction, spill, promote.

A victim evicted from tier i spills (is copied) to tier i+1 unless already there; a chunk hit
in a lower tier is promoted (copied) to the top tier. Which keys may be evicted is the
store's call (``evictable``: no pin). Not thread-safe: the store calls it under its lock.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from kvstore.keys import ChunkKey
from kvstore.metrics import StoreMetrics
from kvstore.tiers.base import Tier

log = logging.getLogger("kvstore.store")


class TierMover:
    """Places chunks in ``tiers`` (fastest first), evicting and spilling as needed."""

    def __init__(self, tiers: list[Tier], metrics: StoreMetrics,
                 evictable: Callable[[ChunkKey], bool]) -> None:
        self.tiers = tiers
        self.metrics = metrics
        self.evictable = evictable

    def insert(self, i: int, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None,
               owned: bool = False) -> bool:
        """Put ``kv`` into tier i, evicting (and spilling) as needed. False if it cannot fit."""
        if not self.make_room(i, kv.numel() * kv.element_size()):
            return False
        self.tiers[i].put(key, kv, parent, owned=owned)
        return True

    def make_room(self, i: int, nbytes: int) -> bool:
        """Evict unpinned victims of tier i until a chunk of ``nbytes`` fits. False if it
        cannot (larger than the tier, or every remaining chunk pinned)."""
        tier = self.tiers[i]
        if tier.footprint(nbytes) > tier.capacity_bytes:
            return False
        while not tier.can_fit(nbytes):
            victim = tier.next_victim(self.evictable)
            if victim is None:
                return False
            self.evict(i, victim)
        return True

    def write_through(self, i: int, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
                      which: Sequence[int]) -> int:
        """Copy chunks ``keys[j]`` (``j`` in ``which``) into tier i unless already there
        (key j-1 is key j's parent), evicting as needed. Returns how many found no room."""
        tier, rejected = self.tiers[i], 0
        for j in which:
            key, kv = keys[j], kvs[j]
            if tier.contains(key):
                continue
            if self.make_room(i, kv.numel() * kv.element_size()):
                tier.put(key, kv, keys[j - 1] if j else None)
            else:
                rejected += 1
        return rejected

    def evict(self, i: int, key: ChunkKey) -> None:
        """Drop ``key`` from tier i, spilling it to tier i+1 first when it is not there."""
        tier = self.tiers[i]
        if i + 1 < len(self.tiers) and not self.tiers[i + 1].contains(key):
            data = tier.read(key, getattr(tier, "device", "cpu"))
            if data is not None and self.insert(i + 1, key, data, tier.parent_of(key), owned=True):
                self.metrics.inc("spills", tier=tier.name)
        tier.delete(key)
        self.metrics.inc("evictions", tier=tier.name)

    def promote(self, plan: Sequence[tuple[ChunkKey, Tier] | None],
                out: Sequence[torch.Tensor | None], doomed: set[ChunkKey]) -> None:
        """Copy chunks just read from a lower tier (``plan[i]`` = (key, tier), ``out[i]`` the
        data) into the top tier, unless removed or already in a faster tier. Failures are
        logged and counted, never raised."""
        top = self.tiers[0]
        for item, kv in zip(plan, out):
            if item is None or kv is None or item[1] is top:
                continue
            key, tier = item
            src = self.tiers.index(tier)
            if key in doomed or any(t.contains(key) for t in self.tiers[:src]):
                continue
            try:
                if self.insert(0, key, kv, tier.parent_of(key)):
                    self.metrics.inc("promotions", tier=tier.name)
            except Exception:
                log.exception("promotion of %r failed", key)
                self.metrics.inc("errors", tier=top.name)


def unreachable_bytes(tiers: Sequence[Tier], doomed: set[ChunkKey]) -> int:
    """Bytes (over all tiers) of chunks that a prefix lookup can never reach: some ancestor
    (parent, grandparent, ... as recorded at put) is stored in no tier. Chunks in ``doomed``
    (removed while pinned) count as absent."""
    present = {k for t in tiers for k in t.keys()} - doomed
    parent = {}
    for t in reversed(tiers):
        for k in t.keys():
            parent[k] = t.parent_of(k)
    reachable: dict[ChunkKey, bool] = {}

    def ok(k: ChunkKey) -> bool:
        path = []
        while k not in reachable:
            p = parent.get(k)
            if p is None:
                reachable[k] = True
                break
            if p not in present:
                reachable[k] = False
                break
            path.append(k)
            k = p
        verdict = reachable[k]
        for q in path:
            reachable[q] = verdict
        return verdict

    return sum(t.nbytes_of(k) for t in tiers for k in t.keys() if k in present and not ok(k))

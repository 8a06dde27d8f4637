"""Movement of chunks between the store's tiers: insert with eviction, spill, promote.

A victim evicted from tier i spills (is copied) to tier i+1 unless already there; a chunk hit
in a lower tier is promoted (copied) to the top tier. Between two memory tiers the copy goes
pool to pool, possibly asynchronously (``MemoryTier.put_from``: the tiers keep the pages until
it completes and readers wait for it). Which keys may be evicted is the
store's call (``evictable``: no pin). Not thread-safe: the store calls it under its lock.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable, Iterable, Sequence

import torch

from kvstore.eviction.admission import TinyLFU
from kvstore.keys import ChunkKey
from kvstore.metrics import StoreMetrics
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.memory import MemoryTier

log = logging.getLogger("kvstore.store")


def descendants_of(key: Hashable, children: Callable[[Hashable], Iterable]) -> list:
    """Everything below ``key`` in the tree ``children`` describes (each key's children),
    breadth first, ``key`` itself excluded; each key once."""
    seen, order, frontier = {key}, [], [key]
    while frontier:
        nxt = []
        for k in frontier:
            for c in children(k):
                if c not in seen:
                    seen.add(c)
                    order.append(c)
                    nxt.append(c)
        frontier = nxt
    return order


class TierMover:
    """Places chunks in ``tiers`` (fastest first), evicting and spilling as needed, and keeps
    every stored prefix reachable.

    Prefix rule (what "reachable" means: a lookup walks a prompt's chunks from the first one
    and stops at the first one stored nowhere, so a chunk is only ever served if its parent,
    grandparent, ... are stored too):

    * room for a chunk is never made by evicting one of its own stored ancestors out of the
      store (``Protected``): the chunk would be stranded the moment it lands. When only such
      chunks could make room, the chunk is not stored (a put that overflows keeps its head
      chunks, not its tail);
    * a victim that leaves the store (no copy in another tier, no room below to spill to)
      takes its stored descendants with it, deepest first, in every tier; a victim whose
      descendants cannot all go (pinned, or ancestors of the chunk being placed) is skipped.
      Victims with no stored child anywhere are chosen first, so this is rare.

    Presence: a key is stored when some tier holds it and it is not in ``doomed`` (removed
    while pinned). Open reservations (``reserved``: key -> parent, chunks whose bytes are
    arriving) count as stored for the ancestor walk, so making room for chunk i of a batch
    never evicts the stored prefix that chunk i-1, not yet committed, continues.

    Cost: placing a chunk does not walk its ancestors (``Protected``), and a tier's policy
    finds a victim with no stored child without scanning the keys that have one
    (``EvictionPolicy``), so a put's cost per chunk does not grow with its prompt's length.

    Not thread-safe: the store calls it under its lock.
    """

    def __init__(self, tiers: list[Tier], metrics: StoreMetrics,
                 evictable: Callable[[ChunkKey], bool], doomed: set[ChunkKey] | None = None,
                 reserved: dict[ChunkKey, ChunkKey | None] | None = None,
                 admission: "TinyLFU | None" = None) -> None:
        self.tiers = tiers
        #: admission filter (None: admit): a chunk placed into a full tier must beat the
        #: first victim (``make_room``); the store records requests into it
        self.admission = admission
        self.metrics = metrics
        self.evictable = evictable
        self.doomed = doomed if doomed is not None else set()
        self.reserved = reserved if reserved is not None else {}

    # ---- the prefix graph over all tiers ------------------------------------------------------
    def present(self, key: ChunkKey) -> bool:
        """Stored in some tier and not removed."""
        if key in self.doomed:
            return False
        for t in self.tiers:
            if t.contains(key):
                return True
        return False

    def parent_of(self, key: ChunkKey) -> ChunkKey | None:
        """Recorded parent of ``key`` (the first one a tier records; an open reservation's
        otherwise), None for a first chunk or an unknown key."""
        for t in self.tiers:
            p = t.parent_of(key)
            if p is not None:
                return p
        return self.reserved.get(key)

    def lineage(self, key: ChunkKey, parent: ChunkKey | None) -> set[ChunkKey]:
        """``key`` and its stored (or reserved) ancestors, following recorded parents from
        ``parent`` up to the first one stored nowhere (a cycle, which only a lying client can
        make, ends the walk too). O(depth): ``Protected.full`` calls it at most once per
        ``make_room``, and only when no victim with no stored child could go."""
        out = {key}
        p = parent
        while p is not None and p not in out and (self.present(p) or p in self.reserved):
            out.add(p)
            p = self.parent_of(p)
        return out

    def near_lineage(self, key: ChunkKey, parent: ChunkKey | None) -> set[ChunkKey]:
        """``key``, the reserved (not yet stored) ancestors it continues, and the first stored
        ancestor above them: the only members of ``lineage(key, parent)`` that can have no
        stored child (every stored ancestor above the first has one: the next on the path).
        O(reserved ancestors), independent of the prompt's length."""
        out = {key}
        p = parent
        while p is not None and p not in out:
            if self.present(p):
                out.add(p)
                break
            if p not in self.reserved:
                break
            out.add(p)
            p = self.parent_of(p)
        return out

    def protect(self, key: ChunkKey, parent: ChunkKey | None,
                outer: "Protected | None" = None) -> "Protected":
        """What making room for ``key`` (child of ``parent``) may not take out of the store:
        its own stored ancestors, and whatever ``outer`` protects (the placement that caused
        this one: a spill)."""
        return Protected(self, key, parent, outer)

    def live_children(self, key: ChunkKey) -> set[ChunkKey]:
        """Stored keys (any tier, not removed) whose recorded parent is ``key``."""
        out: set[ChunkKey] = set()
        for t in self.tiers:
            out |= t.children_of(key)
        # (membership tests only: a disk writer thread may call this while the store's
        # thread changes ``doomed``)
        return {k for k in out if k not in self.doomed}

    def reachable(self, key: ChunkKey) -> bool:
        """Whether a prefix lookup reaches ``key``: every recorded ancestor is stored (a
        parent cycle, which only a lying client can record, is not reached). O(depth)."""
        seen = {key}
        p = self.parent_of(key)
        while p is not None:
            if p in seen or not self.present(p):
                return False
            seen.add(p)
            p = self.parent_of(p)
        return True

    def descendants(self, key: ChunkKey) -> list[ChunkKey]:
        """Stored descendants of ``key``, breadth first (so reversed: deepest first)."""
        return descendants_of(key, self.live_children)

    def elsewhere(self, key: ChunkKey, i: int) -> bool:
        """Whether a tier other than i holds ``key`` too."""
        return any(t.contains(key) for j, t in enumerate(self.tiers) if j != i)

    def strands_nothing(self, key: ChunkKey, i: int) -> bool:
        """Whether dropping ``key`` from tier i (with no spill) leaves every stored chunk's
        parent stored: another tier holds it, or no stored chunk names it as parent."""
        return self.elsewhere(key, i) or not self.live_children(key)

    # ---- placement ----------------------------------------------------------------------------
    def insert(self, i: int, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None,
               owned: bool = False, keep: "Protected | None" = None, admit: bool = True) -> bool:
        """Put ``kv`` into tier i, evicting (and spilling) as needed. False if it cannot fit
        without evicting what ``keep`` protects or ``key``'s own stored ancestors out of the
        store, or the admission filter refuses it (``admit=False``: not asked)."""
        nbytes = kv.numel() * kv.element_size()
        if not self.make_room(i, nbytes, lambda: self.protect(key, parent, keep),
                              candidate=key if admit else None):
            return False
        self.tiers[i].put(key, kv, parent, owned=owned)
        return True

    def copy_to(self, i: int, key: ChunkKey, src: Tier, parent: ChunkKey | None,
                kv: torch.Tensor | None = None, keep: "Protected | None" = None) -> bool:
        """Place ``src``'s chunk ``key`` into tier i as ``insert`` does (a spill or a promote).
        Memory tier to memory tier: pool to pool (``MemoryTier.put_from``); otherwise from
        ``kv`` (the chunk already read) or a fresh read of ``src``. False if it was not placed
        (no room, refused, or unreadable)."""
        dst = self.tiers[i]
        if isinstance(src, MemoryTier) and isinstance(dst, MemoryTier):
            nbytes = src.data_nbytes(key)
            if nbytes is None or not self.make_room(
                    i, nbytes, lambda: self.protect(key, parent, keep), candidate=key):
                return False
            dst.put_from(key, src, parent)
            return True
        owned = kv is None  # (a fresh read is ours to hand over)
        if kv is None:
            kv = src.read(key, getattr(src, "device", "cpu"))
        return kv is not None and self.insert(i, key, kv, parent, owned=owned, keep=keep)

    def make_room(self, i: int, nbytes: int,
                  keep: Callable[[], "Protected"] | None = None,
                  candidate: ChunkKey | None = None) -> bool:
        """Evict unpinned victims of tier i until a chunk of ``nbytes`` fits. False if it
        cannot (larger than the tier, or no victim may go: pinned, protected by ``keep()``
        (called once, when the first victim is needed; None: nothing protected) or holding up
        a descendant that may not go), or if the admission filter refuses ``candidate`` (the
        chunk being placed) over the first victim (nothing is evicted then; counted in
        ``admission_refusals``)."""
        tier = self.tiers[i]
        if tier.footprint(nbytes) > tier.capacity_bytes:
            return False
        if keep is None:
            keep = lambda: Protected(self, None, None)  # noqa: E731
        protected: Protected | None = None
        skip: set[ChunkKey] = set()
        adm = self.admission if candidate is not None else None
        while not tier.can_fit(nbytes):
            if protected is None:
                protected = keep()
            victim = self._pick(i, protected, skip)
            if victim is None:
                return False
            if adm is not None:
                adm.fit(len(tier.policy))
                if not adm.admit(candidate, victim):
                    self.metrics.inc("admission_refusals", tier=tier.name)
                    return False
                adm = None  # one comparison per placement: with the first victim
            if not self.evict(i, victim, protected):
                skip.add(victim)
        return True

    def _pick(self, i: int, keep: "Protected", skip: set[ChunkKey]) -> ChunkKey | None:
        """Tier i's next victim by its policy: first among those whose eviction strands
        nothing by itself (a lower tier to spill to, another copy, or no stored child), then,
        in the last tier, one whose descendants may all go with it."""
        tier = self.tiers[i]
        last = i + 1 == len(self.tiers)

        def simple(k: ChunkKey) -> bool:
            if k in skip or not self.evictable(k):
                return False
            if not last or self.elsewhere(k, i):
                return True  # it stays stored (spilled below, or another copy)
            return k not in keep and not self.live_children(k)

        # (in the last tier a key with a child stored here has a live child, unless that
        # child was removed while pinned; such a key is found by the pass below)
        victim = self._next_victim(tier, simple, last)
        if victim is not None or not last:
            return victim
        full = keep.full()  # (a stored ancestor is refused before its descendants are walked)
        return self._next_victim(tier, lambda k: k not in skip and k not in full
                                 and self.evictable(k) and self._may_leave(k, keep), False)

    def _next_victim(self, tier: Tier, can_evict: Callable[[ChunkKey], bool],
                     leaves_only: bool) -> ChunkKey | None:
        """``tier.next_victim``, passing over a disk chunk demoted at the open as unreachable
        that a re-stored parent made reachable again: its demotion is lifted
        (``DiskTier.revive``) and the policy asked again, so it goes in its rank's turn, not
        first. O(depth) once per such chunk; nothing for others."""
        while True:
            victim = tier.next_victim(can_evict, leaves_only)
            if victim is None or not isinstance(tier, DiskTier) \
                    or not tier.revive(victim, self.reachable):
                return victim

    def _may_leave(self, key: ChunkKey, keep: "Protected") -> bool:
        """Whether ``key`` and all its stored descendants may leave the store: none pinned,
        none protected. A stored ancestor of the protected chunk has the first stored one of
        ``keep.near`` among its descendants (or is it), so checking ``near`` is enough."""
        return key not in keep and all(d not in keep and self.evictable(d)
                                       for d in self.descendants(key))

    def write_through(self, i: int, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
                      which: Sequence[int], parents: Sequence[ChunkKey | None]) -> int:
        """Copy chunks ``keys[j]`` (``j`` in ``which``, in order; ``parents[j]`` its parent)
        into tier i unless already there, evicting as needed (an explicit write: the
        admission filter is not asked). Returns how many were not copied: no room, or a
        parent stored nowhere."""
        tier, rejected = self.tiers[i], 0
        for j in which:
            key, kv, parent = keys[j], kvs[j], parents[j]
            if tier.contains(key):
                continue
            if (parent is not None and not self.present(parent)) \
                    or not self.insert(i, key, kv, parent, admit=False):
                rejected += 1
        return rejected

    def evict(self, i: int, key: ChunkKey, keep: "Protected | None" = None) -> bool:
        """Drop ``key`` from tier i, spilling it to tier i+1 first when it is not there. When
        it leaves the store, its stored descendants go first (deepest first, every tier).
        Returns False (nothing changed) when it would leave the store but may not: it is in
        ``keep``, or a descendant is pinned or in ``keep``."""
        if keep is None:
            keep = Protected(self, None, None)
        tier = self.tiers[i]
        stays = self.elsewhere(key, i)
        if not stays and i + 1 < len(self.tiers):
            if self.copy_to(i + 1, key, tier, self.parent_of(key), keep=keep):
                self.metrics.inc("spills", tier=tier.name)
                stays = True
        if not stays:
            if not self._may_leave(key, keep):
                return False
            for d in reversed(self.descendants(key)):
                left = [t.name for t in self.tiers if t.delete(d)]
                for name in left:
                    self.metrics.inc("evictions", tier=name)
                self.metrics.inc("dropped_chunks", 1 if left else 0)
        tier.delete(key)
        self.metrics.inc("evictions", tier=tier.name)
        self.metrics.inc("dropped_chunks", 0 if stays else 1)
        return True

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
                if self.copy_to(0, key, tier, self.parent_of(key), kv):
                    self.metrics.inc("promotions", tier=tier.name)
            except Exception:
                log.exception("promotion of %r failed", key)
                self.metrics.inc("errors", tier=top.name)


class Protected:
    """The chunks a placement may not evict out of the store: the chunk being placed and its
    stored ancestors (plus those of ``outer``, the placement that caused this one).

    Membership (``in``) answers for ``near`` only: the chunk, its reserved ancestors and its
    first stored ancestor (``TierMover.near_lineage``, bounded by the reserved chunks, not by
    the prompt's length). That is exact for the two questions eviction asks: a victim with no
    stored child is an ancestor only if it is in ``near``; a victim that would take its
    stored descendants along is an ancestor (or has one among them) exactly when the first
    stored ancestor is among it and its descendants, which ``_may_leave`` walks anyway.
    ``full()`` is the whole ancestor walk, O(depth), done once and only for the last-resort
    pass over victims with stored children (to refuse ancestors without walking their
    descendants). A stored chunk whose parent is stored nowhere is unreachable already: the
    walk stops there.
    """

    __slots__ = ("mover", "key", "parent", "near", "outer", "_full")

    def __init__(self, mover: TierMover, key: ChunkKey | None, parent: ChunkKey | None,
                 outer: "Protected | None" = None) -> None:
        self.mover, self.key, self.parent, self.outer = mover, key, parent, outer
        self.near = mover.near_lineage(key, parent) if key is not None else set()
        self._full: set[ChunkKey] | None = None

    def __contains__(self, key: ChunkKey) -> bool:
        p = self
        while p is not None:
            if key in p.near:
                return True
            p = p.outer
        return False

    def full(self) -> set[ChunkKey]:
        """Every protected key: each placement's whole ancestor walk (computed once)."""
        if self._full is None:
            out: set[ChunkKey] = set()
            p = self
            while p is not None:
                if p.key is not None:
                    out |= self.mover.lineage(p.key, p.parent)
                p = p.outer
            self._full = out
        return self._full

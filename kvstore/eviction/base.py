"""Eviction policy contract: a policy only *listens* to key events and names victims.

The tier owns the data and the byte accounting; a policy keeps its own ordering of the keys the
tier holds and answers "which key should go next". Policies are prefix-aware: the tier passes
each chunk's parent key (the previous chunk of the same prompt) on insert, and ``next_victim``
prefers chunks with no child stored in this tier (tails before heads), since evicting a head
makes the stored tails after it unreachable by a prefix lookup.

Policies are not thread-safe; the tier that owns one serialises calls.
"""
from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from typing import Callable, Hashable, Iterator

Key = Hashable
_ABSENT = object()


class EvictionPolicy(ABC):
    """Base class. Subclasses implement ``_insert``, ``_access``, ``_remove`` and ``_order``.

    Methods (all mutate only the policy's own bookkeeping, never block, raise nothing on valid
    use):

    * ``on_insert(key, nbytes, parent)``: the tier stored ``key`` (``nbytes`` of tier space).
      Inserting a key already present is a programming error (``KeyError``).
    * ``on_access(key)``: the key was read (unknown keys are ignored).
    * ``on_remove(key)``: the tier dropped the key (unknown keys are ignored).
    * ``next_victim(can_evict)``: the key to evict next, or None when no key passes
      ``can_evict`` (e.g. all pinned). Does not remove it: the tier evicts it and then calls
      ``on_remove``. First choice: the first evictable key in policy order with no stored child;
      otherwise the first evictable key in policy order (``leaves_only=True``: no otherwise).

    Ranked policies (``ranked = True``: LRU, FIFO, LFU) keep in ``_ranks`` a sortable rank per
    key that orders keys as ``_order`` does (smallest first), set by their event hooks. Their
    first choice comes from a heap of the keys with no stored child (stale entries dropped
    when met, the heap rebuilt when it grows past twice the tracked keys), so it costs
    O(log n) per victim plus the keys ``can_evict`` refuses, not a scan over every key that
    has a child (a long prompt stored in one tier is all keys with a child but its last).
    """

    name = "base"
    ranked = False

    def __init__(self) -> None:
        self._nbytes: dict[Key, int] = {}
        self._parent: dict[Key, Key | None] = {}
        self._children: dict[Key, set[Key]] = {}  # parent -> stored children (parent may be absent)
        self._ranks: dict[Key, object] = {}  # ranked policies: key -> rank (order: smallest first)
        self._leaf_heap: list[tuple[object, int, Key]] = []  # (rank, tie, key), may be stale
        self._tie = itertools.count()

    # ---- events -------------------------------------------------------------------------
    def on_insert(self, key: Key, nbytes: int, parent: Key | None = None) -> None:
        if key in self._nbytes:
            raise KeyError(f"{key!r} already tracked by {self.name} policy")
        self._nbytes[key] = nbytes
        self._parent[key] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)
        self._insert(key)
        self._push_leaf(key)

    def on_access(self, key: Key) -> None:
        if key in self._nbytes:
            self._access(key)
            self._push_leaf(key)

    def on_remove(self, key: Key) -> None:
        if key not in self._nbytes:
            return
        self._remove(key)  # hook sees the key's size and parent before they are dropped
        del self._nbytes[key]
        parent = self._parent.pop(key)
        if parent is not None:
            kids = self._children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[parent]
                    if parent in self._nbytes:
                        self._push_leaf(parent)

    # ---- queries ------------------------------------------------------------------------
    def next_victim(self, can_evict: Callable[[Key], bool] = lambda k: True,
                    leaves_only: bool = False) -> Key | None:
        """See the class docstring; ``leaves_only``: no second choice (None when no key
        without a stored child passes ``can_evict``)."""
        # keys with a stored child are skipped before ``can_evict`` is asked (it may cost
        # more than a dict lookup); they are the second choice, in the same order
        if self.ranked:
            victim = self._first_leaf(can_evict)
            if victim is not None:
                return victim
        else:
            for key in self._order():
                if not self._children.get(key) and can_evict(key):
                    return key
        if leaves_only:
            return None
        for key in self._order():
            if self._children.get(key) and can_evict(key):
                return key
        return None

    # ---- leaves of a ranked policy ------------------------------------------------------------
    def _push_leaf(self, key: Key) -> None:
        """Record ``key`` (tracked) in the leaf heap at its current rank if it has no child."""
        if not self.ranked or self._children.get(key):
            return
        heap = self._leaf_heap
        if len(heap) > 2 * len(self._nbytes) + 64:  # mostly stale: rebuild, O(1) amortized
            heap[:] = [(r, next(self._tie), k) for k, r in self._ranks.items()
                       if not self._children.get(k)]
            heapq.heapify(heap)
            return  # the rebuild took ``key`` at its current rank
        heapq.heappush(heap, (self._ranks[key], next(self._tie), key))

    def _first_leaf(self, can_evict: Callable[[Key], bool]) -> Key | None:
        """The smallest-ranked key with no stored child that ``can_evict`` accepts."""
        heap, ranks, children = self._leaf_heap, self._ranks, self._children
        held, seen, found = [], set(), None
        while heap:
            rank, _, key = heap[0]
            if key in seen or ranks.get(key, _ABSENT) != rank or children.get(key):
                heapq.heappop(heap)  # stale: removed, re-ranked, got a child, or a duplicate
                continue
            seen.add(key)
            if can_evict(key):
                found = key
                break
            held.append(heapq.heappop(heap))
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def children(self, key: Key) -> set[Key]:
        """Tracked keys whose recorded parent is ``key`` (a new set; ``key`` need not be
        tracked)."""
        return set(self._children.get(key, ()))

    def keys(self) -> set[Key]:
        return set(self._nbytes)

    def __len__(self) -> int:
        return len(self._nbytes)

    def __contains__(self, key: Key) -> bool:
        return key in self._nbytes

    @property
    def tracked_bytes(self) -> int:
        return sum(self._nbytes.values())

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the policy's indexes disagree with each other."""
        ordered = list(self._order())
        assert len(ordered) == len(set(ordered)) == len(self._nbytes), \
            f"{self.name}: order has {len(ordered)} keys, tracking {len(self._nbytes)}"
        assert set(ordered) == set(self._nbytes), f"{self.name}: order and index disagree"
        for parent, kids in self._children.items():
            for kid in kids:
                assert self._parent.get(kid) == parent, f"{self.name}: child index stale for {kid!r}"
        if self.ranked:
            assert set(self._ranks) == set(self._nbytes), f"{self.name}: ranks and index disagree"
            assert sorted(self._nbytes, key=self._ranks.__getitem__) == ordered, \
                f"{self.name}: ranks do not order the keys as the policy does"
            live = {k for r, _, k in self._leaf_heap if self._ranks.get(k, _ABSENT) == r}
            leaves = {k for k in self._nbytes if not self._children.get(k)}
            assert leaves <= live, f"{self.name}: {len(leaves - live)} leaves missing from the heap"

    # ---- subclass hooks -------------------------------------------------------------------
    @abstractmethod
    def _insert(self, key: Key) -> None: ...

    @abstractmethod
    def _access(self, key: Key) -> None: ...

    @abstractmethod
    def _remove(self, key: Key) -> None: ...

    @abstractmethod
    def _order(self) -> Iterator[Key]:
        """Tracked keys, most evictable first (each exactly once)."""

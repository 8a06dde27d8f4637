"""Victim search of ``EvictionPolicy`` (``kvstore.eviction.base``) over its own indexes: the
first demoted leaf, the first leaf of a queue (from the queue's leaf heap, stale entries dropped
when met), and the second choice, the first evictable key with a stored child. ``next_victim``
and the batched calls (``kvstore.eviction.batched``) call these; nothing here imports the base.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Hashable

if TYPE_CHECKING:
    from kvstore.eviction.base import EvictionPolicy

Key = Hashable
_ABSENT = object()
_heappush, _heappop = heapq.heappush, heapq.heappop


def first_with_children(policy: EvictionPolicy, can_evict: Callable[[Key], bool]) -> Key | None:
    """``next_victim``'s second choice: the first evictable key (demoted first)."""
    for key in sorted(policy._demoted, key=policy._demoted.__getitem__):
        if can_evict(key):  # (all have a stored child: the leaves were tried first)
            return key
    for key in policy._order():
        if policy._children.get(key) and can_evict(key):
            return key
    return None


def first_demoted(policy: EvictionPolicy, can_evict: Callable[[Key], bool]) -> Key | None:
    """The oldest-demoted key with no stored child that ``can_evict`` accepts."""
    heap, demoted, children = policy._demoted_heap, policy._demoted, policy._children
    held: list = []
    found = None
    while heap:
        seq, key = heap[0]
        if demoted.get(key) != seq or key in children:
            _heappop(heap)  # stale: un-demoted, removed, or got a child (pushed again later)
            continue
        if can_evict(key):
            found = key
            break
        held.append(_heappop(heap))
    for entry in held:
        _heappush(heap, entry)
    return found


def first_leaf(policy: EvictionPolicy, q: int, can_evict: Callable[[Key], bool]) -> Key | None:
    """The smallest-ranked key of queue ``q`` with no stored child that ``can_evict``
    accepts."""
    heap, ranks, children, queue = policy._heaps[q], policy._ranks, policy._children, policy._queue
    held: list | None = None
    seen: set | None = None
    found = None
    while heap:
        rank, key = heap[0]
        if ranks.get(key, _ABSENT) != rank or key in children or queue.get(key, 0) != q \
                or (seen is not None and key in seen):
            _heappop(heap)  # stale: removed, re-ranked, got a child, moved, or a duplicate
            policy._heap_entries -= 1
            continue
        if can_evict(key):
            found = key
            break
        if held is None:
            held, seen = [], set()
        seen.add(key)
        held.append(_heappop(heap))
    if held:
        for entry in held:
            _heappush(heap, entry)
    return found

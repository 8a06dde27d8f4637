"""Victim removal for the ``on_request`` fast paths of the two-queue policies (S3-FIFO, ARC).

Those policies size their queues by what they track, so a request makes room before each new
key, choosing from the queues' leaf heaps (``base``) in the order the policy names then. Their
``on_request`` runs its hooks inline, with these two steps shared: ``pop_leaf`` (the leaf-heap
pass of ``next_victim``, sparing the new key's parent) and ``unlink`` (the base's part of
``on_remove``). Both assume no key is demoted (the fast paths take the general path then).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Hashable, Sequence

if TYPE_CHECKING:
    from kvstore.eviction.base import EvictionPolicy

Key = Hashable
_ABSENT = object()
_heappop, _heappush = heapq.heappop, heapq.heappush


def pop_leaf(policy: EvictionPolicy, queues: Sequence[int], spare: Key | None) -> Key | None:
    """``policy.next_victim(lambda k: k != spare, leaves_only=True)`` with no key demoted and
    ``queues`` the order ``_queues()`` gives: the first key with no stored child, other than
    ``spare``, of the first queue that has one (None: no such key). Drops the stale heap
    entries it meets and the victim's own; the caller removes the victim."""
    heaps, ranks, children, queue = policy._heaps, policy._ranks, policy._children, policy._queue
    for q in queues:
        heap = heaps[q]
        while heap:
            rank, key = heap[0]
            if ranks.get(key, _ABSENT) != rank or key in children or queue.get(key, 0) != q:
                _heappop(heap)  # stale: removed, re-ranked, got a child or moved
                policy._heap_entries -= 1
                continue
            if key != spare:
                _heappop(heap)
                policy._heap_entries -= 1
                return key
            key = policy._first_leaf(q, spare.__ne__)  # the spared parent on top: look past it
            if key is not None:
                return key
            break
    return None


def unlink(policy: EvictionPolicy, key: Key) -> int:
    """The base's part of ``on_remove(key)`` for a tracked, undemoted ``key`` (after the
    policy's own hook): its size, rank, queue and parent dropped, its parent a leaf again
    when this was its last stored child. Returns the key's bytes."""
    sizes = policy._nbytes
    nbytes = sizes.pop(key)
    del policy._ranks[key]
    policy._queue.pop(key, None)
    parent = policy._parent.pop(key)
    if parent is not None:
        children = policy._children
        kids = children.get(parent)
        if kids is not None:
            kids.discard(key)
            if not kids:
                del children[parent]
                if parent in sizes:  # (``_push_leaf`` inlined)
                    policy._heap_entries += 1
                    if policy._heap_entries > 2 * len(sizes) + 64:
                        policy._rebuild_heaps()
                    else:
                        _heappush(policy._heaps[policy._queue.get(parent, 0)],
                                  (policy._ranks[parent], parent))
    return nbytes


"""Victim removal for the ``on_request`` fast paths of the two-queue policies (S3-FIFO, ARC).

Those policies size their queues by what they track, so a request makes room before each new
key, choosing from the queues' leaf heaps (``base``) in the order the policy names then. Their
``on_request`` runs its hooks inline, with these steps shared: ``pop_leaf`` (the leaf-heap
pass of ``next_victim``, sparing the new key's parent), ``peek_leaf`` (the victim named
to an admission filter, left in place), ``unlink`` (the base's part of ``on_remove``) and
``flush``. All assume no key is demoted (the fast paths take the general
path then). A victim's parent that becomes a leaf is usually the next victim (a prompt goes
tail first), so ``unlink`` hands its heap entry back instead of pushing it, and ``pop_leaf``
takes it when it comes first in its queue: no push and pop for it (``flush`` pushes it when
the request ends with it pending).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Hashable, Sequence

if TYPE_CHECKING:
    from kvstore.eviction.base import EvictionPolicy

Key = Hashable
_ABSENT = object()
_heappop = heapq.heappop


def pop_leaf(policy: EvictionPolicy, queues: Sequence[int], spare: Key | None,
             pending: tuple | None = None) -> tuple[Key | None, tuple | None]:
    """``policy.next_victim(lambda k: k != spare, leaves_only=True)`` with no key demoted and
    ``queues`` the order ``_queues()`` gives: the first key with no stored child, other than
    ``spare``, of the first queue that has one (None: no such key). Drops the stale heap
    entries it meets and the victim's own; the caller removes the victim.

    ``pending``: a leaf-heap entry not pushed yet, ``(rank, key, queue)`` (``unlink``'s
    answer: a victim's parent, a leaf since), taken as part of its queue's heap: the victim
    when it comes first there, else pushed (dropped if stale). Returns the victim and the
    entry still pending (None once taken, pushed or dropped)."""
    heaps, ranks, children, queue = policy._heaps, policy._ranks, policy._children, policy._queue
    if pending is not None:
        rank, key, q = pending
        if ranks.get(key, _ABSENT) != rank or key in children or queue.get(key, 0) != q:
            pending = None  # stale: re-ranked (and pushed then), or got a child
    for q in queues:
        heap = heaps[q]
        while heap:
            rank, key = heap[0]
            if ranks.get(key, _ABSENT) != rank or key in children or queue.get(key, 0) != q:
                _heappop(heap)  # stale: removed, re-ranked, got a child or moved
                policy._heap_entries -= 1
                continue
            break
        if pending is not None and pending[2] == q:
            rank, key, _ = pending
            if key != spare and (not heap or rank < heap[0][0]):
                return key, None  # first in its queue: never pushed
            policy._push_leaf(key)
            pending = None
            heaps = policy._heaps  # (a rebuild replaces them)
            heap = heaps[q]
        if heap:
            key = heap[0][1]
            if key != spare:
                _heappop(heap)
                policy._heap_entries -= 1
                return key, pending
            key = policy._first_leaf(q, spare.__ne__)  # the spared parent on top: look past it
            if key is not None:
                return key, pending
    return None, pending


def peek_leaf(policy: EvictionPolicy, queues: Sequence[int], spare: Key | None,
              pending: tuple | None) -> Key | None:
    """The victim ``pop_leaf`` would return, left in place (what ``next_victim`` names, for
    an admission filter to judge before anything is evicted): ``pending`` is pushed first
    (``flush``; the caller's pending entry is None after this)."""
    flush(policy, pending)
    can_evict = _always if spare is None else spare.__ne__
    for q in queues:
        victim = policy._first_leaf(q, can_evict)
        if victim is not None:
            return victim
    return None


def _always(key: Key) -> bool:
    return True


def flush(policy: EvictionPolicy, pending: tuple | None) -> None:
    """Push ``pending`` (``pop_leaf``'s) into its leaf heap unless it went stale."""
    if pending is not None:
        rank, key, q = pending
        if policy._ranks.get(key, _ABSENT) == rank and key not in policy._children \
                and policy._queue.get(key, 0) == q:
            policy._push_leaf(key)


def drop(policy: EvictionPolicy, victim: Key, pending: tuple | None, victims: list
         ) -> tuple | None:
    """``unlink`` ``victim`` (after the policy's own hook) and append it to ``victims``.
    Returns the leaf-heap entry left pending: its parent's when that is a leaf now (then the
    previous ``pending`` is pushed, ``flush``), else ``pending``."""
    leaf = unlink(policy, victim)
    victims.append(victim)
    if leaf is None:
        return pending
    flush(policy, pending)
    return leaf


def unlink(policy: EvictionPolicy, key: Key) -> tuple | None:
    """The base's part of ``on_remove(key)`` for a tracked, undemoted ``key`` (after the
    policy's own hook): its size, rank, queue and parent dropped. Returns the parent's
    leaf-heap entry ``(rank, parent, queue)`` when this was its last stored child (a leaf
    now; for ``pop_leaf`` or ``flush`` to push), else None."""
    sizes = policy._nbytes
    del sizes[key]
    del policy._ranks[key]
    queue = policy._queue
    queue.pop(key, None)
    parent = policy._parent.pop(key)
    if parent is not None:
        children = policy._children
        kids = children.get(parent)
        if kids is not None:
            kids.discard(key)
            if not kids:
                del children[parent]
                if parent in sizes:
                    return policy._ranks[parent], parent, queue.get(parent, 0)
    return None

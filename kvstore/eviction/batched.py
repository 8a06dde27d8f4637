"""The batched calls of ``EvictionPolicy`` (``base``): one Python call per request instead of
several per chunk, each making the same decisions and leaving the same state as the per-event
calls it stands for (tested against them in ``tests/kvstore/test_eviction_batched.py``).

``EvictionPolicy.on_insert_chain`` and ``EvictionPolicy.evict_until`` (the contract, in their
docstrings) call the functions here, which work on the policy's own indexes: the size, parent,
child, rank and queue dicts and the leaf heaps the base class keeps. Nothing here imports the
base (it imports this module).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

if TYPE_CHECKING:
    from kvstore.eviction.base import EvictionPolicy

Key = Hashable
_ABSENT = object()
_heappush, _heappop = heapq.heappush, heapq.heappop


def link_chain(policy: EvictionPolicy, keys: Sequence[Key], nbytes: Sequence[int],
               parent: Key | None) -> None:
    """Record a chain of new keys in ``policy``'s size, parent and child indexes: ``keys[0]``
    (``nbytes[0]`` bytes) under ``parent``, then each key under the one before it. The
    subclass's ``_insert_many`` ranks them afterwards.

    Raises:
        ValueError: ``keys`` and ``nbytes`` differ in length.
        KeyError: a key is already tracked or repeated in ``keys`` (nothing is recorded).
    """
    tracked = policy._nbytes
    if len(keys) != len(nbytes):
        raise ValueError(f"{len(keys)} keys but {len(nbytes)} sizes")
    if len(set(keys)) != len(keys) or any(k in tracked for k in keys):
        bad = next((k for i, k in enumerate(keys) if k in tracked or k in keys[:i]), None)
        raise KeyError(f"{bad!r} already tracked by {policy.name} policy or repeated in the chain")
    parents, children = policy._parent, policy._children
    prev = parent
    for key, size in zip(keys, nbytes):
        tracked[key] = size
        parents[key] = prev
        if prev is not None:
            kids = children.get(prev)
            if kids is None:
                children[prev] = {key}
            else:
                kids.add(key)
        prev = key


def evict_until(policy: EvictionPolicy, nbytes: int, can_evict: Callable[[Key], bool],
                leaves_only: bool) -> list[Key]:
    """``policy.next_victim(can_evict, leaves_only)`` then ``policy.on_remove`` of the victim
    until the victims' sizes add up to at least ``nbytes`` (fewer when no victim is left);
    returns the victims in eviction order. ``can_evict`` is asked after each removal. Mutates
    ``policy``. The leaf-heap pass of ``next_victim`` and the removal are inlined while no key
    is demoted (demoted keys take the general path: they come first)."""
    victims: list[Key] = []
    if nbytes <= 0:
        return victims
    sizes, ranks, parents = policy._nbytes, policy._ranks, policy._parent
    children = policy._children
    queue, heaps, first_leaf = policy._queue, policy._heaps, policy._first_leaf
    remove_hook = policy._remove_hook
    one_queue = (0,) if policy.num_queues == 1 else None
    freed = 0
    while freed < nbytes:
        if policy._demoted:  # the general path: demoted keys come first
            victim = policy.next_victim(can_evict, leaves_only)
            if victim is None:
                break
            freed += sizes[victim]
            policy._forget(victim)
            victims.append(victim)
            continue
        victim = None
        for q in one_queue or policy._queues():  # (``_first_leaf`` inlined while the top
            heap = heaps[q]  # of the heap is a leaf that ``can_evict`` accepts)
            while heap:
                rank, key = heap[0]
                if ranks.get(key, _ABSENT) != rank or key in children \
                        or queue.get(key, 0) != q:
                    _heappop(heap)  # stale
                    policy._heap_entries -= 1
                    continue
                if can_evict(key):
                    _heappop(heap)  # (its entry goes stale with the removal below)
                    policy._heap_entries -= 1
                    victim = key
                else:
                    victim = first_leaf(q, can_evict)
                break
            if victim is not None:
                break
        if victim is None:
            victim = None if leaves_only else policy._first_with_children(can_evict)
            if victim is None:
                break
            freed += sizes[victim]
            policy._forget(victim)
            victims.append(victim)
            heaps = policy._heaps  # (a rebuild replaces the heaps)
            continue
        if remove_hook is not None:
            remove_hook(victim)
        freed += sizes.pop(victim)
        del ranks[victim]
        if queue:
            queue.pop(victim, None)
        victims.append(victim)
        parent = parents.pop(victim)
        if parent is not None:
            kids = children.get(parent)
            if kids is not None:
                kids.discard(victim)
                if not kids:
                    del children[parent]
                    if parent in sizes:  # a leaf now (``_push_leaf`` inlined)
                        policy._heap_entries += 1
                        if policy._heap_entries > 2 * len(sizes) + 64:
                            policy._rebuild_heaps()
                            heaps = policy._heaps
                        else:
                            _heappush(heaps[queue.get(parent, 0)], (ranks[parent], parent))
    return victims

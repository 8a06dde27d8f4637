"""The batched calls of ``EvictionPolicy`` (``base``): one Python call per request instead of
several per chunk, each making the same decisions and leaving the same state as the per-event
calls it stands for (tested against them in ``tests/kvstore/test_eviction_batched.py``).

``EvictionPolicy.on_insert_chain``, ``EvictionPolicy.evict_until`` and, out of LRU's and
FIFO's leaf-first index (``leaf_first``), ``EvictionPolicy.on_request`` (the contract, in their
docstrings) call the functions here, which work on the policy's own indexes: the size, parent,
child, rank and queue dicts and the leaf heaps the base class keeps. Nothing here imports the
base (it imports this module).
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Callable, Hashable, NamedTuple, Sequence

if TYPE_CHECKING:
    from kvstore.eviction.base import EvictionPolicy

Key = Hashable
_ABSENT = object()
_heappush, _heappop = heapq.heappush, heapq.heappop


#: ``admit(key, victim, num_keys)``: whether ``key`` may evict ``victim`` from a tier that
#: tracks ``num_keys`` keys (an admission filter; ``EvictionPolicy.on_request``)
Admit = Callable[[Key, Key, int], bool]


class Request(NamedTuple):
    """What ``EvictionPolicy.on_request`` did: the victims in eviction order, how many of the
    new keys it stored (the first ones), and the bytes the victims freed."""

    victims: list
    num_stored: int
    freed_bytes: int


def link_chain(policy: EvictionPolicy, keys: Sequence[Key], nbytes: Sequence[int],
               parent: Key | None) -> None:
    """Record a chain of new keys in ``policy``'s size, parent and child indexes: ``keys[0]``
    (``nbytes[0]`` bytes) under ``parent``, then each key under the one before it. The
    subclass's ``_insert_many`` ranks them afterwards.

    Raises:
        ValueError: ``keys`` and ``nbytes`` differ in length.
        KeyError: a key is already tracked or repeated in ``keys`` (nothing is recorded).
    """
    check_chain(policy, keys, nbytes)
    tracked, parents, children = policy._nbytes, policy._parent, policy._children
    prev = parent
    for key, size in zip(keys, nbytes):
        tracked[key] = size
        parents[key] = prev
        if prev is not None:
            add_child(children, prev, key)
        prev = key


def add_child(children: dict, parent: Hashable, key: Hashable) -> None:
    """Record ``key`` among ``parent``'s stored children (``children``: parent -> set)."""
    kids = children.get(parent)
    if kids is None:
        children[parent] = {key}
    else:
        kids.add(key)


def check_chain(policy: EvictionPolicy, keys: Sequence[Key], nbytes: Sequence[int]) -> None:
    """Raise ``ValueError`` if ``keys`` and ``nbytes`` differ in length, ``KeyError`` if a key
    is tracked by ``policy`` or repeated in ``keys``; changes nothing."""
    tracked = policy._nbytes
    if len(keys) != len(nbytes):
        raise ValueError(f"{len(keys)} keys but {len(nbytes)} sizes")
    if len(set(keys)) != len(keys) or any(map(tracked.__contains__, keys)):
        bad = next((k for i, k in enumerate(keys) if k in tracked or k in keys[:i]), None)
        raise KeyError(f"{bad!r} already tracked by {policy.name} policy or repeated in the chain")


def evict_until(policy: EvictionPolicy, nbytes: int, can_evict: Callable[[Key], bool],
                leaves_only: bool) -> tuple[list[Key], int]:
    """``policy.next_victim(can_evict, leaves_only)`` then ``policy.on_remove`` of the victim
    until the victims' sizes add up to at least ``nbytes`` (fewer when no victim is left);
    returns the victims in eviction order and the bytes they freed. ``can_evict`` is asked
    after each removal. Mutates ``policy``. The leaf-heap pass of ``next_victim`` and the
    removal are inlined while no key is demoted (demoted keys take the general path: they
    come first)."""
    victims: list[Key] = []
    if nbytes <= 0:
        return victims, 0
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
    return victims, freed


def request(policy: EvictionPolicy, hits: Sequence[Key], keys: Sequence[Key],
            nbytes: Sequence[int], free_bytes: int, admit: Admit | None = None) -> Request:
    """``EvictionPolicy.on_request`` through the policy's other calls (its contract, in its
    docstring): ``on_access_many(hits)``, then per key of ``keys``: ``evict_until`` (leaves
    only, sparing the key's parent) until it fits, ``on_insert``; room is made once for the
    whole chain when the policy's victims ignore inserts and there is no ``admit`` (the
    same victims). ``keys`` and ``nbytes`` are checked first."""
    check_chain(policy, keys, nbytes)
    policy.on_access_many(hits)
    parent = hits[-1] if hits else None
    room, stored, freed = free_bytes, 0, 0
    victims: list[Key] = []
    if policy.victims_ignore_inserts and admit is None:
        need = sum(nbytes) - room
        if need > 0:
            victims, freed = evict_until(policy, need, _sparing(parent), True)
            room += freed
        for n in nbytes:
            if n > room:
                break
            room -= n
            stored += 1
        if stored:
            policy.on_insert_chain(keys[:stored], nbytes[:stored], parent)
        return Request(victims, stored, freed)
    while stored < len(keys) and nbytes[stored] <= room:  # what fits as it is: one chain
        room -= nbytes[stored]  # (nothing is evicted between these inserts)
        stored += 1
    if stored:
        policy.on_insert_chain(keys[:stored], nbytes[:stored], parent)
        parent = keys[stored - 1]
    for key, n in zip(keys[stored:], nbytes[stored:]):
        if n > room:
            if admit is not None:
                victim = policy.next_victim(_sparing(parent), True)
                if victim is None or not admit(key, victim, len(policy._nbytes)):
                    break
            more, more_bytes = evict_until(policy, n - room, _sparing(parent), True)
            victims += more
            freed += more_bytes
            room += more_bytes
            if n > room:
                break
        policy.on_insert(key, n, parent)
        room -= n
        stored += 1
        parent = key
    return Request(victims, stored, freed)


def _always(key: Key) -> bool:
    return True


def _sparing(parent: Key | None) -> Callable[[Key], bool]:
    """``can_evict`` for a new key under ``parent``: anything but ``parent``."""
    return _always if parent is None else parent.__ne__

"""The leaf-first index: LRU's and FIFO's victims popped from the front of one ``OrderedDict``

A prefix-aware policy evicts the first key of its order that has no stored child (a leaf);
in general (``base``) a heap of leaves per queue finds it. A policy that gets every event
through ``on_request`` (a request's stored head read, then its new keys stored: how a
one-tier prefix cache serves a prompt), each request's stored head a chain from a root,
can keep instead one ``OrderedDict`` of every tracked key -> its rank (it stands for the
ranks' dict), in which each key comes after all its children, so that its first key is a
leaf and evicting is popping from the front:

* a request removes its stored head from the index, evicts the index's first keys, then
  appends its new keys last to first and its stored head last to first (LRU always; FIFO,
  whose reads change nothing, only when it stored a key: else the head only goes back).
  Each key then still comes after its children: a request's keys follow every older key,
  and within the request a key follows the keys below it.
* the first key is the leaf the policy's ranks name. The tracked keys are closed under
  parent (keys are stored under a stored parent, only leaves leave), so of the keys one
  request placed (one chain) only the lowest can be a leaf, and leaves stand in the order
  of the requests that placed them. LRU ranks keys by their last request too. FIFO ranks
  by insert: a leaf x placed later than a leaf w inserted after it was placed by a request
  that stored a key d below x, after w's insert; d has been evicted while w stayed, so at
  that time w had stored descendants (a leaf of them, older than d, would have gone
  first), all inserted before d, one of them the leaf spared by a request through w,
  which placed w again later than x: a contradiction.

Per stored key a request does a few C-level dict operations (``map``, ``zip``, ``islice``
over the dicts) and no heap push; the child sets are not kept meanwhile. Any other event
call, a child query, or a request whose stored head is not a chain from a root, makes the
policy leave the index (``leave``: ranks and child sets rebuilt; ``base`` then rebuilds its
heaps) for good. LFU keeps one such index per frequency (``leaf_first_lfu``).
"""
from __future__ import annotations

from collections import deque
from itertools import accumulate, count, islice, takewhile
from operator import itemgetter
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

from kvstore.eviction.batched import Admit, Request, add_child, check_chain

if TYPE_CHECKING:
    from kvstore.eviction.base import EvictionPolicy

Key = Hashable
_ABSENT = object()


def servable(policy: EvictionPolicy, hits: Sequence[Key], keys: Sequence[Key],
             nbytes: Sequence[int], free_bytes: int) -> bool:
    """Whether a leaf-first index can serve this ``on_request``: ``hits`` a tracked chain
    from a root, and not (no ``keys`` and a negative ``free_bytes``: the general path evicts).

    Raises:
        ValueError, KeyError: bad ``keys``/``nbytes`` (``batched.check_chain``), before any
            change.
    """
    sizes, parents = policy._nbytes, policy._parent
    if not keys and free_bytes < 0:
        return False
    if len(keys) != len(nbytes) or len(set(keys)) != len(keys) \
            or not sizes.keys().isdisjoint(keys):
        check_chain(policy, keys, nbytes)  # (raises)
    return not hits or (parents.get(hits[0], _ABSENT) not in sizes and hits[0] in sizes
                        and list(map(parents.get, islice(hits, 1, None))) == list(hits[:-1]))


def request(policy: EvictionPolicy, hits: Sequence[Key], keys: Sequence[Key],
            nbytes: Sequence[int], free_bytes: int, admit: Admit | None = None) -> Request | None:
    """``EvictionPolicy.on_request`` through the leaf-first index ``policy._leaf_first``;
    None (nothing changed) when ``hits`` is not a tracked chain from a root, or when
    ``keys`` is empty and ``free_bytes`` negative (the general path evicts then).

    Raises:
        ValueError, KeyError: as ``on_request`` (nothing changed).
    """
    index, sizes, parents = policy._leaf_first, policy._nbytes, policy._parent
    if not servable(policy, hits, keys, nbytes, free_bytes):
        return None
    nh = len(hits)
    reorder = policy.reads_reorder
    if nh:
        if reorder:  # read head first: ranks from the clock, taken below
            deque(map(index.__delitem__, hits), 0)
        elif keys:
            if admit is not None and nbytes[0] > free_bytes:  # FIFO's stored head keeps
                seen = set(hits)  # its place when nothing is stored under it: ask first
                victim = next((k for k in index if k not in seen), None)
                if victim is None or not admit(keys[0], victim, len(sizes)):
                    return Request([], 0, 0)
                admit = _admitted_first(admit, keys[0])
            hit_ranks = list(map(index.pop, hits))[::-1]
    if not keys:
        if nh and reorder:
            first = _tick(policy, nh)
            index.update(zip(reversed(hits), range(first + nh - 1, first - 1, -1)))
        return Request([], 0, 0)
    # the stored head is out of the index until the new keys are in (the parent is spared)
    if admit is None:  # room for the whole chain at once (the same victims)
        need = sum(nbytes) - free_bytes
        if need > 0:
            n = len(list(takewhile(need.__gt__, accumulate(map(sizes.__getitem__, index))))) + 1
            victims = list(islice(index, n))
            deque(map(index.__delitem__, victims), 0)
            deque(map(parents.__delitem__, victims), 0)
            freed = sum(map(sizes.pop, victims))
            stored = len(keys) if freed >= need else _fit(nbytes, free_bytes + freed)
        else:
            victims, freed, stored = [], 0, len(keys)
    else:
        pop_first = index.popitem  # (an ``OrderedDict``)

        def evict(need: int) -> tuple[list[Key], int]:  # the index's first keys (usually
            some, freed = [], 0  # one: a key at a time, each asked by ``admit``)
            while freed < need and index:
                key = pop_first(False)[0]
                del parents[key]
                freed += sizes.pop(key)
                some.append(key)
            return some, freed

        victims, freed, stored = make_room(keys, nbytes, free_bytes, evict,
                                           lambda: next(iter(index), None), len(sizes), admit)
    # one tick for the read head (if it reorders) and the stored keys, in that order
    nr = nh if reorder else 0
    if nr or stored:
        first = _tick(policy, nr + stored)
        if stored:
            chain = keys[:stored] if stored < len(keys) else keys
            sizes.update(zip(chain, nbytes))
            parents[chain[0]] = hits[-1] if nh else None
            parents.update(zip(chain[1:], chain))
            index.update(zip(reversed(chain), range(first + nr + stored - 1, first + nr - 1, -1)))
        if nr:
            index.update(zip(reversed(hits), range(first + nh - 1, first - 1, -1)))
    if nh and not reorder and keys:
        index.update(zip(reversed(hits), hit_ranks))
    return Request(victims, stored, freed)


def make_room(keys: Sequence[Key], nbytes: Sequence[int], free_bytes: int,
              evict: Callable[[int], tuple[list[Key], int]],
              first_victim: Callable[[], Key | None], num_keys: int,
              admit: Admit | None) -> tuple[list[Key], int, int]:
    """Evict (``evict(nbytes)``: victims, bytes freed) for new ``keys`` as ``on_request``
    does, the keys themselves stored later by the caller; returns the victims, the bytes
    they freed and how many keys fit. Without ``admit`` room is made once for the whole
    chain (the same victims); with it, before each key that needs room, ``admit(key,
    first_victim(), keys tracked then)`` must agree, else the request ends there."""
    if admit is None:
        need = sum(nbytes) - free_bytes
        victims, freed = evict(need) if need > 0 else ([], 0)
        return victims, freed, (len(keys) if freed >= need else _fit(nbytes, free_bytes + freed))
    victims, freed, room, stored = [], 0, free_bytes, 0
    for key, n in zip(keys, nbytes):
        if n > room:
            victim = first_victim()
            if victim is None or not admit(key, victim, num_keys - len(victims) + stored):
                break
            more, more_bytes = evict(n - room)
            victims += more
            freed += more_bytes
            room += more_bytes
            if n > room:
                break
        room -= n
        stored += 1
    return victims, freed, stored


def _admitted_first(admit: Admit, first: Key) -> Admit:
    """``admit``, save that ``first`` (already admitted) is let through."""
    return lambda key, victim, num_keys: key == first or admit(key, victim, num_keys)


def _tick(policy: EvictionPolicy, n: int) -> int:
    """Take ``n`` values of ``policy._clock`` (an ``itertools.count``); returns the first."""
    first = next(policy._clock)
    if n > 1:
        policy._clock = count(first + n)
    return first


def leave(policy: EvictionPolicy) -> None:
    """Rebuild what the index stood for: the ranks' dict in rank order and the child sets
    (the caller drops the index and rebuilds the heaps)."""
    policy._ranks = dict(sorted(policy._leaf_first.items(), key=itemgetter(1)))
    rebuild_children(policy)


def rebuild_children(policy: EvictionPolicy) -> None:
    """Fill ``policy._children`` (empty in index mode) from the parent index."""
    children = policy._children
    for key, parent in policy._parent.items():
        if parent is not None:
            add_child(children, parent, key)


def check_index(policy: EvictionPolicy) -> None:
    """Raise ``AssertionError`` unless ``policy._leaf_first`` is a leaf-first index: the
    ranks' dict itself, every tracked key after its children, closed under parent, its
    leaves in rank order, no child sets or demotions kept."""
    index, sizes, name = policy._leaf_first, policy._nbytes, policy.name
    assert index is policy._ranks and not policy._children and not policy._demoted, \
        f"{name}: the leaf-first index is not the only order kept"
    assert len(index) == len(sizes) and set(index) == set(sizes), \
        f"{name}: the leaf-first index and the tracked keys disagree"
    children = children_of(policy)
    seen: set = set()
    for key in index:
        assert all(c in seen for c in children.get(key, ())), \
            f"{name}: {key!r} comes before a child in the leaf-first index"
        seen.add(key)
    leaves = [k for k in index if k not in children]
    assert leaves == sorted(leaves, key=index.__getitem__), \
        f"{name}: the leaf-first index's leaves are not in rank order"


def children_of(policy: EvictionPolicy) -> dict[Key, list[Key]]:
    """Parent -> its tracked children, from the parent index, asserting that the tracked
    keys are closed under parent (for the integrity checks)."""
    children: dict = {}
    for key, parent in policy._parent.items():
        assert parent is None or parent in policy._nbytes, \
            f"{policy.name}: {key!r} stored without its parent"
        if parent is not None:
            children.setdefault(parent, []).append(key)
    return children


def _fit(nbytes: Sequence[int], room: int) -> int:
    """How many of ``nbytes``, from the first, fit in ``room`` bytes."""
    if sum(nbytes) <= room:
        return len(nbytes)
    n = 0
    for size in nbytes:
        if size > room:
            break
        room -= size
        n += 1
    return n

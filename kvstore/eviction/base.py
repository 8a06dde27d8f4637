"""Eviction policy contract: a policy only *listens* to key events and names victims.

The tier owns the data and the byte accounting; a policy keeps its own ordering of the keys the
tier holds and answers "which key should go next". Policies are prefix-aware: the tier passes
each chunk's parent key (the previous chunk of the same prompt) on insert, and ``next_victim``
prefers chunks with no child stored in this tier (tails before heads), since evicting a head
makes the stored tails after it unreachable by a prefix lookup.

Demotion: ``demote(key)`` marks a key as redundant for its own prompt (a tail piece whose full
chunk is now stored). A demoted key with no stored child is the next victim before any other
key, whatever the policy's order says (oldest demotion first); a demoted key with stored
children waits for them like any other. Reading a demoted key (``on_access``) lifts the
demotion: it proved useful.

Policies are not thread-safe; the tier that owns one serialises calls.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from types import MappingProxyType
from typing import Callable, Hashable, Iterable, Iterator, Mapping, Sequence

from kvstore.eviction import batched as _batched
from kvstore.eviction import integrity as _integrity
from kvstore.eviction import victims as _victims
from kvstore.eviction.batched import Admit, Request

Key = Hashable
_heappush = heapq.heappush


def _always(key: Key) -> bool:
    return True


class EvictionPolicy(ABC):
    """Base class. Subclasses implement ``_insert``, ``_access``, ``_remove`` and ``_order``,
    and rank every key they track (``_rank``).

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
      Demoted keys come first in both passes (see ``demote``).
    * ``demote(key)``: make a tracked key the first victim once it has no stored child; returns
      whether ``key`` is tracked. Demoting a demoted key keeps its first demotion's place.
      ``on_access`` lifts the demotion, ``on_remove`` forgets it.
    * Batched calls, each the same decisions and state as the per-event calls it stands for
      (one Python call per request instead of several per chunk): ``on_access_many(keys)``,
      ``on_insert_chain(keys, nbytes, parent)`` (a request's new chunks, each the parent of
      the next) and ``evict_until(nbytes, can_evict, leaves_only)`` (``next_victim`` then
      ``on_remove`` until ``nbytes`` are freed; returns the victims). When
      ``victims_ignore_inserts``, a tier may call ``evict_until`` once for a whole chain
      (sparing the chain's parent) and then ``on_insert_chain``: the victims are those of
      evicting before each key. ``on_request(hits, keys, nbytes, free_bytes)``: a whole
      prompt of a one-tier prefix cache (its docstring); LRU, FIFO and LFU serve it from a
      leaf-first index, no heap (``kvstore.eviction.leaf_first``); S3-FIFO and ARC run their
      hooks inline (``kvstore.eviction.queued``). (Their code is in
      ``kvstore.eviction.batched``.)

    Ranks and queues: a policy's order is one or more queues (LRU, FIFO, LFU: one; S3-FIFO:
    small and main; ARC: T1 and T2), read one after the other in the order ``_queues()``
    gives at victim time; within a queue, keys are ordered by their rank (an int, smallest
    first, unique within the queue), set by the subclass's hooks through ``_rank(key, rank,
    queue)``. The first choice comes from one heap per queue of the keys with no stored child
    (stale entries dropped when met, all heaps rebuilt when they grow past twice the tracked
    keys), so it costs O(log n) per victim plus the keys ``can_evict`` refuses, not a scan over
    every key that has a child (a long prompt stored in one tier is all keys with a child but
    its last).
    """

    name = "base"
    #: every policy keeps ranks and leaf heaps (the attribute stays for callers that ask)
    ranked = True
    #: number of queues (heaps) the policy's order is made of
    num_queues = 1
    #: whether the order of the tracked keys is independent of later inserts and of how many
    #: keys are tracked, so that a tier may make room for a whole chain of new keys before
    #: inserting it and evict what it would evict before each key (LRU, FIFO, LFU: yes;
    #: S3-FIFO and ARC size their queues by what is tracked: no)
    victims_ignore_inserts = True
    #: the module serving ``on_request`` from a leaf-first index (None: no index)
    _index_ops = None

    def __init__(self) -> None:
        self._nbytes: dict[Key, int] = {}
        self._parent: dict[Key, Key | None] = {}
        self._children: dict[Key, set[Key]] = {}  # parent -> stored children (parent may be absent)
        self._ranks: dict[Key, int] = {}  # key -> rank within its queue (smallest first)
        self._queue: dict[Key, int] = {}  # key -> queue id (absent: queue 0)
        self._heaps: list[list[tuple[int, Key]]] = [[] for _ in range(self.num_queues)]
        self._heap_entries = 0  # entries over all heaps, live or stale
        self._demoted: dict[Key, int] = {}  # demoted key -> demotion sequence number
        self._demoted_heap: list[tuple[int, Key]] = []  # (seq, key) of demoted keys, lazily pruned
        self._demote_seq = 0
        #: LRU's, FIFO's and LFU's leaf-first index while every event came through
        #: ``on_request`` (``kvstore.eviction.leaf_first``); the heaps are rebuilt when it
        #: is dropped. ``_index_ops``: the module with its ``request``, ``leave`` and
        #: ``check_index``
        self._leaf_first: OrderedDict | dict | None = None
        self._sizes_view = MappingProxyType(self._nbytes)
        #: the subclass's ``_remove`` (None when it keeps no order of its own to update)
        self._remove_hook = None if type(self)._remove is EvictionPolicy._remove else self._remove

    # ---- events -------------------------------------------------------------------------
    def on_insert(self, key: Key, nbytes: int, parent: Key | None = None) -> None:
        if key in self._nbytes:
            raise KeyError(f"{key!r} already tracked by {self.name} policy")
        if self._leaf_first is not None:
            self._drop_leaf_first()
        self._nbytes[key] = nbytes
        self._parent[key] = parent
        if parent is not None:
            kids = self._children.get(parent)
            if kids is None:
                self._children[parent] = {key}
            else:
                kids.add(key)
        self._insert(key)

    def on_access(self, key: Key) -> None:
        if key in self._nbytes:
            if self._leaf_first is not None:
                self._drop_leaf_first()
            self._demoted.pop(key, None)
            self._access(key)

    def demote(self, key: Key) -> bool:
        """Make tracked ``key`` the first victim once it has no stored child (see the class
        docstring). Returns whether ``key`` is tracked (False: ignored)."""
        if key not in self._nbytes:
            return False
        if self._leaf_first is not None:
            self._drop_leaf_first()
        if key not in self._demoted:
            self._demote_seq += 1
            self._demoted[key] = self._demote_seq
            self._push_demoted(key)
        return True

    def undemote(self, key: Key) -> bool:
        """Lift ``key``'s demotion without counting a read (its rank stays); returns whether
        it was demoted. (The demoted heap's entry goes stale and is dropped when met.)"""
        return self._demoted.pop(key, None) is not None

    def is_demoted(self, key: Key) -> bool:
        """Whether ``key`` is tracked and demoted (O(1), no side effects)."""
        return key in self._demoted

    @property
    def num_demoted(self) -> int:
        """Tracked keys demoted now."""
        return len(self._demoted)

    def _push_demoted(self, key: Key) -> None:
        """Record demoted ``key`` in the demoted heap when it has no stored child (one with a
        child is pushed when its last child goes). Prunes stale entries past 2x live ones."""
        if key in self._children:
            return
        heap = self._demoted_heap
        if len(heap) > 2 * len(self._demoted) + 64:
            self._demoted_heap = heap = [(s, k) for s, k in heap if self._demoted.get(k) == s
                                         and k not in self._children]
            heapq.heapify(heap)
        _heappush(heap, (self._demoted[key], key))

    def on_remove(self, key: Key) -> None:
        if key in self._nbytes:
            if self._leaf_first is not None:
                self._drop_leaf_first()
            self._forget(key)

    def _forget(self, key: Key) -> None:
        """``on_remove`` of a tracked key."""
        self._remove(key)  # hook sees the key's size and parent before they are dropped
        del self._nbytes[key]
        del self._ranks[key]
        self._queue.pop(key, None)
        self._demoted.pop(key, None)
        parent = self._parent.pop(key)
        if parent is not None:
            kids = self._children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[parent]
                    if parent in self._nbytes:
                        self._push_leaf(parent)
                        if parent in self._demoted:
                            self._push_demoted(parent)

    # ---- batched events (the same decisions as the per-event calls, fewer Python calls) --------
    def on_access_many(self, keys: Iterable[Key]) -> None:
        """``on_access(k)`` for each of ``keys`` in order (unknown keys ignored). Mutates; the
        policies override it with one loop that inlines their ``_access``."""
        self._drop_leaf_first()
        for key in keys:
            self.on_access(key)

    def on_insert_chain(self, keys: Sequence[Key], nbytes: Sequence[int],
                        parent: Key | None = None) -> None:
        """Insert a chain of new keys at once: ``keys[0]`` (``nbytes[0]`` bytes) under
        ``parent``, then each key under the one before it; the same state as ``on_insert`` per
        key in order (only the chain's last key enters a leaf heap: the others have a child).

        Raises:
            ValueError: ``keys`` and ``nbytes`` differ in length.
            KeyError: a key is already tracked or repeated in ``keys`` (nothing is inserted).
        """
        self._drop_leaf_first()
        _batched.link_chain(self, keys, nbytes, parent)
        self._insert_many(keys)

    def _insert_many(self, keys: Sequence[Key]) -> None:
        """``_insert`` for each of ``keys`` (already in the base's indexes), in order."""
        for key in keys:
            self._insert(key)

    def evict_until(self, nbytes: int, can_evict: Callable[[Key], bool] = _always,
                    leaves_only: bool = False) -> list[Key]:
        """Remove victims until their sizes add up to at least ``nbytes``; returns them in
        eviction order (fewer, freeing less, when ``next_victim`` finds no more). The same as
        ``v = next_victim(can_evict, leaves_only)`` then ``on_remove(v)`` in a loop, so
        ``can_evict`` is asked after each removal and may depend on it. Mutates."""
        self._drop_leaf_first()
        return _batched.evict_until(self, nbytes, can_evict, leaves_only)[0]

    def on_request(self, hits: Sequence[Key], keys: Sequence[Key], nbytes: Sequence[int],
                   free_bytes: int, admit: Admit | None = None) -> Request:
        """One prompt served by a one-tier prefix cache, at once: ``hits`` (its stored head,
        head first) are read, then new ``keys`` (``nbytes`` each; each the parent of the next,
        ``keys[0]`` under ``hits[-1]``, or a root without hits) are stored in order while they
        fit: before each, leaves other than its parent are evicted until it fits in
        ``free_bytes`` plus the bytes freed, less the bytes stored; the first that does not
        fit (no leaf left) ends the request, as does ``admit(key, victim, num_keys)``
        (an admission filter, optional) refusing a key that needs room the first victim
        ``next_victim`` names (``num_keys``: the keys tracked then). Mutates. The same
        decisions and ranks as ``on_access_many(hits)``, then per key ``evict_until(need,
        lambda v: v != parent, True)`` and ``on_insert``. LRU, FIFO and LFU pop victims from a leaf-first index
        instead of heaps while every event came this way and each request's ``hits`` are a
        chain from a root (``kvstore.eviction.leaf_first``, ``leaf_first_lfu``).

        Raises:
            ValueError: ``keys`` and ``nbytes`` differ in length (nothing changed).
            KeyError: a key of ``keys`` is tracked or repeated (nothing changed).
        """
        if self._leaf_first is not None:
            done = self._index_ops.request(self, hits, keys, nbytes, free_bytes, admit)
            if done is not None:
                return done
            self._drop_leaf_first()
        return _batched.request(self, hits, keys, nbytes, free_bytes, admit)

    def _drop_leaf_first(self) -> None:
        """Leave the leaf-first index for good: ranks, child sets and heaps rebuilt."""
        if self._leaf_first is not None:
            self._index_ops.leave(self)
            self._leaf_first = None
            self._rebuild_heaps()

    # ---- ranks (called by the subclasses' hooks) -----------------------------------------------
    def _rank(self, key: Key, rank: int, queue: int = 0) -> None:
        """Place tracked ``key`` in ``queue`` at ``rank`` (its position there: smallest first)."""
        self._ranks[key] = rank
        if queue:
            self._queue[key] = queue
        elif self.num_queues > 1:
            self._queue.pop(key, None)
        if key not in self._children:
            self._heap_entries += 1
            if self._heap_entries > 2 * len(self._nbytes) + 64:
                self._rebuild_heaps()
            else:
                _heappush(self._heaps[queue], (rank, key))

    def _push_leaf(self, key: Key) -> None:
        """Record tracked ``key`` in its queue's leaf heap at its current rank (it has no
        stored child)."""
        self._heap_entries += 1
        if self._heap_entries > 2 * len(self._nbytes) + 64:
            self._rebuild_heaps()
        else:
            _heappush(self._heaps[self._queue.get(key, 0)], (self._ranks[key], key))

    def _rebuild_heaps(self) -> None:
        """Drop every stale heap entry: one entry per key with no stored child. O(n), done
        when the heaps hold more than twice the tracked keys (so O(1) amortized)."""
        heaps: list[list[tuple[int, Key]]] = [[] for _ in range(self.num_queues)]
        queue, children = self._queue, self._children
        for k, r in self._ranks.items():
            if k not in children:
                heaps[queue.get(k, 0)].append((r, k))
        for h in heaps:
            heapq.heapify(h)
        self._heaps = heaps
        self._heap_entries = sum(len(h) for h in heaps)

    # ---- queries ------------------------------------------------------------------------
    def next_victim(self, can_evict: Callable[[Key], bool] = _always,
                    leaves_only: bool = False) -> Key | None:
        """See the class docstring; ``leaves_only``: no second choice (None when no key
        without a stored child passes ``can_evict``)."""
        # keys with a stored child are skipped before ``can_evict`` is asked (it may cost
        # more than a dict lookup); they are the second choice, in the same order
        self._drop_leaf_first()
        if self._demoted:
            victim = self._first_demoted(can_evict)
            if victim is not None:
                return victim
        if self.num_queues == 1:
            victim = self._first_leaf(0, can_evict)
            if victim is not None:
                return victim
        else:
            for q in self._queues():
                victim = self._first_leaf(q, can_evict)
                if victim is not None:
                    return victim
        return None if leaves_only else self._first_with_children(can_evict)

    def _first_with_children(self, can_evict: Callable[[Key], bool]) -> Key | None:
        """``next_victim``'s second choice (``kvstore.eviction.victims``)."""
        return _victims.first_with_children(self, can_evict)

    def _first_demoted(self, can_evict: Callable[[Key], bool]) -> Key | None:
        """The oldest-demoted evictable leaf (``kvstore.eviction.victims``)."""
        return _victims.first_demoted(self, can_evict)

    def _first_leaf(self, q: int, can_evict: Callable[[Key], bool]) -> Key | None:
        """Queue ``q``'s first evictable leaf (``kvstore.eviction.victims``)."""
        return _victims.first_leaf(self, q, can_evict)

    def children(self, key: Key) -> set[Key]:
        """Tracked keys whose recorded parent is ``key`` (a new set; ``key`` need not be
        tracked). Leaves the leaf-first index (it keeps no child sets)."""
        self._drop_leaf_first()
        return set(self._children.get(key, ()))

    def has_children(self, key: Key) -> bool:
        """Whether some tracked key records ``key`` as its parent (O(1), no copy; leaves the
        leaf-first index, O(n) once)."""
        self._drop_leaf_first()
        return key in self._children

    @property
    def sizes(self) -> Mapping[Key, int]:
        """Tracked key -> its bytes: a live read-only view (O(1) lookups)."""
        return self._sizes_view

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
        """Raise ``AssertionError`` if the policy's indexes disagree with each other
        (``kvstore.eviction.integrity``)."""
        _integrity.check_policy(self)

    # ---- subclass hooks -------------------------------------------------------------------
    def _queues(self) -> list[int]:
        """Queue ids in victim order now (each once). One queue: ``[0]``."""
        return [0]

    @abstractmethod
    def _insert(self, key: Key) -> None: ...

    @abstractmethod
    def _access(self, key: Key) -> None: ...

    def _remove(self, key: Key) -> None:
        """Before the base drops ``key``'s size, parent, rank and queue (default: nothing
        to do, for a policy whose order is its ranks' dict)."""

    @abstractmethod
    def _order(self) -> Iterator[Key]:
        """Tracked keys, most evictable first (each exactly once): the queues of
        ``_queues()`` one after the other, each by rank."""

"""ARC (Megiddo and Modha, FAST'03): adaptive replacement between recency and frequency.

* ``T1`` holds keys used once since they entered (LRU order), ``T2`` keys used again (LRU
  order); a read moves a key to the MRU end of ``T2``.
* ``B1`` and ``B2`` are ghosts: names of keys evicted from ``T1`` and ``T2``. Inserting a key
  remembered by ``B1`` means T1 was too small: the target ``p`` (bytes T1 should hold) grows;
  one remembered by ``B2`` shrinks it. Either way the key enters ``T2``.
* Victims come from T1's LRU end while T1 holds more than ``p`` bytes, else from T2's.

Sizes are bytes (the paper's unit sizes scaled by each key's ``nbytes``): ``p`` moves by
``max(|B2| / |B1|, 1) * nbytes`` and stays within [0, tracked bytes]. The tier, not the policy,
decides when to evict, so the paper's capacity ``c`` is the keys the tier holds now: ghosts are
trimmed to ``|T1| + |B1| <= c`` and ``|B1| + |B2| <= c`` (counts). The paper's tie rule (evict
from T1 when ``|T1| == p`` and the incoming key is in B2) needs the incoming key, which a
listener does not see at victim time; here the tie goes to T2.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.batched import Request, add_child, check_chain
from kvstore.eviction.queued import drop, flush, peek_leaf, pop_leaf

_T1_FIRST, _T2_FIRST = (0, 1), (1, 0)


class ARCPolicy(EvictionPolicy):
    """ARC over the tier's keys; O(1) per event, victim choice O(log n) (a leaf heap per
    list). Queues: 0 = T1, 1 = T2; a key's rank is the event clock when it entered (or was
    last moved to) its list's MRU end."""

    name = "arc"
    num_queues = 2
    victims_ignore_inserts = False

    def __init__(self) -> None:
        super().__init__()
        self._t1: OrderedDict = OrderedDict()
        self._t2: OrderedDict = OrderedDict()
        self._b1: OrderedDict = OrderedDict()
        self._b2: OrderedDict = OrderedDict()
        self._t1_bytes = 0
        self._total_bytes = 0
        self.p = 0.0  # target bytes of T1
        self._clock = itertools.count()

    def _insert(self, key) -> None:
        nbytes = self._nbytes[key]
        self._total_bytes += nbytes
        if key in self._b1:
            self.p = min(float(self._total_bytes),
                         self.p + max(len(self._b2) / len(self._b1), 1.0) * nbytes)
            del self._b1[key]
            self._t2[key] = None
            self._rank(key, next(self._clock), 1)
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0) * nbytes)
            del self._b2[key]
            self._t2[key] = None
            self._rank(key, next(self._clock), 1)
        else:
            self._t1[key] = None
            self._t1_bytes += nbytes
            self._rank(key, next(self._clock), 0)

    def _access(self, key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t1_bytes -= self._nbytes[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)
        self._rank(key, next(self._clock), 1)

    def _remove(self, key) -> None:
        nbytes = self._nbytes[key]
        self._total_bytes -= nbytes
        if key in self._t1:
            del self._t1[key]
            self._t1_bytes -= nbytes
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def on_request(self, hits, keys, nbytes, free_bytes, admit=None) -> Request:
        """``EvictionPolicy.on_request`` with the per-event hooks inline (the same decisions,
        ranks, lists and target ``p`` as ``on_access`` per hit, then per new key
        ``evict_until`` sparing its parent, leaves only, and ``on_insert``); ``admit``, when
        given, asked before a key's first victim goes (``queued.peek_leaf``); the general path
        with a demoted key. Raises as ``on_request``."""
        if self._demoted:
            return super().on_request(hits, keys, nbytes, free_bytes, admit)
        check_chain(self, keys, nbytes)
        sizes, parents, children, ranks, queue = (self._nbytes, self._parent, self._children,
                                                  self._ranks, self._queue)
        t1, t2, b1, b2, clock = self._t1, self._t2, self._b1, self._b2, self._clock
        t1_bytes, total, p = self._t1_bytes, self._total_bytes, self.p
        for key in hits:  # ``_access``: to T2's MRU end
            if key in sizes:
                if key in t1:
                    del t1[key]
                    t1_bytes -= sizes[key]
                    t2[key] = None
                else:
                    t2.move_to_end(key)
                ranks[key] = next(clock)
                queue[key] = 1
                if key not in children:
                    self._push_leaf(key)
        parent = hits[-1] if hits else None
        victims: list = []
        room, freed, stored = free_bytes, 0, 0
        pending = None  # a leaf-heap entry not pushed yet (``queued.pop_leaf``)
        for key, n in zip(keys, nbytes):
            ask = admit
            while n > room:
                queues = _T1_FIRST if t1 and (t1_bytes > p or not t2) else _T2_FIRST
                if ask is not None:  # the filter judges the first victim, still in place
                    victim = peek_leaf(self, queues, parent, pending)
                    pending = ask = None
                    if victim is None or not admit(key, victim, len(sizes)):
                        break
                victim, pending = pop_leaf(self, queues, parent, pending)
                if victim is None:
                    break
                size = sizes[victim]  # ``_remove`` and ``_trim_ghosts``
                total -= size
                if victim in t1:
                    del t1[victim]
                    t1_bytes -= size
                    b1[victim] = None
                else:
                    del t2[victim]
                    b2[victim] = None
                c = max(len(sizes) - 1, 1)
                while b1 and len(t1) + len(b1) > c:
                    b1.popitem(last=False)
                while len(b1) + len(b2) > c:
                    (b2 or b1).popitem(last=False)
                pending = drop(self, victim, pending, victims)  # (its parent's heap entry)
                freed += size
                room += size
            if n > room:
                break
            sizes[key], parents[key] = n, parent  # ``on_insert``; the leaf-heap entry of
            if parent is not None:  # the last key only (the others get a child next)
                add_child(children, parent, key)
            total += n
            ranks[key] = next(clock)
            if key in b1:
                p = min(float(total), p + max(len(b2) / len(b1), 1.0) * n)
                del b1[key]
                t2[key] = None
                queue[key] = 1
            elif key in b2:
                p = max(0.0, p - max(len(b1) / len(b2), 1.0) * n)
                del b2[key]
                t2[key] = None
                queue[key] = 1
            else:
                t1[key] = None
                t1_bytes += n
            room -= n
            stored += 1
            parent = key
        self._t1_bytes, self._total_bytes, self.p = t1_bytes, total, p
        flush(self, pending)
        if stored and parent not in children:
            self._push_leaf(parent)
        return Request(victims, stored, freed)

    def _trim_ghosts(self) -> None:
        c = max(len(self._nbytes) - 1, 1)  # (the removed key is still counted here)
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self._b1) + len(self._b2) > c:
            (self._b2 or self._b1).popitem(last=False)

    def _queues(self) -> list[int]:
        if self._t1 and (self._t1_bytes > self.p or not self._t2):
            return [0, 1]
        return [1, 0]

    def _order(self):
        first, second = ((self._t1, self._t2) if self._queues()[0] == 0
                         else (self._t2, self._t1))
        # lazy: valid until the next event (the caller stops at its victim, then removes it)
        return itertools.chain(first, second)

    def check_integrity(self) -> None:
        super().check_integrity()
        assert not (set(self._t1) & set(self._t2)), "arc: key in both T1 and T2"
        assert not (set(self._b1) & set(self._b2)), "arc: ghost in both B1 and B2"
        assert not ((set(self._b1) | set(self._b2)) & set(self._nbytes)), "arc: tracked ghost"
        assert self._t1_bytes == sum(self._nbytes[k] for k in self._t1), "arc: T1 bytes drifted"
        assert self._total_bytes == sum(self._nbytes.values()), "arc: tracked bytes drifted"
        assert self.p >= 0.0, "arc: negative target"

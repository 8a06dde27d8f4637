"""S3-FIFO (Yang et al., SOSP'23): a scan-resistant policy from three FIFO queues.

* ``small`` (S, ~10% of tracked bytes) takes new keys; a key evicted from S unread is a
  one-hit wonder and its name goes to the ``ghost`` queue.
* ``main`` (M) takes keys read while in S and keys re-inserted while remembered by the ghost.
* Each key has a 2-bit frequency (0..3) bumped on access. M evicts like CLOCK: a head with
  frequency > 0 is decremented and moved to the tail.

A long scan of keys read once therefore only churns S, and keys read twice stay in M.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.batched import Request, add_child, check_chain
from kvstore.eviction.queued import drop, flush, peek_leaf, pop_leaf

_S_FIRST, _M_FIRST = (0, 1), (1, 0)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with a byte-sized small queue (``small_ratio`` of tracked bytes).

    Queues: 0 = S, 1 = M; a key's rank is the event clock when it entered its queue's tail.
    Cost: O(1) per event; choosing a victim is amortized O(1) (settling S's and M's heads)
    plus O(log n) for the leaf heap (the tracked total is kept as a running sum)."""

    name = "s3fifo"
    num_queues = 2
    victims_ignore_inserts = False

    def __init__(self, small_ratio: float = 0.1) -> None:
        super().__init__()
        self.small_ratio = small_ratio
        self._small: OrderedDict = OrderedDict()
        self._main: OrderedDict = OrderedDict()
        self._ghost: OrderedDict = OrderedDict()
        self._freq: dict = {}
        self._small_bytes = 0
        self._total_bytes = 0  # sum of self._nbytes, kept as events arrive
        self._clock = itertools.count()

    def _insert(self, key) -> None:
        self._freq[key] = 0
        self._total_bytes += self._nbytes[key]
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
            self._rank(key, next(self._clock), 1)
        else:
            self._small[key] = None
            self._small_bytes += self._nbytes[key]
            self._rank(key, next(self._clock), 0)

    def _access(self, key) -> None:
        f = self._freq[key]
        if f < 3:
            self._freq[key] = f + 1

    def _remove(self, key) -> None:
        self._total_bytes -= self._nbytes[key]
        if key in self._small:
            del self._small[key]
            self._small_bytes -= self._nbytes[key]
            if self._freq[key] == 0:  # evicted from S unread: remember it
                self._ghost[key] = None
                while len(self._ghost) > max(len(self._main), 1):
                    self._ghost.popitem(last=False)
        else:
            del self._main[key]
        del self._freq[key]

    def _settle(self) -> None:
        """Move read keys from the head of S to M, and age M's head (CLOCK), before choosing."""
        total = self._total_bytes or 1
        small, main, freq = self._small, self._main, self._freq
        while small and (self._small_bytes > self.small_ratio * total or not main):
            head = next(iter(small))
            if freq[head] == 0:
                break
            del small[head]
            self._small_bytes -= self._nbytes[head]
            freq[head] = 0
            main[head] = None
            self._rank(head, next(self._clock), 1)
        self._rotate_main()

    def _rotate_main(self) -> None:
        """Main's heads that were read since they came round go to its tail one count lower,
        until a head that was not (S3-FIFO's reinsertion in the main queue)."""
        main, freq = self._main, self._freq
        for _ in range(len(main)):
            head = next(iter(main))
            if freq[head] == 0:
                break
            freq[head] -= 1
            main.move_to_end(head)
            self._rank(head, next(self._clock), 1)

    def on_request(self, hits, keys, nbytes, free_bytes, admit=None) -> Request:
        """``EvictionPolicy.on_request`` with the per-event hooks inline (the same decisions,
        ranks and queues as ``on_access`` per hit, then per new key ``evict_until`` sparing
        its parent, leaves only, and ``on_insert``); ``admit``, when given, asked before
        a key's first victim goes (``queued.peek_leaf``); the general path with a demoted
        key. Raises as ``on_request``."""
        if self._demoted:
            return super().on_request(hits, keys, nbytes, free_bytes, admit)
        check_chain(self, keys, nbytes)
        freq = self._freq
        for key in hits:  # (reads only bump the 2-bit frequency)
            f = freq.get(key)
            if f is not None and f < 3:
                freq[key] = f + 1
        if not keys:
            return Request([], 0, 0)
        sizes, parents, children, ranks, queue = (self._nbytes, self._parent, self._children,
                                                  self._ranks, self._queue)
        small, main, ghost, clock, ratio = (self._small, self._main, self._ghost, self._clock,
                                            self.small_ratio)
        small_bytes, total = self._small_bytes, self._total_bytes
        parent = hits[-1] if hits else None
        victims: list = []
        room, freed, stored = free_bytes, 0, 0
        pending = None  # a leaf-heap entry not pushed yet (``queued.pop_leaf``)
        for key, n in zip(keys, nbytes):
            ask = admit
            while n > room:  # ``_settle`` and ``_queues``, then one victim
                tot = total or 1
                while small and (small_bytes > ratio * tot or not main):
                    head = next(iter(small))
                    if freq[head] == 0:
                        break
                    del small[head]
                    small_bytes -= sizes[head]
                    freq[head] = 0
                    main[head] = None
                    self._rank(head, next(clock), 1)
                if main and freq[next(iter(main))]:
                    self._rotate_main()
                queues = _S_FIRST if small_bytes > ratio * tot or not main else _M_FIRST
                if ask is not None:  # the filter judges the first victim, still in place;
                    victim = peek_leaf(self, queues, parent, pending)  # then settle again
                    pending = ask = None  # (as ``evict_until`` after ``next_victim``: M's
                    if victim is None or not admit(key, victim, len(sizes)):  # rotation
                        break  # stops after one round, so a second may move more)
                    continue
                victim, pending = pop_leaf(self, queues, parent, pending)
                if victim is None:
                    break
                size = sizes[victim]  # ``_remove``
                total -= size
                if victim in small:
                    del small[victim]
                    small_bytes -= size
                    if freq[victim] == 0:  # evicted from S unread: remember it
                        ghost[victim] = None
                        while len(ghost) > max(len(main), 1):
                            ghost.popitem(last=False)
                else:
                    del main[victim]
                del freq[victim]
                pending = drop(self, victim, pending, victims)  # (its parent's heap entry)
                freed += size
                room += size
            if n > room:
                break
            sizes[key] = n  # ``on_insert``; the leaf-heap entry of the last key only (the
            parents[key] = parent  # others get a child next, the new key being spared)
            if parent is not None:
                add_child(children, parent, key)
            freq[key] = 0
            total += n
            ranks[key] = next(clock)
            if key in ghost:
                del ghost[key]
                main[key] = None
                queue[key] = 1
            else:
                small[key] = None
                small_bytes += n
            room -= n
            stored += 1
            parent = key
        self._small_bytes, self._total_bytes = small_bytes, total
        flush(self, pending)
        if stored and parent not in children:
            self._push_leaf(parent)
        return Request(victims, stored, freed)

    def _queues(self) -> list[int]:
        self._settle()
        if self._small_bytes > self.small_ratio * (self._total_bytes or 1) or not self._main:
            return [0, 1]
        return [1, 0]

    def _order(self):
        first, second = ((self._small, self._main) if self._queues()[0] == 0
                         else (self._main, self._small))
        # lazy: valid until the next event (the caller stops at its victim, then removes it)
        return itertools.chain(first, second)

    def check_integrity(self) -> None:
        super().check_integrity()
        assert not (set(self._small) & set(self._main)), "s3fifo: key in both S and M"
        assert all(self._queue.get(k, 0) == 0 for k in self._small), "s3fifo: S key ranked in M"
        assert all(self._queue.get(k, 0) == 1 for k in self._main), "s3fifo: M key ranked in S"
        assert self._small_bytes == sum(self._nbytes[k] for k in self._small), \
            "s3fifo: small-queue bytes drifted"
        assert self._total_bytes == sum(self._nbytes.values()), "s3fifo: tracked bytes drifted"

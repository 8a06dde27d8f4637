"""Least frequently used: evict the key with the fewest accesses; ties go least recent first."""
from __future__ import annotations

import itertools
from collections import OrderedDict

from kvstore.eviction import leaf_first_lfu
from kvstore.eviction.base import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    """Frequency buckets (``freq -> OrderedDict`` in recency order). An insert counts as one use.

    O(1) per event; ``_order`` sorts only the distinct frequencies. Rank: (frequency, event
    clock when the key entered its bucket) as one int, ``frequency << 40 | clock``. Until an
    event comes other than through ``on_request``, the buckets are a leaf-first index
    (``kvstore.eviction.leaf_first_lfu``) and ``_order`` sorts the ranks.
    """

    name = "lfu"
    _index_ops = leaf_first_lfu

    def __init__(self) -> None:
        super().__init__()
        self._freq: dict = {}
        self._buckets: dict[int, OrderedDict] = {}
        self._clock = itertools.count()
        self._leaf_first = self._buckets

    def _insert(self, key) -> None:
        self._freq[key] = 1
        self._bucket(1)[key] = None
        self._rank(key, 1 << 40 | next(self._clock))

    def _access(self, key) -> None:
        f = self._freq[key]
        self._drop_from_bucket(key, f)
        self._freq[key] = f + 1
        self._bucket(f + 1)[key] = None
        self._rank(key, (f + 1) << 40 | next(self._clock))

    def _insert_many(self, keys) -> None:
        freq, ranks, clock, bucket = self._freq, self._ranks, self._clock, self._bucket(1)
        for key in keys:
            freq[key] = 1
            bucket[key] = None
            ranks[key] = 1 << 40 | next(clock)
        if keys and keys[-1] not in self._children:  # (the others have a child: the next)
            self._push_leaf(keys[-1])

    def on_access_many(self, keys) -> None:
        self._drop_leaf_first()
        sizes, demoted, freq, buckets, ranks, children, clock = (
            self._nbytes, self._demoted, self._freq, self._buckets, self._ranks,
            self._children, self._clock)
        push = self._push_leaf
        for key in keys:
            if key in sizes:
                if demoted:
                    demoted.pop(key, None)
                f = freq[key]
                bucket = buckets[f]
                del bucket[key]
                if not bucket:
                    del buckets[f]
                f += 1
                freq[key] = f
                bucket = buckets.get(f)
                if bucket is None:
                    bucket = buckets[f] = OrderedDict()
                bucket[key] = None
                ranks[key] = f << 40 | next(clock)
                if key not in children:
                    push(key)

    def _remove(self, key) -> None:
        self._drop_from_bucket(key, self._freq.pop(key))

    def _bucket(self, f: int) -> OrderedDict:
        b = self._buckets.get(f)
        if b is None:
            b = self._buckets[f] = OrderedDict()
        return b

    def _drop_from_bucket(self, key, f: int) -> None:
        bucket = self._buckets[f]
        del bucket[key]
        if not bucket:
            del self._buckets[f]

    def _order(self):
        if self._leaf_first is not None:
            return iter(sorted(self._ranks, key=self._ranks.__getitem__))
        keys = []
        for f in sorted(self._buckets):
            keys.extend(self._buckets[f])
        return iter(keys)

    def frequency(self, key) -> int:
        """Uses of ``key`` so far (insert = 1), 0 if untracked."""
        rank = self._ranks.get(key)
        return 0 if rank is None else rank >> 40

"""Least frequently used: evict the key with the fewest accesses; ties go least recent first."""
from __future__ import annotations

from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    """Frequency buckets (``freq -> OrderedDict`` in recency order). An insert counts as one use.

    O(1) per event; ``_order`` sorts only the distinct frequencies.
    """

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._freq: dict = {}
        self._buckets: dict[int, OrderedDict] = {}

    def _insert(self, key) -> None:
        self._freq[key] = 1
        self._buckets.setdefault(1, OrderedDict())[key] = None

    def _access(self, key) -> None:
        f = self._freq[key]
        self._drop_from_bucket(key, f)
        self._freq[key] = f + 1
        self._buckets.setdefault(f + 1, OrderedDict())[key] = None

    def _remove(self, key) -> None:
        self._drop_from_bucket(key, self._freq.pop(key))

    def _drop_from_bucket(self, key, f: int) -> None:
        bucket = self._buckets[f]
        del bucket[key]
        if not bucket:
            del self._buckets[f]

    def _order(self):
        keys = []
        for f in sorted(self._buckets):
            keys.extend(self._buckets[f])
        return iter(keys)

    def frequency(self, key) -> int:
        """Uses of ``key`` so far (insert = 1), 0 if untracked."""
        return self._freq.get(key, 0)

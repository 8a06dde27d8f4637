"""Least recently used: evict the key whose last insert or access is oldest."""
from __future__ import annotations

import itertools
from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """LRU order kept in an ``OrderedDict`` (oldest first); O(1) per event. Rank: the event
    clock at the last insert or access."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._od: OrderedDict = OrderedDict()
        self._clock = itertools.count()

    def _insert(self, key) -> None:
        self._od[key] = None
        self._rank(key, next(self._clock))

    def _access(self, key) -> None:
        self._od.move_to_end(key)
        self._rank(key, next(self._clock))

    def _remove(self, key) -> None:
        del self._od[key]

    def _order(self):
        return iter(self._od)

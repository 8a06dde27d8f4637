"""Least recently used: evict the key whose last insert or access is oldest."""
from __future__ import annotations

import itertools

from kvstore.eviction.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """LRU order kept in the ranks' dict itself (oldest first: an access deletes and re-adds
    the key); O(1) per event. Rank: the event clock at the last insert or access."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._clock = itertools.count()

    def _insert(self, key) -> None:
        self._rank(key, next(self._clock))

    def _access(self, key) -> None:
        del self._ranks[key]  # re-added at the end by ``_rank``
        self._rank(key, next(self._clock))

    def _insert_many(self, keys) -> None:
        ranks, clock = self._ranks, self._clock
        for key in keys:
            ranks[key] = next(clock)
        if keys and keys[-1] not in self._children:  # (the others have a child: the next)
            self._push_leaf(keys[-1])

    def on_access_many(self, keys) -> None:
        sizes, demoted, ranks, children, clock = (self._nbytes, self._demoted, self._ranks,
                                                  self._children, self._clock)
        push = self._push_leaf
        for key in keys:
            if key in sizes:
                if demoted:
                    demoted.pop(key, None)
                del ranks[key]
                ranks[key] = next(clock)
                if key not in children:
                    push(key)

    def _order(self):
        return iter(self._ranks)

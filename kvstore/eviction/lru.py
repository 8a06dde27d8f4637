"""Least recently used: evict the key whose last insert or access is oldest."""
from __future__ import annotations

import itertools
from collections import OrderedDict

from kvstore.eviction import leaf_first
from kvstore.eviction.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """LRU order kept in the ranks' dict itself (oldest first: an access deletes and re-adds
    the key); O(1) per event. Rank: the event clock at the last insert or access. Until an
    event comes other than through ``on_request``, the ranks' dict is the leaf-first index
    (``kvstore.eviction.leaf_first``) and ``_order`` sorts it."""

    name = "lru"
    #: whether a read moves a key in the order (the leaf-first index reads it)
    reads_reorder = True
    _index_ops = leaf_first

    def __init__(self) -> None:
        super().__init__()
        self._clock = itertools.count()
        self._leaf_first = self._ranks = OrderedDict()

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
        self._drop_leaf_first()
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
        if self._leaf_first is not None:
            return iter(sorted(self._ranks, key=self._ranks.__getitem__))
        return iter(self._ranks)

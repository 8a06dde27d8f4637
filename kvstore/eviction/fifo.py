"""First in, first out: evict the oldest inserted key; accesses do not reorder."""
from __future__ import annotations

from kvstore.eviction.lru import LRUPolicy


class FIFOPolicy(LRUPolicy):
    """LRU's insertion-ordered ``OrderedDict`` without the move on access; O(1) per event.
    Rank: the event clock at insert."""

    name = "fifo"
    reads_reorder = False

    def _access(self, key) -> None:
        pass

    def on_access_many(self, keys) -> None:
        demoted = self._demoted
        if demoted:
            for key in keys:
                demoted.pop(key, None)

"""First in, first out: evict the oldest inserted key; accesses do not reorder."""
from __future__ import annotations

from collections import OrderedDict

from kvstore.eviction.base import EvictionPolicy


class FIFOPolicy(EvictionPolicy):
    """Insertion order in an ``OrderedDict``; O(1) per event."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._od: OrderedDict = OrderedDict()

    def _insert(self, key) -> None:
        self._od[key] = None

    def _access(self, key) -> None:
        pass

    def _remove(self, key) -> None:
        del self._od[key]

    def _order(self):
        return iter(self._od)

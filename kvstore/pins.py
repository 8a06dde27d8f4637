"""Pin bookkeeping of the chunk store: ref counts that keep chunks from being evicted.

Three kinds of pin, each a count per key (a chunk may hold several of each):

* reader pins, taken by ``get_chunks`` for the duration of a copy out of a tier;
* explicit pins (``pin`` without a lease), dropped only by ``unpin``;
* leased pins (``pin(..., lease_s)``), dropped by ``unpin`` or when the lease expires.

A chunk with any pin is not evictable. Not thread-safe: the store calls it under its lock.
"""
from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

from kvstore.keys import ChunkKey


def _dec(counts: dict, key: ChunkKey) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


class PinTable:
    """Pin counts per key plus the heap of lease expiries (monotonic seconds)."""

    def __init__(self) -> None:
        self.readers: dict[ChunkKey, int] = defaultdict(int)
        self.explicit: dict[ChunkKey, int] = defaultdict(int)
        self.leased: dict[ChunkKey, int] = defaultdict(int)
        self._cancels: dict[ChunkKey, int] = defaultdict(int)  # leases ended early by unpin
        self._leases: list[tuple[float, int, ChunkKey]] = []  # heap of (expiry, seq, key)
        self._seq = itertools.count()

    def count(self, key: ChunkKey) -> int:
        """All pins of ``key`` (readers + explicit + leased)."""
        return self.readers.get(key, 0) + self.explicit.get(key, 0) + self.leased.get(key, 0)

    def evictable(self, key: ChunkKey) -> bool:
        return self.count(key) == 0

    def add_reader(self, key: ChunkKey) -> None:
        self.readers[key] += 1

    def drop_reader(self, key: ChunkKey) -> None:
        _dec(self.readers, key)

    def pin(self, key: ChunkKey, expiry: float | None) -> None:
        """An explicit pin (``expiry`` None) or a leased one ending at ``expiry``."""
        if expiry is None:
            self.explicit[key] += 1
        else:
            self.leased[key] += 1
            heapq.heappush(self._leases, (expiry, next(self._seq), key))

    def unpin(self, key: ChunkKey) -> bool:
        """Drop one explicit pin, else the oldest leased one. False if ``key`` has neither."""
        if self.explicit.get(key):
            _dec(self.explicit, key)
        elif self.leased.get(key):
            _dec(self.leased, key)
            self._cancels[key] += 1
        else:
            return False
        return True

    def expire(self, now: float) -> list[ChunkKey]:
        """Drop the leased pins whose lease ended by ``now``; returns their keys."""
        dropped = []
        while self._leases and self._leases[0][0] <= now:
            _, _, key = heapq.heappop(self._leases)
            if self._cancels.get(key):
                _dec(self._cancels, key)
            else:
                _dec(self.leased, key)
                dropped.append(key)
        return dropped

    def pinned_keys(self) -> set[ChunkKey]:
        return {k for d in (self.readers, self.explicit, self.leased) for k in d}

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if a count is <= 0 or the lease heap disagrees."""
        for d in (self.readers, self.explicit, self.leased, self._cancels):
            assert all(v > 0 for v in d.values()), "a pin count is <= 0"
        assert sum(self.leased.values()) + sum(self._cancels.values()) == len(self._leases), \
            "lease heap and lease counts disagree"

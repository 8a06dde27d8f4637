"""Admission filters: whether a chunk may enter a full tier at the cost of the tier's victim.

An eviction policy only orders what a tier holds; it cannot refuse a newcomer, so a burst of
chunks read once (a long unique prompt) flushes chunks that are read again. An admission
filter keeps an estimate of every key's recent request frequency (hits and misses alike) and,
when a tier has to evict to make room, lets the newcomer in only if it has been requested
more often than the victim it would displace. A victim spilled from a faster tier is a
newcomer for the tier below, so a chunk requested once is not written to a full disk tier
over one that was requested again.

``TinyLFU`` (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache Admission
Policy", 2017): a count-min sketch of 4-bit counters behind a *doorkeeper* (the set of keys
seen once in the current window: a key's first request only enters the doorkeeper, its later
ones are counted in the sketch), aged by halving every counter (and clearing the doorkeeper)
after ``window`` recorded requests, so old popularity fades.

A *demoted* victim (``EvictionPolicy.demote``: redundant, kept only while there is room) never
keeps a newcomer out: ``admit`` says yes whenever ``victim_demoted(victim)``, a test the store
sets (default: nothing is demoted).

Filters are not thread-safe; the store calls them under its lock.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable

Key = Hashable

#: Admission filter names accepted by ``create_admission`` (``"none"``: admit everything).
ADMISSIONS = ("none", "tinylfu")

_M64 = (1 << 64) - 1
#: Odd 64-bit multipliers, one per sketch row (multiplicative hashing; top bits = the index).
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_MAX_COUNT = 15  # 4-bit counters


class TinyLFU:
    """Frequency estimate of recently requested keys and the admission test built on it.

    Args:
        width: counters per sketch row (rounded up to a power of two, at least 16). With
            ``auto_grow`` it is a starting size: ``fit(n)`` widens the sketch to the next power
            of two >= ``n`` keys (the tier's key count), clearing it (rare: the width only
            doubles).
        window: requests between agings (each halves every counter and clears the
            doorkeeper); default ``10 * width`` (follows the width when it grows).
        auto_grow: whether ``fit`` may widen the sketch.

    Estimates are small integers: 0 (not requested in the window, or aged out) to 16 (15 in
    the sketch, plus 1 for the doorkeeper). Collisions of the sketch can only raise an
    estimate, never lower it.

    Raises:
        ValueError: ``width`` < 1 or ``window`` < 1.
    """

    name = "tinylfu"

    def __init__(self, width: int = 1024, window: int | None = None,
                 auto_grow: bool = True) -> None:
        if width < 1 or (window is not None and window < 1):
            raise ValueError(f"width {width} and window {window} must be >= 1")
        self._fixed_window = window
        self.auto_grow = auto_grow
        #: set by the store: is this victim demoted in the tier it is evicted from?
        self.victim_demoted: Callable[[Key], bool] = lambda key: False
        self._resize(width)

    def _resize(self, width: int) -> None:
        bits = max(4, (width - 1).bit_length())
        self.width = 1 << bits
        self._shift = 64 - bits
        self.window = self._fixed_window or 10 * self.width
        self._table = [0] * (4 * self.width)
        self._door: set = set()
        self._events = 0
        #: agings done so far (each halves the counters)
        self.agings = getattr(self, "agings", 0)

    # ---- recording -----------------------------------------------------------------------
    def _slots(self, key: Key) -> tuple[int, int, int, int]:
        h = hash(key) & _M64
        s, w = self._shift, self.width
        return (((h * _SEEDS[0]) & _M64) >> s,
                w + (((h * _SEEDS[1]) & _M64) >> s),
                2 * w + (((h * _SEEDS[2]) & _M64) >> s),
                3 * w + (((h * _SEEDS[3]) & _M64) >> s))

    def record(self, key: Key) -> None:
        """One request of ``key`` (a hit or a miss, whichever tier serves it)."""
        door = self._door
        if key not in door:
            door.add(key)
        else:
            t = self._table
            for i in self._slots(key):
                if t[i] < _MAX_COUNT:
                    t[i] += 1
        self._events += 1
        if self._events >= self.window:
            self._age()

    def record_many(self, keys: Iterable[Key]) -> None:
        """``record(k)`` for each of ``keys`` in order (one loop, the slots inlined)."""
        door, t = self._door, self._table
        s0, s1, s2, s3 = _SEEDS
        s, w = self._shift, self.width
        w2, w3 = 2 * w, 3 * w
        events, window = self._events, self.window
        for key in keys:
            if key not in door:
                door.add(key)
            else:
                h = hash(key) & _M64
                i = ((h * s0) & _M64) >> s
                if t[i] < _MAX_COUNT:
                    t[i] += 1
                i = w + (((h * s1) & _M64) >> s)
                if t[i] < _MAX_COUNT:
                    t[i] += 1
                i = w2 + (((h * s2) & _M64) >> s)
                if t[i] < _MAX_COUNT:
                    t[i] += 1
                i = w3 + (((h * s3) & _M64) >> s)
                if t[i] < _MAX_COUNT:
                    t[i] += 1
            events += 1
            if events >= window:
                self._events = events
                self._age()
                door, t, events = self._door, self._table, self._events
        self._events = events

    def _age(self) -> None:
        self._table = [c >> 1 for c in self._table]
        self._door.clear()
        self._events //= 2
        self.agings += 1

    def fit(self, num_keys: int) -> None:
        """Widen the sketch (clearing it) when a tier tracks more keys than it has counters
        per row; no-op without ``auto_grow`` or when wide enough. O(1) unless it widens."""
        if self.auto_grow and num_keys > self.width:
            self._resize(num_keys)

    # ---- queries -------------------------------------------------------------------------
    def estimate(self, key: Key) -> int:
        """Requests of ``key`` in the window so far (an upper estimate; see the class)."""
        t = self._table
        a, b, c, d = self._slots(key)
        return min(t[a], t[b], t[c], t[d]) + (1 if key in self._door else 0)

    def admit(self, candidate: Key, victim: Key) -> bool:
        """Whether ``candidate`` should displace ``victim``: the victim is demoted, or the
        candidate was requested strictly more often (ties keep the victim: the tier's content
        does not churn for nothing). (``estimate`` of both, inline.)"""
        if self.victim_demoted(victim):
            return True
        t, s, w = self._table, self._shift, self.width
        s0, s1, s2, s3 = _SEEDS
        h = hash(candidate) & _M64
        c = min(t[((h * s0) & _M64) >> s], t[w + (((h * s1) & _M64) >> s)],
                t[2 * w + (((h * s2) & _M64) >> s)], t[3 * w + (((h * s3) & _M64) >> s)])
        h = hash(victim) & _M64
        v = min(t[((h * s0) & _M64) >> s], t[w + (((h * s1) & _M64) >> s)],
                t[2 * w + (((h * s2) & _M64) >> s)], t[3 * w + (((h * s3) & _M64) >> s)])
        door = self._door
        return c + (candidate in door) > v + (victim in door)


def create_admission(name: str) -> TinyLFU | None:
    """A new admission filter for ``name`` (one of ``ADMISSIONS``; ``"none"`` gives None).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name == "none":
        return None
    if name == "tinylfu":
        return TinyLFU()
    raise ValueError(f"unknown admission filter {name!r}; choose one of {list(ADMISSIONS)}")

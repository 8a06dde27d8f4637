"""The one-tier replay's row path (``bench.policy_replay``) through the policies' batched calls.

A row is one ``on_request`` call: its hit prefix read, its missing chunks stored while leaves can
make room (LRU, FIFO and LFU then pop victims from a leaf-first index,
``kvstore.eviction.leaf_first``), each chunk that needs room first admitted by the filter, if
any, over the first victim. Hits are looked up in the policy's own sizes; the tier's contents
and the replay's copy and child counts, which only the per-chunk placement reads, are rebuilt
from the policy when that placement runs and when they are read (``sync``, called by
``PolicyReplay.tiers``). The decisions are those of
``PolicyReplay._row``, the per-chunk path (tested against it in ``tests/bench/test_policy_sim.py``);
when leaves run out, or a chunk repeats within a row, the rest of the row takes that path's
placement (``PolicyReplay._place``).
"""
from __future__ import annotations

from collections import Counter
from itertools import accumulate, takewhile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.policy_replay import PolicyReplay


class OneTierRows:
    """Replays rows of ``replay`` (a ``PolicyReplay`` with one tier), updating its tier, its
    copy and child counts and its ``refused`` count as ``PolicyReplay._row`` would.

    Raises:
        ValueError: ``replay`` has more than one tier.
    """

    def __init__(self, replay: PolicyReplay) -> None:
        if len(replay._tiers) != 1:
            raise ValueError(f"one tier expected, got {len(replay._tiers)}")
        self.replay = replay
        self.keys, self.tokens = replay.trace.keys, replay.trace.tokens
        self.tier, self.admission = replay._tiers[0], replay.admission
        self.token_bytes, self.parent = replay.token_bytes, replay.parent
        self.copies, self.kids = replay._copies, replay._kids  # (shared: never replaced)
        self.nbytes = [t * self.token_bytes for t in self.tokens]  # bytes of each access
        self.cum_tokens = [0, *accumulate(self.tokens)]  # tokens of accesses before each
        self.cum_bytes = [0, *accumulate(self.nbytes)]  # bytes of accesses before each
        self.oversize = max(self.nbytes, default=0) > self.tier.capacity  # some chunk never fits
        self.stored = self.tier.policy.sizes.__contains__  # (a live view)
        self.synced = True  # whether the tier's contents and the counts match the policy
        self.refusal = False  # whether the filter refused a chunk of the row being served

    def row(self, a: int, b: int) -> tuple[int, int]:
        """Serve row ``a..b-1`` of the trace (indexes into its chunk arrays) with one
        ``on_request`` (the filter, if any, records the row's chunks first and is asked by
        ``_admit``); returns the hit tokens, twice (all served by the one tier, the top)."""
        tier, adm = self.tier, self.admission
        seg = self.keys[a:b]
        if adm is not None:
            adm.record_many(seg)
            self.refusal = False
        hits = list(takewhile(self.stored, seg))
        nh = len(hits)
        j = a + nh
        cum = self.cum_tokens
        hit = cum[j] - cum[a]
        new = seg[nh:] if nh else seg
        sizes = self.nbytes[j:b]
        m = b - j
        cap = tier.capacity
        if self.oversize and m and max(sizes) > cap:  # the row stops at a chunk larger
            m = next(i for i, n in enumerate(sizes) if n > cap)  # than the tier
            new, sizes = new[:m], sizes[:m]
        try:
            victims, num_stored, freed = tier.policy.on_request(
                hits, new, sizes, cap - tier.used, None if adm is None else self._admit)
        except KeyError:  # a chunk repeated within the row (not a chained trace): one at
            tier.policy.on_access_many(hits)  # a time
            self._store_from(a, j, b)
            return hit, hit
        self.synced = False
        cb = self.cum_bytes
        tier.used += cb[j + num_stored] - cb[j] - freed
        if num_stored < m and not self.refusal:  # leaves ran out: the per-chunk
            self._store_from(a, j + num_stored, b)  # path (lineage fallback)
        return hit, hit

    def _admit(self, key: int, victim: int, num_keys: int) -> bool:
        """The filter's verdict on ``key`` evicting ``victim`` from the tier (``num_keys``
        stored), counted in ``refused`` when it says no."""
        adm = self.admission
        adm.fit(num_keys)
        if adm.admit(key, victim):
            return True
        self.replay.refused += 1
        self.refusal = True
        return False

    def sync(self) -> None:
        """Rebuild the tier's contents, and the replay's copy and child counts, from the
        policy's sizes (``row`` leaves them stale)."""
        if self.synced:
            return
        copies, kids, parent, stored = self.copies, self.kids, self.parent, self.tier.nbytes
        stored.clear()
        stored.update(self.tier.policy.sizes)
        copies.clear()
        copies.update(dict.fromkeys(stored, 1))
        kids.clear()
        kids.update(Counter(map(parent.get, stored)))  # (C-level counting)
        kids.pop(None, None)  # (the roots' "parent")
        self.synced = True

    def _store_from(self, a: int, j: int, b: int) -> None:
        """``PolicyReplay._place``: chunks ``j..b-1`` of row ``a..b-1``, one at a time."""
        self.sync()
        self.replay._place(a, j, b)

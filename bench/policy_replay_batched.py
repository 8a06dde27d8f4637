"""The one-tier replay's row path (``bench.policy_replay``) through the policies' batched calls.

Without an admission filter a row is one ``on_request`` call (its hit prefix read, its missing
chunks stored while leaves can make room; LRU, FIFO and LFU then pop victims from a leaf-first
index, ``kvstore.eviction.leaf_first``): hits are looked up in the policy's own sizes, and the tier's
contents and the replay's copy and child counts, which only the per-chunk placement reads, are
rebuilt from the policy when that placement runs and at the end (``sync``). With a filter, the hit prefix is read at once (``on_access_many``) and the
missing chunks that fit in the free bytes are stored as one chain, the rest one at a time, each
admitted over its first victim. The decisions are those of ``PolicyReplay._row``, the per-chunk
path (tested against it in ``tests/bench/test_policy_sim.py``); when leaves run out, or a chunk
is larger than the tier, the rest of the row takes that path's placement (``PolicyReplay._place``).
"""
from __future__ import annotations

from itertools import takewhile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.policy_replay import PolicyReplay

_NONE: frozenset = frozenset()


def _always(key: int) -> bool:
    return True


class OneTierRows:
    """Replays rows of ``replay`` (a ``PolicyReplay`` with one tier), updating its tier, its
    copy and child counts and its ``refused`` count as ``PolicyReplay._row`` would.

    Raises:
        ValueError: ``replay`` has more than one tier.
    """

    def __init__(self, replay: PolicyReplay) -> None:
        if len(replay.tiers) != 1:
            raise ValueError(f"one tier expected, got {len(replay.tiers)}")
        self.replay = replay
        self.keys, self.tokens = replay.trace.keys, replay.trace.tokens
        self.tier, self.admission = replay.tiers[0], replay.admission
        self.token_bytes, self.parent = replay.token_bytes, replay.parent
        self.copies, self.kids = replay._copies, replay._kids  # (shared: never replaced)
        self.nbytes = [t * self.token_bytes for t in self.tokens]  # bytes of each access
        self.oversize = max(self.nbytes, default=0) > self.tier.capacity  # some chunk never fits
        self.stored = self.tier.policy.sizes.__contains__  # (a live view)
        self.synced = True  # whether the tier's contents and the counts match the policy
        #: ``row(a, b)``: serve row ``a..b-1`` of the trace (indexes into its chunk arrays);
        #: returns the hit tokens, twice (all served by the one tier, the top)
        self.row = self._request if self.admission is None else self._admitted

    def _admitted(self, a: int, b: int) -> tuple[int, int]:
        """``row`` with an admission filter."""
        keys, tokens, tier = self.keys, self.tokens, self.tier
        self.admission.record_many(keys[a:b])
        stored, policy = tier.nbytes, tier.policy
        j = a
        while j < b and keys[j] in stored:
            j += 1
        hit = sum(tokens[a:j])
        if j > a:
            policy.on_access_many(keys[a:j])
        if j < b:
            seg = keys[j:b]
            if len(set(seg)) == len(seg):
                self._store_each(a, self._store_fitting(a, j, b), b)
            else:  # a chunk repeated within the row (not a chained trace): one at a time
                self._store_from(a, j, b)
        return hit, hit

    def _request(self, a: int, b: int) -> tuple[int, int]:
        """``row`` without an admission filter: one ``on_request`` for the row."""
        tier = self.tier
        policy, cap = tier.policy, tier.capacity
        seg = self.keys[a:b]
        hits = list(takewhile(self.stored, seg))
        j = a + len(hits)
        hit = sum(self.tokens[a:j]) if hits else 0
        new = seg[len(hits):]
        sizes = self.nbytes[j:b]
        m = len(new)
        if self.oversize and m and max(sizes) > cap:  # the row stops at a chunk larger
            m = next(i for i, n in enumerate(sizes) if n > cap)  # than the tier
            new, sizes = new[:m], sizes[:m]
        try:
            done = policy.on_request(hits, new, sizes, cap - tier.used)
        except KeyError:  # a chunk repeated within the row (not a chained trace): one at
            policy.on_access_many(hits)  # a time
            self._store_from(a, j, b)
            return hit, hit
        self.synced = False
        tier.used += sum(sizes[:done.num_stored]) - done.freed_bytes
        if done.num_stored < m:  # leaves ran out: the per-chunk path (lineage fallback)
            self._store_from(a, j + done.num_stored, b)
        return hit, hit

    def sync(self) -> None:
        """Rebuild the tier's contents, and the replay's copy and child counts, from the
        policy's sizes (``_request`` leaves them stale)."""
        if self.synced:
            return
        copies, kids, parent, stored = self.copies, self.kids, self.parent, self.tier.nbytes
        stored.clear()
        stored.update(self.tier.policy.sizes)
        copies.clear()
        copies.update(dict.fromkeys(stored, 1))
        kids.clear()
        for k in stored:
            p = parent.get(k)
            if p is not None:
                kids[p] = kids.get(p, 0) + 1
        self.synced = True

    def _store_fitting(self, a: int, j: int, b: int) -> int:
        """Store the leading missing chunks from ``j`` that fit in the tier's free bytes as
        one chain (nothing is evicted between them, so this is exact for every policy);
        returns the first chunk not stored."""
        tier, tokens, tb = self.tier, self.tokens, self.token_bytes
        room, m = tier.capacity - tier.used, j
        while m < b and tokens[m] * tb <= room:
            room -= tokens[m] * tb
            m += 1
        if m > j:
            self._add_chain(self.keys[j:m], [t * tb for t in tokens[j:m]],
                            self.keys[j - 1] if j > a else None)
        return m

    def _store_each(self, a: int, j: int, b: int) -> None:
        """Store the missing chunks ``j..b-1`` of row ``a..b-1`` one at a time (exact for
        every policy): the eviction and the insert bookkeeping inlined."""
        keys, tokens, tier, tb = self.keys, self.tokens, self.tier, self.token_bytes
        adm, policy, cap, stored = self.admission, tier.policy, tier.capacity, tier.nbytes
        copies, kids, parent = self.copies, self.kids, self.parent
        evict_until, insert = policy.evict_until, policy.on_insert
        for p in range(j, b):
            k, nbytes = keys[p], tokens[p] * tb
            par = keys[p - 1] if p > a else None
            if nbytes > cap:
                return
            need = tier.used + nbytes - cap
            if need > 0:
                can = _always if par is None else par.__ne__
                if adm is not None:
                    victim = policy.next_victim(can, True)
                    if victim is None:
                        return self._store_from(a, p, b)
                    adm.fit(len(stored))
                    if not adm.admit(k, victim):
                        self.replay.refused += 1
                        return
                freed = 0
                for v in evict_until(need, can, True):
                    freed += stored.pop(v)
                    del copies[v]
                    vp = parent.get(v)
                    if vp is not None:
                        left = kids[vp] - 1
                        if left:
                            kids[vp] = left
                        else:
                            del kids[vp]
                tier.used -= freed
                if freed < need:
                    # the filter (if any) has admitted k over this placement's first victim
                    if not self.replay._make_room(0, nbytes, frozenset((k, par)), k,
                                                  admitted=adm is not None):
                        return
            stored[k] = nbytes
            tier.used += nbytes
            insert(k, nbytes, par)
            copies[k] = 1
            if par is not None:
                kids[par] = kids.get(par, 0) + 1

    def _store_from(self, a: int, j: int, b: int) -> None:
        """``PolicyReplay._place``: chunks ``j..b-1`` of row ``a..b-1``, one at a time."""
        self.sync()
        self.replay._place(a, j, b)

    def _add_chain(self, chain: list[int], sizes: list[int], par: int | None) -> None:
        """Store each chunk of ``chain`` (absent everywhere) in the tier, at once, each the
        parent of the next (``par``: the first one's)."""
        tier, copies, kids = self.tier, self.copies, self.kids
        stored = tier.nbytes
        for k, n in zip(chain, sizes):
            stored[k] = n
            copies[k] = 1
        for k in chain[:-1]:
            kids[k] = 1
        if par is not None:
            kids[par] = kids.get(par, 0) + 1
        tier.used += sum(sizes)
        tier.policy.on_insert_chain(chain, sizes, par)

"""The one-tier replay's row path (``bench.policy_replay``) through the policies' batched calls.

A row's hit prefix is read at once (``on_access_many``); its missing chunks are stored with
``evict_until`` and ``on_insert_chain`` (``kvstore.eviction.batched``): one room-making call
for the whole missing chain when the policy's victims ignore inserts and there is no admission
filter, else the chunks that fit in the free bytes as one chain and the rest one at a time.
The decisions are those of ``PolicyReplay._row``, the per-chunk path (tested against it in
``tests/bench/test_policy_sim.py``); when leaves run out, or a chunk is larger than the tier,
the rest of the row takes that path's placement (``PolicyReplay._insert``).
"""
from __future__ import annotations

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

    def row(self, a: int, b: int) -> tuple[int, int]:
        """Serve row ``a..b-1`` of the trace (indexes into its chunk arrays); returns the hit
        tokens, twice (all served by the one tier, the top)."""
        keys, tokens, tier, adm = self.keys, self.tokens, self.tier, self.admission
        if adm is not None:
            adm.record_many(keys[a:b])
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
                if adm is None and policy.victims_ignore_inserts:
                    self._store_chain(a, j, b)
                else:
                    self._store_each(a, self._store_fitting(a, j, b), b)
            else:  # a chunk repeated within the row (not a chained trace): one at a time
                self._store_from(a, j, b)
        return hit, hit

    def _evict_leaves(self, nbytes: int, par: int | None) -> int:
        """Evict leaves of the tier (sparing ``par``) until ``nbytes`` are freed; returns the
        bytes freed."""
        tier, copies, kids, parent = self.tier, self.copies, self.kids, self.parent
        stored = tier.nbytes
        can = _always if par is None else par.__ne__
        freed = 0
        for v in tier.policy.evict_until(nbytes, can, True):
            n = stored.pop(v)
            freed += n
            del copies[v]
            p = parent.get(v)
            if p is not None:
                left = kids[p] - 1
                if left:
                    kids[p] = left
                else:
                    del kids[p]
        tier.used -= freed
        return freed

    def _store_chain(self, a: int, j: int, b: int) -> None:
        """Store the missing chunks ``j..b-1`` (all absent) of row ``a..b-1`` as one chain."""
        keys, tier, tb = self.keys, self.tier, self.token_bytes
        sizes = [t * tb for t in self.tokens[j:b]]
        cap = tier.capacity
        m = next((i for i, n in enumerate(sizes) if n > cap), len(sizes))
        par = keys[j - 1] if j > a else None
        need = tier.used + sum(sizes[:m]) - cap
        if need > 0:
            self._evict_leaves(need, par)
        room = cap - tier.used
        fit = 0
        while fit < m and sizes[fit] <= room:
            room -= sizes[fit]
            fit += 1
        if fit:
            self._add_chain(keys[j:j + fit], sizes[:fit], par)
        if fit < m:  # leaves ran out: the per-chunk path (lineage fallback) from here
            self._store_from(a, j + fit, b)

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
        every policy): ``_evict_leaves`` and the insert bookkeeping inlined."""
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

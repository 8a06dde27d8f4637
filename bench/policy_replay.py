"""Replay a ``ChunkTrace`` through the store's real eviction policy objects, with no payloads.

Tiers are byte budgets, fastest first (one tier, or CPU over disk); each owns a
``create_policy(name)`` instance and tells it every insert, read and removal, as
``kvstore.tiers`` do. Placement follows ``kvstore.movement.TierMover`` (no pins, no
reservations, one request at a time):

* a row's lookup walks its chunks head first and stops at the first one stored in no tier;
  the hit chunks are read (``on_access`` in the tier that serves each), those served by a
  lower tier are then promoted (copied) into the top tier;
* the row's missing chunks are then stored, in order, each only if its parent is still
  stored, in the top tier or, when that refuses it, the first tier below that takes it (as
  ``ChunkStore.put_chunks``); a chunk stored nowhere stops the row;
* room is made by evicting the policy's victims: a victim of a tier with one below spills
  (is copied) there unless already there (``spilled_bytes`` counts these writes); a victim of
  the last tier must have no stored child and not be the placed chunk's first stored
  ancestor, else (rarely) it leaves with its stored descendants; when nothing may go the
  chunk is not stored;
* with an admission filter (``kvstore.eviction.admission``, ``admission="tinylfu"``), every
  chunk of a row is recorded as one request before the row is served, and an insert into a
  full tier (a put, a promotion or a spill) goes ahead only if the filter admits the chunk
  over the first victim the tier's policy names (else nothing is evicted and that tier does
  not take it; a refused spill leaves the store).

Speed: with one tier, a row is replayed through the policy's batched calls
(``on_access_many`` for the hit prefix, ``evict_until`` and ``on_insert_chain`` for the missing
chunks: one room-making call for the whole chain when the policy's victims ignore inserts,
else one per chunk; ``bench.policy_replay_batched``), with the decisions of the per-chunk path
(``_row``, used with two tiers and tested against the batched one). Which tiers hold a key
(a count of copies) and how many stored keys name it as parent are kept in two dicts as chunks
come and go, so presence and "has a stored child" are one dict lookup each, whatever the number
of tiers; the policies choose victims from heaps of keys with no stored child
(``kvstore.eviction.base``).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from bench.policy_oracle import ORACLE, ReuseOracle
from bench.policy_replay_batched import OneTierRows
from bench.policy_trace import ChunkTrace
from kvstore.eviction import EvictionPolicy, create_policy
from kvstore.eviction.admission import create_admission
from kvstore.movement import descendants_of


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of one replay.

    Attributes:
        hit_tokens: prompt tokens served from any tier.
        top_hit_tokens: prompt tokens served by the top tier.
        total_tokens: prompt tokens of every row.
        spilled_bytes: bytes written into tiers below the top (the disk's writes): spills,
            and chunks the top tier refused that a lower tier took.
        num_accesses: chunk accesses replayed (one per chunk of every row).
        elapsed_s: wall time of the replay, seconds.
        cpu_s: CPU time of the replaying process over the replay, seconds (the replay's cost
            on a machine shared with other work, where wall time also counts waiting).
        row_hit_tokens: prompt tokens served, per row.
        refused: inserts the admission filter refused (0 without one).
    """

    hit_tokens: int
    top_hit_tokens: int
    total_tokens: int
    spilled_bytes: int
    num_accesses: int
    elapsed_s: float
    row_hit_tokens: tuple[int, ...] = ()
    refused: int = 0
    cpu_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def accesses_per_s(self) -> float:
        """Chunk accesses per CPU second (per wall second when no CPU time was measured)."""
        s = self.cpu_s or self.elapsed_s
        return self.num_accesses / s if s > 0 else float("inf")

    @property
    def accesses_per_wall_s(self) -> float:
        return self.num_accesses / self.elapsed_s if self.elapsed_s > 0 else float("inf")


_NONE: frozenset = frozenset()


def _always(key: int) -> bool:
    return True


class _Tier:
    """A byte budget holding chunk sizes (the data a real tier would hold) and its policy."""

    __slots__ = ("policy", "capacity", "used", "nbytes")

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy, self.capacity, self.used = policy, capacity, 0
        self.nbytes: dict[int, int] = {}


class PolicyReplay:
    """One replay of ``trace`` with ``policy`` in every tier of ``capacities`` (bytes, fastest
    first) and chunk bytes = tokens times ``token_bytes``; ``admission``: an admission filter
    name (``kvstore.eviction.admission.ADMISSIONS``; ``"none"``: every insert that fits goes
    ahead; ``"oracle"``: ``bench.policy_oracle.ReuseOracle``, a bound), one filter for the
    whole store.

    Raises:
        ValueError: no tier, a negative capacity, a non-positive ``token_bytes``, an unknown
            policy or admission filter name.
    """

    def __init__(self, trace: ChunkTrace, policy: str, capacities: list[int],
                 token_bytes: int, admission: str = "none") -> None:
        if not capacities or min(capacities) < 0 or token_bytes <= 0:
            raise ValueError(f"capacities {capacities} must be >= 0 (at least one tier) and "
                             f"token_bytes {token_bytes} > 0")
        self.trace, self.token_bytes = trace, token_bytes
        self._tiers = [_Tier(create_policy(policy), c) for c in capacities]
        self.admission = (ReuseOracle(trace) if admission == ORACLE
                          else create_admission(admission))
        self.parent = trace.parent
        self.spilled_bytes = 0
        self.refused = 0
        self._copies: dict[int, int] = {}  # stored key -> tiers holding it
        self._kids: dict[int, int] = {}  # key -> stored keys whose parent it is
        self._one_tier = OneTierRows(self) if len(self._tiers) == 1 else None
        if self._one_tier is not None:  # ``_row`` for one tier, through the policy's batched
            self._row_one_tier = self._one_tier.row  # calls (``bench.policy_replay_batched``)

    @property
    def tiers(self) -> list[_Tier]:
        """The tiers, fastest first. With one tier, its contents (``nbytes``) and the copy and
        child counts are rebuilt from the policy first: the one-tier rows leave them stale
        (``bench.policy_replay_batched``), as the replay itself reads only the policy."""
        if self._one_tier is not None:
            self._one_tier.sync()
        return self._tiers

    def run(self) -> ReplayResult:
        """Replay every row once; returns the totals.

        The objects that exist before the replay (the trace, the modules loaded) are frozen
        out of the garbage collector's generations meanwhile (``gc.freeze``; unfrozen after
        unless the caller had frozen some): its full collections, which the policy's own
        allocations trigger, then walk the policy's objects only, not the rest of the
        process (the trace's lists and dicts, and some 170,000 objects of the imported
        modules)."""
        frozen = gc.get_freeze_count()
        gc.freeze()
        try:
            return self._run()
        finally:
            if not frozen:
                gc.unfreeze()

    def _run(self) -> ReplayResult:
        t0, c0 = time.perf_counter(), time.process_time()
        top_hit = 0
        rows: list[int] = []
        start = self.trace.start
        row = self._row_one_tier if len(self._tiers) == 1 else self._row
        for r in range(len(start) - 1):
            h, th = row(start[r], start[r + 1])
            rows.append(h)
            top_hit += th
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        return ReplayResult(sum(rows), top_hit, self.trace.total_tokens, self.spilled_bytes,
                            len(self.trace.keys), elapsed, tuple(rows), self.refused, cpu)

    # ---- one row --------------------------------------------------------------------------
    def _row(self, a: int, b: int) -> tuple[int, int]:
        keys, tokens, tiers = self.trace.keys, self.trace.tokens, self._tiers
        if self.admission is not None:
            record = self.admission.record
            for j in range(a, b):
                record(keys[j])
        top, lower = tiers[0], tiers[1:]
        top_nbytes, top_access = top.nbytes, top.policy.on_access
        copies = self._copies
        hit = top_hit = 0
        promote: list[int] = []
        j = a
        while j < b:
            k = keys[j]
            if k in top_nbytes:
                top_access(k)
                top_hit += tokens[j]
            elif k in copies:
                for t in lower:
                    if k in t.nbytes:
                        t.policy.on_access(k)
                        promote.append(j)
                        break
            else:
                break
            hit += tokens[j]
            j += 1
        tb, parent, insert = self.token_bytes, self.parent, self._insert
        for p in promote:
            k = keys[p]
            if k not in top_nbytes and k in copies:
                insert(0, k, tokens[p] * tb, parent.get(k), _NONE)
        self._place(a, j, b)
        return hit, top_hit

    def _place(self, a: int, j: int, b: int) -> None:
        """Store chunks ``j..b-1`` of row ``a..b-1`` that no tier holds, head first: each in
        the top tier, else the first lower tier with room; stop at a chunk whose parent is
        held nowhere or that no tier takes."""
        keys, tokens, tb = self.trace.keys, self.trace.tokens, self.token_bytes
        copies, insert = self._copies, self._insert
        n = len(self._tiers)
        for p in range(j, b):
            k = keys[p]
            if k in copies:
                continue
            par = keys[p - 1] if p > a else None
            if par is not None and par not in copies:
                break
            nbytes = tokens[p] * tb
            if not insert(0, k, nbytes, par, _NONE):
                for i in range(1, n):
                    if insert(i, k, nbytes, par, _NONE):
                        self.spilled_bytes += nbytes  # (written below the top: counted too)
                        break
                else:
                    break

    # ---- the prefix graph over all tiers --------------------------------------------------
    def _present(self, key: int) -> bool:
        return key in self._copies

    def _elsewhere(self, key: int, i: int) -> bool:
        """Whether a tier other than i holds ``key`` (tier i holds it)."""
        return self._copies.get(key, 0) > 1

    def _live_children(self, key: int) -> set[int]:
        out: set[int] = set()
        for t in self._tiers:
            out |= t.policy.children(key)
        return out

    def _descendants(self, key: int) -> list[int]:
        return descendants_of(key, self._live_children)

    def _add(self, tier: _Tier, key: int, nbytes: int, parent: int | None) -> None:
        tier.nbytes[key] = nbytes
        tier.used += nbytes
        tier.policy.on_insert(key, nbytes, parent)
        c = self._copies.get(key)
        if c is None:
            self._copies[key] = 1
            if parent is not None:
                self._kids[parent] = self._kids.get(parent, 0) + 1
        else:
            self._copies[key] = c + 1

    def _drop(self, tier: _Tier, key: int) -> None:
        n = tier.nbytes.pop(key, None)
        if n is None:
            return
        tier.used -= n
        tier.policy.on_remove(key)
        c = self._copies[key]
        if c > 1:
            self._copies[key] = c - 1
            return
        del self._copies[key]
        p = self.parent.get(key)
        if p is not None:
            left = self._kids[p] - 1
            if left:
                self._kids[p] = left
            else:
                del self._kids[p]

    # ---- placement (kvstore.movement.TierMover without pins) ------------------------------
    def _insert(self, i: int, key: int, nbytes: int, parent: int | None,
                outer: frozenset) -> bool:
        tier = self._tiers[i]
        if nbytes > tier.capacity:
            return False
        if tier.used + nbytes > tier.capacity:
            near = {key}
            if parent is not None and parent in self._copies:
                near.add(parent)
            if not self._make_room(i, nbytes, outer | near, key):
                return False
        self._add(tier, key, nbytes, parent)
        return True

    def _make_room(self, i: int, nbytes: int, near: frozenset, candidate: int,
                   admitted: bool = False) -> bool:
        tier = self._tiers[i]
        skip: set[int] = set()
        adm = None if admitted else self.admission
        if i + 1 == len(self._tiers):  # the last tier: a victim must strand nothing by itself
            copies, kids = self._copies, self._kids

            def simple(k: int) -> bool:
                if k in skip:
                    return False
                if copies[k] > 1:
                    return True
                return k not in near and k not in kids
        else:
            simple = None
        while tier.used + nbytes > tier.capacity:
            victim = self._pick(i, near, skip, simple)
            if victim is None:
                return False
            if adm is not None:
                adm.fit(len(tier.nbytes))
                if not adm.admit(candidate, victim):
                    self.refused += 1
                    return False
                adm = None  # one comparison per placement: with the first victim
            if not self._evict(i, victim, near):
                skip.add(victim)
        return True

    def _pick(self, i: int, near: frozenset, skip: set[int], simple) -> int | None:
        policy = self._tiers[i].policy
        if simple is None:  # a victim spills below: any key may go
            return policy.next_victim(lambda k: k not in skip) if skip else policy.next_victim()
        victim = policy.next_victim(simple, True)
        if victim is not None:
            return victim
        full = self._lineage(near)
        return policy.next_victim(lambda k: k not in skip and k not in full
                                  and self._may_leave(k, near))

    def _lineage(self, near: frozenset) -> set[int]:
        out = set(near)
        for k in near:
            p = self.parent.get(k)
            while p is not None and p not in out and p in self._copies:
                out.add(p)
                p = self.parent.get(p)
        return out

    def _may_leave(self, key: int, near: frozenset) -> bool:
        return key not in near and all(d not in near for d in self._descendants(key))

    def _evict(self, i: int, key: int, near: frozenset) -> bool:
        tier = self._tiers[i]
        stays = self._copies[key] > 1
        if not stays and i + 1 < len(self._tiers):
            nbytes = tier.nbytes[key]
            if self._insert(i + 1, key, nbytes, self.parent.get(key), near):
                self.spilled_bytes += nbytes
                stays = True
        if not stays:
            if key in near:
                return False
            desc = self._descendants(key) if key in self._kids else []
            if any(d in near for d in desc):
                return False
            for d in reversed(desc):
                for t in self._tiers:
                    self._drop(t, d)
        self._drop(tier, key)
        return True

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if a tier's bytes or its policy's keys disagree with what it
        holds, the copy and child counts drifted, or a stored chunk's parent is stored nowhere
        (unreachable)."""
        copies: dict[int, int] = {}
        for t in self.tiers:
            assert t.used == sum(t.nbytes.values()) <= t.capacity, "tier bytes drifted"
            assert t.policy.keys() == set(t.nbytes), "policy and tier disagree"
            t.policy.check_integrity()
            for k in t.nbytes:
                copies[k] = copies.get(k, 0) + 1
        assert copies == self._copies, "copy counts drifted"
        kids: dict[int, int] = {}
        for k in copies:
            p = self.parent.get(k)
            assert p is None or p in copies, f"chunk {k} stored without parent {p}"
            if p is not None:
                kids[p] = kids.get(p, 0) + 1
        assert kids == self._kids, "child counts drifted"

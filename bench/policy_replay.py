"""Replay a ``ChunkTrace`` through the store's real eviction policy objects, with no payloads.

Tiers are byte budgets, fastest first (one tier, or CPU over disk); each owns a
``create_policy(name)`` instance and tells it every insert, read and removal, as
``kvstore.tiers`` do. Placement follows ``kvstore.movement.TierMover`` (no pins, no
reservations, one request at a time):

* a row's lookup walks its chunks head first and stops at the first one stored in no tier;
  the hit chunks are read (``on_access`` in the tier that serves each), those served by a
  lower tier are then promoted (copied) into the top tier;
* the row's missing chunks are then stored in the top tier, in order, each only if its
  parent is still stored (a chunk stored nowhere stops the row);
* room is made by evicting the policy's victims: a victim of a tier with one below spills
  (is copied) there unless already there (``spilled_bytes`` counts these writes); a victim of
  the last tier must have no stored child and not be the placed chunk's first stored
  ancestor, else (rarely) it leaves with its stored descendants; when nothing may go the
  chunk is not stored.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from bench.policy_trace import ChunkTrace
from kvstore.eviction import EvictionPolicy, create_policy
from kvstore.movement import descendants_of


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of one replay.

    Attributes:
        hit_tokens: prompt tokens served from any tier.
        top_hit_tokens: prompt tokens served by the top tier.
        total_tokens: prompt tokens of every row.
        spilled_bytes: bytes written into tiers below the top (spills; the disk's writes).
        num_accesses: chunk accesses replayed (one per chunk of every row).
        elapsed_s: wall time of the replay, seconds.
        row_hit_tokens: prompt tokens served, per row.
    """

    hit_tokens: int
    top_hit_tokens: int
    total_tokens: int
    spilled_bytes: int
    num_accesses: int
    elapsed_s: float
    row_hit_tokens: tuple[int, ...] = ()

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def accesses_per_s(self) -> float:
        return self.num_accesses / self.elapsed_s if self.elapsed_s > 0 else float("inf")


class _Tier:
    """A byte budget holding chunk sizes (the data a real tier would hold) and its policy."""

    __slots__ = ("policy", "capacity", "used", "nbytes")

    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.policy, self.capacity, self.used = policy, capacity, 0
        self.nbytes: dict[int, int] = {}

    def drop(self, key: int) -> None:
        n = self.nbytes.pop(key, None)
        if n is not None:
            self.used -= n
            self.policy.on_remove(key)


class PolicyReplay:
    """One replay of ``trace`` with ``policy`` in every tier of ``capacities`` (bytes, fastest
    first) and chunk bytes = tokens times ``token_bytes``.

    Raises:
        ValueError: no tier, a negative capacity, a non-positive ``token_bytes`` or an unknown
            policy name.
    """

    def __init__(self, trace: ChunkTrace, policy: str, capacities: list[int],
                 token_bytes: int) -> None:
        if not capacities or min(capacities) < 0 or token_bytes <= 0:
            raise ValueError(f"capacities {capacities} must be >= 0 (at least one tier) and "
                             f"token_bytes {token_bytes} > 0")
        self.trace, self.token_bytes = trace, token_bytes
        self.tiers = [_Tier(create_policy(policy), c) for c in capacities]
        self.parent = trace.parent
        self.spilled_bytes = 0

    def run(self) -> ReplayResult:
        """Replay every row once; returns the totals."""
        t0 = time.perf_counter()
        top_hit = 0
        rows: list[int] = []
        start = self.trace.start
        for r in range(len(start) - 1):
            h, th = self._row(start[r], start[r + 1])
            rows.append(h)
            top_hit += th
        elapsed = time.perf_counter() - t0
        return ReplayResult(sum(rows), top_hit, self.trace.total_tokens, self.spilled_bytes,
                            len(self.trace.keys), elapsed, tuple(rows))

    # ---- one row --------------------------------------------------------------------------
    def _row(self, a: int, b: int) -> tuple[int, int]:
        keys, tokens, tiers = self.trace.keys, self.trace.tokens, self.tiers
        top, lower = tiers[0], tiers[1:]
        top_nbytes, top_access = top.nbytes, top.policy.on_access
        hit = top_hit = 0
        promote: list[int] = []
        j = a
        while j < b:
            k = keys[j]
            if k in top_nbytes:
                top_access(k)
                top_hit += tokens[j]
            else:
                for t in lower:
                    if k in t.nbytes:
                        t.policy.on_access(k)
                        promote.append(j)
                        break
                else:
                    break
            hit += tokens[j]
            j += 1
        for p in promote:
            k = keys[p]
            if k not in top_nbytes and self._present(k):
                self._insert(0, k, tokens[p] * self.token_bytes, self.parent.get(k), frozenset())
        for p in range(j, b):
            k = keys[p]
            if self._present(k):
                continue
            par = keys[p - 1] if p > a else None
            if par is not None and not self._present(par):
                break
            if not self._insert(0, k, tokens[p] * self.token_bytes, par, frozenset()):
                break
        return hit, top_hit

    # ---- placement (kvstore.movement.TierMover without pins) ------------------------------
    def _present(self, key: int) -> bool:
        for t in self.tiers:
            if key in t.nbytes:
                return True
        return False

    def _elsewhere(self, key: int, i: int) -> bool:
        return any(key in t.nbytes for j, t in enumerate(self.tiers) if j != i)

    def _live_children(self, key: int) -> set[int]:
        out: set[int] = set()
        for t in self.tiers:
            out |= t.policy.children(key)
        return out

    def _has_live_child(self, key: int) -> bool:
        for t in self.tiers:
            if t.policy.children(key):
                return True
        return False

    def _descendants(self, key: int) -> list[int]:
        return descendants_of(key, self._live_children)

    def _insert(self, i: int, key: int, nbytes: int, parent: int | None,
                outer: frozenset) -> bool:
        tier = self.tiers[i]
        if nbytes > tier.capacity:
            return False
        if tier.used + nbytes > tier.capacity:
            near = {key}
            if parent is not None and self._present(parent):
                near.add(parent)
            if not self._make_room(i, nbytes, outer | near):
                return False
        tier.nbytes[key] = nbytes
        tier.used += nbytes
        tier.policy.on_insert(key, nbytes, parent)
        return True

    def _make_room(self, i: int, nbytes: int, near: frozenset) -> bool:
        tier = self.tiers[i]
        skip: set[int] = set()
        while tier.used + nbytes > tier.capacity:
            victim = self._pick(i, near, skip)
            if victim is None:
                return False
            if not self._evict(i, victim, near):
                skip.add(victim)
        return True

    def _pick(self, i: int, near: frozenset, skip: set[int]) -> int | None:
        policy = self.tiers[i].policy
        if i + 1 < len(self.tiers):  # a victim spills below: any key may go
            return policy.next_victim(lambda k: k not in skip) if skip else policy.next_victim()

        def simple(k: int) -> bool:
            if k in skip:
                return False
            if self._elsewhere(k, i):
                return True
            return k not in near and not self._has_live_child(k)

        victim = policy.next_victim(simple, leaves_only=True)
        if victim is not None:
            return victim
        full = self._lineage(near)
        return policy.next_victim(lambda k: k not in skip and k not in full
                                  and self._may_leave(k, near))

    def _lineage(self, near: frozenset) -> set[int]:
        out = set(near)
        for k in near:
            p = self.parent.get(k)
            while p is not None and p not in out and self._present(p):
                out.add(p)
                p = self.parent.get(p)
        return out

    def _may_leave(self, key: int, near: frozenset) -> bool:
        return key not in near and all(d not in near for d in self._descendants(key))

    def _evict(self, i: int, key: int, near: frozenset) -> bool:
        tier = self.tiers[i]
        stays = self._elsewhere(key, i)
        if not stays and i + 1 < len(self.tiers):
            nbytes = tier.nbytes[key]
            if self._insert(i + 1, key, nbytes, self.parent.get(key), near):
                self.spilled_bytes += nbytes
                stays = True
        if not stays:
            if key in near:
                return False
            desc = self._descendants(key) if self._has_live_child(key) else []
            if any(d in near for d in desc):
                return False
            for d in reversed(desc):
                for t in self.tiers:
                    t.drop(d)
        tier.drop(key)
        return True

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if a tier's bytes or its policy's keys disagree with what it
        holds, or a stored chunk's parent is stored nowhere (unreachable)."""
        for t in self.tiers:
            assert t.used == sum(t.nbytes.values()) <= t.capacity, "tier bytes drifted"
            assert t.policy.keys() == set(t.nbytes), "policy and tier disagree"
            t.policy.check_integrity()
        for t in self.tiers:
            for k in t.nbytes:
                p = self.parent.get(k)
                assert p is None or self._present(p), f"chunk {k} stored without parent {p}"

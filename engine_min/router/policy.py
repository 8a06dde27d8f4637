"""Which engine serves a request: round-robin, or cache-aware (prefix hits within a load gap).

Each healthy engine is a ``Candidate``: the prompt tokens its prefix cache holds
(``hit_tokens`` = the longest cached prefix of the prompt's blocks x ``block_size``, from its
``EngineIndex``) and its ``load`` (requests in flight: the router's own count, or the engine's
reported running + waiting when larger, see ``engine_min.router.subscriber``).

Cache-aware, for candidates ``c`` with ``min_load = min(c.load)`` and a prompt of
``num_prompt_tokens`` tokens::

    eligible = {c : c.load <= min_load + max_load_gap}
    best     = max(c.hit_tokens for c in eligible)
    if best > min(c.hit_tokens for c in all candidates)        # someone holds more than all do
            and best >= min_hit_fraction * num_prompt_tokens:  # and enough of this prompt
        pick among eligible with hit_tokens == best the least loaded    reason "hit"
    else:                                                       # nothing to gain from a cache
        pick the least loaded of all                             reason "load"

``min_hit_fraction`` (SGLang's router calls it ``cache_threshold``) keeps a prefix shared by
every conversation (a chat template's system prompt, one block of a short first message) from
drawing all new conversations to the engine that happened to serve the first: a chat's later
rounds, whose history is most of the prompt, pass it; a new user's first message does not.

Ties left after that go round-robin (the candidate after the last one picked, in the router's
engine order), so equal engines share the work and no session is sticky by fiat: a chat's next
round goes back to the engine holding its history only while that engine scores best.
Round-robin ignores hits and load (reason ``round_robin``).
"""
from __future__ import annotations

from dataclasses import dataclass

HIT, LOAD, ROUND_ROBIN, RETRY = "hit", "load", "round_robin", "retry"


@dataclass(frozen=True)
class Candidate:
    """One healthy engine as the policy sees it.

    Attributes:
        position: the engine's place in the router's engine list (round-robin order).
        hit_tokens: prompt tokens held by its prefix cache (0 when unknown).
        load: requests in flight on it (>= 0).
    """

    position: int
    hit_tokens: int
    load: int


@dataclass(frozen=True)
class Decision:
    """The engine picked (its ``position``), why (``hit`` | ``load`` | ``round_robin``) and
    the prompt tokens its cache is predicted to hold."""

    position: int
    reason: str
    hit_tokens: int


class _Rotation:
    """Round-robin among tied candidates: the first at or after the position following the
    last pick, cyclically in engine order."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, tied: list[Candidate]) -> Candidate:
        after = [c for c in tied if c.position >= self._next]
        chosen = min(after or tied, key=lambda c: c.position)
        self._next = chosen.position + 1
        return chosen


class RoundRobinPolicy:
    """Engines in turn, whatever they hold."""

    name = "round-robin"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, candidates: list[Candidate], num_prompt_tokens: int = 0) -> Decision:
        """Raises ValueError on an empty list."""
        if not candidates:
            raise ValueError("no candidate engine")
        c = self._rotation.pick(candidates)
        return Decision(c.position, ROUND_ROBIN, c.hit_tokens)

    def least_loaded(self, candidates: list[Candidate]) -> Decision:
        """For requests the router cannot score (a body it cannot parse)."""
        return self.choose(candidates)

    def hit_winners(self, candidates: list[Candidate], num_prompt_tokens: int
                    ) -> list[Candidate]:
        """None: this policy never picks by hits."""
        return []


class CacheAwarePolicy:
    """Most prompt tokens cached among engines within ``max_load_gap`` requests of the least
    loaded (the module's formula).

    Args:
        max_load_gap: in-flight requests an engine may have beyond the least loaded one and
            still win on hits (>= 0).
        min_hit_fraction: least fraction of the prompt the best engine must hold to win on
            hits, in [0, 1].

    Raises:
        ValueError: max_load_gap < 0, or min_hit_fraction outside [0, 1].
    """

    name = "cache-aware"

    def __init__(self, max_load_gap: int = 8, min_hit_fraction: float = 0.5) -> None:
        if max_load_gap < 0:
            raise ValueError(f"max_load_gap must be >= 0, got {max_load_gap}")
        if not 0.0 <= min_hit_fraction <= 1.0:
            raise ValueError(f"min_hit_fraction must be in [0, 1], got {min_hit_fraction}")
        self.max_load_gap, self.min_hit_fraction = max_load_gap, min_hit_fraction
        self._rotation = _Rotation()

    def _eligible_best(self, candidates: list[Candidate], num_prompt_tokens: int
                       ) -> tuple[list[Candidate], int] | None:
        """``(eligible, best)`` when an engine wins on its hits, else None."""
        min_load = min(c.load for c in candidates)
        eligible = [c for c in candidates if c.load <= min_load + self.max_load_gap]
        best = max(c.hit_tokens for c in eligible)
        if (best > min(c.hit_tokens for c in candidates)
                and best >= self.min_hit_fraction * num_prompt_tokens):
            return eligible, best
        return None

    def hit_winners(self, candidates: list[Candidate], num_prompt_tokens: int
                    ) -> list[Candidate]:
        """The candidates ``choose`` would pick among by hits (reason ``hit``: the most hit
        tokens among the eligible), or ``[]`` when it would pick by load; changes nothing."""
        found = self._eligible_best(candidates, num_prompt_tokens) if candidates else None
        if found is None:
            return []
        eligible, best = found
        return [c for c in eligible if c.hit_tokens == best]

    def choose(self, candidates: list[Candidate], num_prompt_tokens: int = 0) -> Decision:
        """The engine for a prompt of ``num_prompt_tokens`` tokens. Raises ValueError on an
        empty list."""
        if not candidates:
            raise ValueError("no candidate engine")
        found = self._eligible_best(candidates, num_prompt_tokens)
        if found is not None:
            eligible, best = found
            top = [c for c in eligible if c.hit_tokens == best]
            low = min(c.load for c in top)
            c = self._rotation.pick([c for c in top if c.load == low])
            return Decision(c.position, HIT, c.hit_tokens)
        return self.least_loaded(candidates)

    def least_loaded(self, candidates: list[Candidate]) -> Decision:
        """The least loaded candidate (round-robin among equals), reason ``load``."""
        if not candidates:
            raise ValueError("no candidate engine")
        low = min(c.load for c in candidates)
        c = self._rotation.pick([c for c in candidates if c.load == low])
        return Decision(c.position, LOAD, c.hit_tokens)


def make_policy(name: str, max_load_gap: int = 8, min_hit_fraction: float = 0.5
                ) -> RoundRobinPolicy | CacheAwarePolicy:
    """The policy called ``name`` (``cache-aware`` | ``round-robin``).

    Raises:
        ValueError: another name, max_load_gap < 0 or min_hit_fraction outside [0, 1].
    """
    if name == "cache-aware":
        return CacheAwarePolicy(max_load_gap, min_hit_fraction)
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r} (cache-aware | round-robin)")

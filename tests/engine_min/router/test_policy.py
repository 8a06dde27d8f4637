"""Routing policies on hand-made candidates: cache-aware picks the most cached prefix among
engines within the load gap, falls back to the least loaded (round-robin among equals) when
nobody holds more than everyone; round-robin takes engines in turn."""
from __future__ import annotations

import pytest

from engine_min.router.policy import (CacheAwarePolicy, Candidate, RoundRobinPolicy,
                                      make_policy)


def _c(*rows):
    return [Candidate(i, hits, load) for i, (hits, load) in enumerate(rows)]


def test_cache_aware_prefers_hits_within_the_load_gap():
    p = CacheAwarePolicy(max_load_gap=2)
    d = p.choose(_c((32, 2), (0, 0), (16, 1)))
    assert (d.position, d.reason, d.hit_tokens) == (0, "hit", 32)
    # engine 0 is 3 requests above the least loaded: out of the gap; engine 2 holds more than 1
    d = p.choose(_c((32, 3), (0, 0), (16, 1)))
    assert (d.position, d.reason, d.hit_tokens) == (2, "hit", 16)
    # only the overloaded engine holds anything: the least loaded wins by load
    d = p.choose(_c((32, 3), (0, 0), (0, 1)))
    assert (d.position, d.reason, d.hit_tokens) == (1, "load", 0)
    # equal best hits: the less loaded of them
    d = p.choose(_c((32, 2), (32, 1), (0, 0)))
    assert (d.position, d.reason) == (1, "hit")


def test_cache_aware_needs_min_hit_fraction_of_the_prompt():
    p = CacheAwarePolicy(max_load_gap=8, min_hit_fraction=0.5)
    # a new conversation: engine 0 holds only the 16-token system prompt of a 48-token prompt
    d = p.choose(_c((16, 0), (0, 0)), num_prompt_tokens=48)
    assert (d.position, d.reason) == (0, "load")
    d = p.choose(_c((16, 0), (0, 0)), num_prompt_tokens=48)
    assert (d.position, d.reason) == (1, "load")
    # its second round: 32 of 60 tokens held (>= 30)
    d = p.choose(_c((32, 0), (16, 0)), num_prompt_tokens=60)
    assert (d.position, d.reason, d.hit_tokens) == (0, "hit", 32)
    d = p.choose(_c((32, 0), (16, 0)), num_prompt_tokens=65)
    assert d.reason == "load"
    assert CacheAwarePolicy(min_hit_fraction=0.0).choose(_c((0, 0), (16, 0)), 1000).reason == "hit"


def test_cache_aware_ties_go_round_robin():
    p = CacheAwarePolicy(max_load_gap=8)
    # everyone holds the same 16 tokens (a shared system prompt): by load, in turn
    picks = [p.choose(_c((16, 0), (16, 0), (16, 0))).position for _ in range(4)]
    assert picks == [0, 1, 2, 0]
    assert p.choose(_c((16, 1), (16, 0), (16, 0))).reason == "load"
    # the rotation continues among the least loaded only (after the last pick, 1)
    assert p.choose(_c((0, 0), (0, 0), (0, 3))).position == 0
    assert p.least_loaded(_c((0, 5), (64, 4))).position == 1


def test_round_robin_ignores_hits_and_load():
    p = RoundRobinPolicy()
    picks = [p.choose(_c((64, 9), (0, 0))) for _ in range(3)]
    assert [(d.position, d.reason) for d in picks] == [(0, "round_robin"), (1, "round_robin"),
                                                       (0, "round_robin")]
    # an engine out of service (absent) is skipped, the turn continues after it
    assert p.choose([Candidate(0, 0, 0), Candidate(2, 0, 0)]).position == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_load_gap"):
        CacheAwarePolicy(-1)
    with pytest.raises(ValueError, match="min_hit_fraction"):
        CacheAwarePolicy(2, 1.5)
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="no candidate"):
        make_policy("cache-aware").choose([])
    assert make_policy("round-robin", 3).name == "round-robin"

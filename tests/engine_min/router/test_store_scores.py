"""Scores with a shared store, on hand-made candidates: an engine's score is its own hit
beyond what the store holds in its namespace; the fraction test applies to the tokens the
store cannot give every engine; when no engine holds meaningfully more than the store, the
least-loaded engine is picked. ``hit_winners`` (whom ``choose`` would pick on hits) changes
nothing."""
from __future__ import annotations

import pytest

from engine_min.router.policy import CacheAwarePolicy, Candidate
from engine_min.router.store_lookup import StoreLookup, discount_store_hits


def _c(*rows):
    return [Candidate(i, hits, load) for i, (hits, load) in enumerate(rows)]


def test_scores_are_hits_beyond_the_store():
    # a 2000-token prompt; the store holds 1792 tokens (7 chunks of 256) for both engines;
    # engine 0 holds 1984 locally (a later round of its chat), engine 1 holds 1024
    scored, remainder = discount_store_hits(_c((1984, 3), (1024, 0)), {0: 1792, 1: 1792}, 2000)
    assert [(c.position, c.hit_tokens, c.load) for c in scored] == [(0, 192, 3), (1, 0, 0)]
    assert remainder == 208
    d = CacheAwarePolicy(max_load_gap=8, min_hit_fraction=0.5).choose(scored, remainder)
    assert (d.position, d.reason, d.hit_tokens) == (0, "hit", 192)   # 192 >= 0.5 * 208
    # engine 0 holds only what the store holds plus one block: nothing worth its load
    scored, remainder = discount_store_hits(_c((1808, 3), (1024, 0)), {0: 1792, 1: 1792}, 2000)
    assert [c.hit_tokens for c in scored] == [16, 0] and remainder == 208
    d = CacheAwarePolicy(max_load_gap=8, min_hit_fraction=0.5).choose(scored, remainder)
    assert (d.position, d.reason) == (1, "load")
    # the store holds the whole prompt's chunks: every advantage is 0, least loaded wins,
    # although without the store engine 0's 1984 tokens would have won
    scored, remainder = discount_store_hits(_c((1984, 3), (0, 0)), {0: 2000, 1: 2000}, 2000)
    assert [c.hit_tokens for c in scored] == [0, 0] and remainder == 0
    d = CacheAwarePolicy().choose(scored, remainder)
    assert (d.position, d.reason) == (1, "load")
    assert CacheAwarePolicy().choose(_c((1984, 3), (0, 0)), 2000).position == 0


def test_engines_without_the_store_keep_their_hits():
    # engine 1 uses no store (no entry): its local hit counts whole; the fraction test is on
    # the whole prompt (the store gives it nothing)
    scored, remainder = discount_store_hits(_c((512, 0), (768, 0)), {0: 512}, 1000)
    assert [c.hit_tokens for c in scored] == [0, 768] and remainder == 1000
    d = CacheAwarePolicy(min_hit_fraction=0.5).choose(scored, remainder)
    assert (d.position, d.reason, d.hit_tokens) == (1, "hit", 768)
    # no store hits at all: the candidates are unchanged
    cands = _c((64, 1), (0, 0))
    assert discount_store_hits(cands, {}, 100) == (cands, 100)
    assert discount_store_hits([], {}, 100) == ([], 100)


def test_bad_store_hits_and_flags_are_refused():
    with pytest.raises(ValueError, match="outside"):
        discount_store_hits(_c((0, 0)), {0: 101}, 100)
    with pytest.raises(ValueError, match="outside"):
        discount_store_hits(_c((0, 0)), {0: -1}, 100)
    with pytest.raises(ValueError, match="http://host:port"):
        StoreLookup("unix:///tmp/kv.sock")
    with pytest.raises(ValueError, match="deadline"):
        StoreLookup("http://127.0.0.1:1", timeout_s=0)
    lookup = StoreLookup("http://127.0.0.1:1/", timeout_s=0.005, auth_token="t")
    assert lookup.url == "http://127.0.0.1:1"
    assert lookup.headers["Authorization"] == "Bearer t"


def test_hit_winners_is_choose_without_its_effects():
    p = CacheAwarePolicy(max_load_gap=1, min_hit_fraction=0.5)
    assert bool(p.hit_winners(_c((64, 0), (0, 0)), 100)) is True
    assert [c.position for c in p.hit_winners(_c((64, 0), (0, 0)), 100)] == [0]
    assert bool(p.hit_winners(_c((64, 0), (0, 0)), 200)) is False       # 64 < 0.5 * 200
    assert bool(p.hit_winners(_c((64, 0), (64, 0)), 100)) is False      # nobody holds more
    assert bool(p.hit_winners(_c((64, 2), (0, 0)), 100)) is False       # beyond the load gap
    assert bool(p.hit_winners([], 100)) is False
    # the rotation among equals is untouched: the same picks as a fresh policy's
    fresh = CacheAwarePolicy(max_load_gap=1, min_hit_fraction=0.5)
    tied = _c((0, 0), (0, 0))
    assert [p.choose(tied, 10).position for _ in range(3)] == \
        [fresh.choose(tied, 10).position for _ in range(3)] == [0, 1, 0]


def test_with_the_store_a_load_tie_goes_to_the_engine_holding_the_prefix():
    from engine_min.router.store_lookup import choose_with_store
    # the store holds all 2000 tokens for both: no advantage; equal loads: engine 1 holds
    # 1984 itself (no store load), engine 0 nothing: engine 1, whatever the rotation says
    for _ in range(3):
        d = choose_with_store(CacheAwarePolicy(), _c((0, 1), (1984, 1)), {0: 2000, 1: 2000},
                              2000)
        assert (d.position, d.reason, d.hit_tokens) == (1, "load", 1984)
    # less loaded beats holding the prefix when the store gives it to every engine
    d = choose_with_store(CacheAwarePolicy(), _c((0, 0), (1984, 1)), {0: 2000, 1: 2000}, 2000)
    assert (d.position, d.reason, d.hit_tokens) == (0, "load", 0)
    # a win on hits beyond the store reports the local hit
    d = choose_with_store(CacheAwarePolicy(), _c((1984, 3), (1024, 0)), {0: 1792, 1: 1792},
                          2000)
    assert (d.position, d.reason, d.hit_tokens) == (0, "hit", 1984)


@pytest.mark.parametrize("rows, can", [
    (((0, 0), (0, 1)), False),          # nobody wins on hits (a new conversation)
    (((1984, 0), (0, 1)), False),       # the hit winner is the least loaded: same pick
    (((1984, 1), (0, 1)), False),       # ... also when tied for least loaded
    (((1984, 2), (0, 1)), True),        # the winner is busier: the store could move it
])
def test_the_store_is_asked_only_when_it_could_change_the_pick(rows, can):
    from engine_min.router.policy import RoundRobinPolicy
    from engine_min.router.store_lookup import choose_with_store, store_can_change_pick
    policy = CacheAwarePolicy(max_load_gap=8, min_hit_fraction=0.5)
    cands = _c(*rows)
    assert store_can_change_pick(policy, cands, 2000) is can
    if not can:   # the pick without the store lookup equals the pick with any store hit
        for s in (0, 1024, 1792, 2000):
            with_store = choose_with_store(CacheAwarePolicy(), cands, {0: s, 1: s}, 2000)
            without = choose_with_store(CacheAwarePolicy(), cands, {}, 2000)
            assert with_store.position == without.position, s
    assert store_can_change_pick(RoundRobinPolicy(), cands, 2000) is False

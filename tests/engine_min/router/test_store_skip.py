"""The store lookup is skipped only when its answer cannot change the pick: for random
engines (hits, loads), prompts, chunk sizes and policy settings, whenever
``store_can_change_pick`` says no, the pick without the store is the pick with every store
hit the lookup could answer (whole chunks of the prompt, 0 to all of its full chunks). And a
later round whose history fills the prompt's last partial chunk is decided without a lookup
even when the engine holding it is busier; one the store could move is still looked up."""
from __future__ import annotations

import random

from engine_min.router.policy import CacheAwarePolicy, Candidate
from engine_min.router.store_lookup import choose_with_store, store_can_change_pick


def _picks_with_every_store_hit(gap, frac, cands, n, chunk):
    out = set()
    for k in range(n // chunk + 1):
        s = k * chunk
        out.add(choose_with_store(CacheAwarePolicy(gap, frac), cands,
                                  {c.position: s for c in cands}, n).position)
    return out


def test_a_skipped_lookup_never_changes_the_pick():
    rng = random.Random(19)
    skipped_busier = skipped_by_load = 0
    for _ in range(3000):
        gap, frac = rng.choice([0, 1, 8]), rng.choice([0.0, 0.3, 0.5, 0.8, 1.0])
        chunk = rng.choice([16, 64, 256])
        n = rng.randrange(1, 2200)
        cands = [Candidate(i, min(n, 16 * rng.randrange(0, n // 16 + 2)), rng.randrange(0, 4))
                 for i in range(rng.choice([2, 3]))]
        if store_can_change_pick(CacheAwarePolicy(gap, frac), cands, n, chunk):
            continue
        # a skipped lookup scores every engine with store hit 0 (``Router._store_hits``)
        skip_pick = choose_with_store(CacheAwarePolicy(gap, frac), cands,
                                      {c.position: 0 for c in cands}, n).position
        winners = CacheAwarePolicy(gap, frac).hit_winners(cands, n)
        low = min(c.load for c in cands)
        skipped_busier += bool(winners) and all(c.load > low for c in winners)
        skipped_by_load += not winners
        assert _picks_with_every_store_hit(gap, frac, cands, n, chunk) == {skip_pick}, \
            (gap, frac, chunk, n, cands)
    assert skipped_busier > 50      # the chunk-size rule was exercised (99 of 3000)
    assert skipped_by_load > 500    # and the no-winner rule


def test_a_skipped_lookup_picks_as_any_answer_would_among_equally_loaded_engines():
    """No engine wins on its hits (1232 of 1543 < 0.8 x 1543), both equally loaded: whatever
    the store answers, the least-loaded
    fallback prefers engine 1, which holds the most itself; the skipped lookup's pick (store
    hit 0) is the same, where the policy alone would take engine 0 (round-robin)."""
    cands = [Candidate(0, 1040, 1), Candidate(1, 1232, 1)]
    policy = CacheAwarePolicy(max_load_gap=8, min_hit_fraction=0.8)
    assert store_can_change_pick(policy, cands, 1543, 256) is False
    assert _picks_with_every_store_hit(8, 0.8, cands, 1543, 256) == {1}
    assert choose_with_store(policy, cands, {0: 0, 1: 0}, 1543).position == 1
    assert CacheAwarePolicy(8, 0.8).choose(cands, 1543).position == 0


def test_a_busier_engine_holding_the_last_partial_chunk_wins_without_a_lookup():
    policy = CacheAwarePolicy(max_load_gap=8, min_hit_fraction=0.5)
    # a 1000-token later round: engine 0 holds 960 (its history), busier than engine 1;
    # the store holds at most 768 (3 chunks of 256): 960 - 768 = 192 >= 0.5 x 232
    cands = [Candidate(0, 960, 2), Candidate(1, 0, 0)]
    assert store_can_change_pick(policy, cands, 1000, 256) is False
    assert store_can_change_pick(policy, cands, 1000) is True          # without the chunk
    assert _picks_with_every_store_hit(8, 0.5, cands, 1000, 256) == {0}
    # a 1024-token round: the store may hold all 1024, and then engine 1 gets it
    cands = [Candidate(0, 992, 2), Candidate(1, 0, 0)]
    assert store_can_change_pick(policy, cands, 1024, 256) is True
    assert _picks_with_every_store_hit(8, 0.5, cands, 1024, 256) == {0, 1}
    # 800 held of 1000: 800 - 768 = 32 < 0.5 x 232: the store could move it
    cands = [Candidate(0, 800, 1), Candidate(1, 0, 0)]
    assert store_can_change_pick(policy, cands, 1000, 256) is True
    assert _picks_with_every_store_hit(8, 0.5, cands, 1000, 256) == {0, 1}

"""BlockManager: exact block ids, hashes, ref counts and LRU eviction on a 6-block pool."""
import pytest

from engine_min.block_manager import BlockManager
from engine_min.sampler import SamplingParams
from engine_min.sequence import Sequence

BS = 4


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def admit(bm, s):
    """What the scheduler does at admission: lookup, check, allocate all tokens."""
    hits = bm.lookup(s)
    assert bm.can_allocate(s, s.num_tokens, hits)
    copies = bm.allocate(s, s.num_tokens, hits)
    return hits, copies


def compute_all(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.cache_blocks(s)


def test_allocate_free_and_null_block():
    bm = BlockManager(6, BS)                      # blocks 1..5 usable, 0 is the null block
    a = seq(range(10))
    assert admit(bm, a) == ([], [])
    assert a.block_table == [1, 2, 3] and bm.num_free_blocks == 2
    bm.check_integrity()
    bm.free_seq(a)
    assert a.block_table == [] and bm.num_free_blocks == 5
    bm.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(6, BS)
    a = seq(list(range(10)), "a")
    admit(bm, a)
    compute_all(bm, a)                                 # blocks 1, 2 full and hashed; 3 partial
    assert len(bm.hash_to_block) == 2
    b = seq(list(range(8)) + [99, 98, 97], "b")        # same first two blocks
    hits, copies = admit(bm, b)
    bm.record_query(b.num_tokens, b.num_computed_tokens, preempted=False)
    assert hits == [1, 2] and copies == [] and b.block_table == [1, 2, 4]
    assert b.num_computed_tokens == 8 and bm.num_hit_tokens == 8 and bm.num_query_tokens == 11
    bm.record_query(12, 8, preempted=True)            # a re-admission counts apart
    assert (bm.num_query_tokens, bm.num_hit_tokens) == (11, 8)
    assert (bm.num_preempted_query_tokens, bm.num_preempted_hit_tokens) == (12, 8)
    assert bm.ref_count[1] == 2 and bm.ref_count[4] == 1
    bm.check_integrity()


def test_fully_cached_prompt_copies_last_block():
    bm = BlockManager(6, BS)
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    b = seq(range(8), "b")
    hits, copies = admit(bm, b)
    # block 1 is shared, block 2 is copied into fresh block 3 so only token 7 is recomputed
    assert hits == [1, 2] and copies == [(2, 3)] and b.block_table == [1, 3]
    assert b.num_computed_tokens == 7 and bm.ref_count[2] == 1
    bm.check_integrity()


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(6, BS)
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.free_seq(a)                               # blocks 1, 2 freed, still hashed
    assert list(bm.free) == [3, 4, 5, 2, 1]      # unhashed first; suffix (2) before prefix (1)
    b = seq(range(8), "b")
    assert bm.lookup(b) == [1, 2]                # revivable
    c = seq(range(100, 116), "c")                # 4 fresh blocks: 3, 4, 5 then evicts 2
    admit(bm, c)
    assert c.block_table == [3, 4, 5, 2] and list(bm.hash_to_block.values()) == [1]
    assert bm.lookup(b) == [1]
    bm.check_integrity()


def test_can_allocate_counts_revived_hits():
    bm = BlockManager(4, BS)                     # 3 usable blocks
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.free_seq(a)
    b = seq(list(range(8)) + [7, 7, 7, 7, 7], "b")   # 2 hits (both free) + 2 fresh blocks = 4 > 3
    hits = bm.lookup(b)
    assert hits == [1, 2] and not bm.can_allocate(b, b.num_tokens, hits)
    assert bm.can_allocate(b, 12, hits)              # 2 revived + 1 fresh
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.allocate(seq(range(50, 66), "x"), 16)


def test_prefix_caching_disabled():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    a = seq(range(8))
    admit(bm, a)
    compute_all(bm, a)
    assert bm.hash_to_block == {} and bm.lookup(seq(range(8))) == []


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(1, BS)

"""A disk chunk left unreachable by a restart (its head lived only in a memory tier) is the
disk tier's first victim; once its parent is stored again it is reachable, and it must then
go in its rank's turn, not first, even before anything reads it (``DiskTier.revive``, asked
by ``kvstore.movement.TierMover`` of each victim it is about to evict).

Real tiers: CPU arena, lmdb disk tier on a tmp dir, reopened."""
import pytest

from kvstore.api import PrefixStore
from tests.kvstore.test_close_persist import CHUNKS, LAY, NS, disk_of, kv, store, tokens
from tests.kvstore.test_close_persist_room import SLOT, short_kv, short_tokens, spill_a_tail

ROOTS = 4
CAP = (ROOTS + 2) * SLOT  # the roots + prompt 0's 2-chunk tail: full
HEAD = 2 * LAY.chunk_size


def _roots_ranked_before(leaf) -> list[int]:
    """Prompts (``short_tokens(i, 1)``) whose one chunk's key sorts before ``leaf``'s: the
    open ranks disk chunks in key order, so by rank these go before the tail's leaf."""
    out = [i for i in range(100, 400) if bytes(NS.chunk_keys(short_tokens(i, 1))[0]) < bytes(leaf)]
    assert len(out) >= ROOTS
    return out[:ROOTS]


def _reopen(tmp_path, policy):
    """A disk tier holding ``ROOTS`` one-chunk prompts and prompt 0's tail, whose head lived
    only in the CPU tier of a store closed without persisting it; reopened with a CPU tier."""
    tail = NS.chunk_keys(tokens(0))[2:]
    s = store(tmp_path, cpu=8, disk=CAP)
    spill_a_tail(s)
    roots = []
    for i in _roots_ranked_before(tail[1]):
        k = NS.chunk_keys(short_tokens(i, 1))
        assert s.persist(NS, k, [short_kv(i, 1)]) == 1
        roots += k
    s.close()  # no persist: the head is lost
    r = store(tmp_path, cpu=8, disk=CAP, disk_policy=policy)
    disk = disk_of(r)
    assert all(disk.is_demoted(k) for k in tail) and all(disk.contains(k) for k in tail + roots)
    return r, disk, tail, roots


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "s3fifo", "arc"])
def test_a_tail_whose_head_is_stored_again_is_no_longer_the_first_victim(tmp_path, policy):
    r, disk, tail, roots = _reopen(tmp_path, policy)
    try:
        assert PrefixStore(r, NS).put(tokens(0)[:HEAD], kv(0)[:, :, :HEAD]) == 2  # CPU tier
        # one chunk written through to the full disk tier: one disk chunk goes, by rank
        new = NS.chunk_keys(short_tokens(60, 1))
        assert r.persist(NS, new, [short_kv(60, 1)]) == 1
        assert [disk.contains(k) for k in tail] == [True, True]
        assert sum(not disk.contains(k) for k in roots) == 1
        assert not disk.is_demoted(tail[1])  # (its parent's is lifted when its turn comes)
        hit = PrefixStore(r, NS).lookup(tokens(0))
        assert hit.tiers == ("cpu", "cpu", "disk", "disk") and hit.num_hit_chunks == CHUNKS
        assert r.stats()["unreachable_bytes"] == 0
        r.check_integrity()
    finally:
        r.close()


def test_a_tail_whose_head_is_still_missing_stays_the_first_victim(tmp_path):
    r, disk, tail, roots = _reopen(tmp_path, "lru")
    try:
        new = NS.chunk_keys(short_tokens(60, 1))
        assert r.persist(NS, new, [short_kv(60, 1)]) == 1
        assert [disk.contains(k) for k in tail] == [True, False]  # the leaf went first
        assert disk.is_demoted(tail[0]) and all(disk.contains(k) for k in roots)
        r.check_integrity()
    finally:
        r.close()

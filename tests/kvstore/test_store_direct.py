"""Direct I/O of the chunk store (kvstore.direct): reserve -> fill in place -> commit, and
borrowed (pinned, zero-copy) views for gets. Exact values on a tiny layout: 2 layers, 1 KV head,
head_dim 4, fp16, chunk_size 4 -> 128-byte chunks, 128-byte pages (one page per chunk)."""
import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.direct import ALREADY_STORED, Reservation
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAY = KVLayout(2, 1, 4, "float16", 4)
CB = LAY.chunk_bytes  # 128
NS = Namespace("tiny", LAY)
KEYS = NS.chunk_keys(list(range(4 * 8)))  # 8 chained keys


def kv(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAY.shape(), generator=g).half()  # [2, 2, 4, 1, 4]


def make(tmp_path=None, cpu=4, disk=False):
    return ChunkStore(StoreConfig(cpu_bytes=cpu * CB, page_bytes=CB,
                                  disk_bytes=(64 << 20) if disk else 0,
                                  disk_path=str(tmp_path / "db") if disk else None,
                                  promote_on_hit=False), [NS])


def fill(res: Reservation, t: torch.Tensor) -> None:
    src = t.reshape(-1).view(torch.uint8)
    pos = 0
    for v in res.views:
        v.copy_(src[pos:pos + v.numel()])
        pos += v.numel()


def test_reserved_pages_are_invisible_until_commit_then_bit_exact():
    s = make()
    (r,) = s.reserve_chunks(NS, KEYS[:1])
    assert r.nbytes == CB and s.tiers[0].used_bytes == CB
    fill(r, kv(1))
    assert s.lookup_keys(NS, KEYS[:1]).num_hit_chunks == 0  # filled but not committed
    assert s.commit_chunks(NS, KEYS[:1], [r]) == 1
    assert torch.equal(s.get_chunks(NS, KEYS[:1])[0], kv(1))
    assert s.stats()["stored_chunks"] == 1
    s.check_integrity()


def test_released_reservation_frees_its_pages_and_stores_nothing():
    s = make()
    rs = s.reserve_chunks(NS, KEYS[:3])
    assert s.tiers[0].used_bytes == 3 * CB
    s.release_reservations(rs)
    s.release_reservations(rs)  # idempotent
    assert s.tiers[0].used_bytes == 0 and s.tiers[0].num_chunks == 0
    s.check_integrity()


def test_reservation_evicts_like_a_put_and_spills_to_disk(tmp_path):
    s = make(tmp_path, cpu=2, disk=True)
    s.put_chunks(NS, KEYS[:2], [kv(0), kv(1)])
    (r,) = s.reserve_chunks(NS, KEYS[2:3])  # the CPU tier is full: LRU victim spills to disk
    assert s.metrics.snapshot()["evictions_by_tier"] == {"cpu": 1}
    fill(r, kv(2))
    assert s.commit_chunks(NS, KEYS[:3], [kv(0), kv(1), r]) == 1
    s.flush(10)
    got = s.get_chunks(NS, KEYS[:3])
    assert all(torch.equal(g, kv(i)) for i, g in enumerate(got))
    s.check_integrity()
    s.close()


def test_commit_of_a_key_already_stored_keeps_the_old_value_and_frees_the_pages():
    s = make()
    (r,) = s.reserve_chunks(NS, KEYS[:1])
    s.put_chunks(NS, KEYS[:1], [kv(1)])  # another put of the key wins the race
    both = s.reserve_chunks(NS, KEYS[:2])
    assert both[0] is ALREADY_STORED and isinstance(both[1], Reservation)
    s.release_reservations(both)
    fill(r, kv(9))
    assert s.commit_chunks(NS, KEYS[:1], [r]) == 0
    assert torch.equal(s.get_chunks(NS, KEYS[:1])[0], kv(1))
    assert s.tiers[0].used_bytes == CB
    s.check_integrity()


def test_commit_with_a_wrong_size_or_count_raises_and_releases():
    s = make()
    other = Namespace("tiny", KVLayout(2, 1, 4, "float16", 8))  # 256-byte chunks
    (r,) = s.reserve_chunks(other, other.chunk_keys(list(range(8))))
    with pytest.raises(ValueError, match="reservation of 256 bytes for chunks of 128"):
        s.commit_chunks(NS, KEYS[:1], [r])
    rs = s.reserve_chunks(NS, KEYS[:2])
    with pytest.raises(ValueError, match="2 keys but 1 items"):
        s.commit_chunks(NS, KEYS[:2], rs[:1])
    s.release_reservations(rs)
    assert s.tiers[0].used_bytes == 0
    s.check_integrity()


def test_reserve_returns_none_when_every_chunk_is_pinned():
    s = make(cpu=2)
    s.put_chunks(NS, KEYS[:2], [kv(0), kv(1)])
    assert s.pin(NS, KEYS[:2]) == 2
    assert s.reserve_chunks(NS, KEYS[2:4]) == [None, None]
    s.unpin(NS, KEYS[:2])
    assert [r is not None for r in s.reserve_chunks(NS, KEYS[2:4])] == [True, True]


def test_borrowed_views_stay_pinned_and_unevicted_until_release():
    s = make(cpu=2)
    s.put_chunks(NS, KEYS[:2], [kv(0), kv(1)])
    b = s.borrow_chunks(NS, [KEYS[0], KEYS[7]])
    assert b.parts[1] is None and b.lower == []
    view = torch.cat(b.parts[0]).view(torch.float16).view(LAY.shape())
    assert s.pin_count(KEYS[0]) == 1
    s.put_chunks(NS, KEYS[2:4], [kv(2), kv(3)])  # needs room: only the unpinned chunk goes
    assert s.tiers[0].contains(KEYS[0]) and not s.tiers[0].contains(KEYS[1])
    assert torch.equal(view, kv(0))
    b.release()
    b.release()
    assert s.pin_count(KEYS[0]) == 0
    st = s.stats()
    assert (st["hits_by_tier"], st["misses"]) == ({"cpu": 1}, 1)
    s.check_integrity()


def test_borrow_reads_lower_tier_chunks_on_request(tmp_path):
    s = make(tmp_path, cpu=1, disk=True)
    s.put_chunks(NS, KEYS[:2], [kv(0), kv(1)])  # KEYS[0] spilled to disk
    s.flush(10)
    with s.borrow_chunks(NS, KEYS[:2]) as b:
        assert b.lower == [0] and b.parts[0] is None
        b.read_lower()
        got = [torch.cat(p).view(torch.float16).view(LAY.shape()) for p in b.parts]
        assert torch.equal(got[0], kv(0)) and torch.equal(got[1], kv(1))
    assert s.stats()["hits_by_tier"] == {"cpu": 1, "disk": 1}
    assert all(s.pin_count(k) == 0 for k in KEYS[:2])
    s.close()

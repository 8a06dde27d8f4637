"""Tiers on their own: page allocator, memory pools (GPU tier on the CPU device), lmdb disk tier
with its background writer, corruption handling and map-full recovery."""
import lmdb
import pytest
import torch

from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.tiers.base import TierFullError
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.memory import PageAllocator, page_runs

LAY = KVLayout(2, 1, 4, "float16", 4)  # chunk = 128 bytes
NS = Namespace("m", LAY)
KEYS = NS.chunk_keys(list(range(4 * 40)))


def kv(i):
    return (torch.arange(64, dtype=torch.float16) + 100 * i).reshape(LAY.shape())  # [2, 2, 4, 1, 4]


def test_page_allocator_and_runs():
    a = PageAllocator(6)
    assert a.alloc(2) == ((0, 2),) and a.alloc(3) == ((2, 3),)  # (first page, page count)
    a.free(((0, 2),))
    assert a.alloc(2) == ((0, 2),)  # a freed run comes back in order
    with pytest.raises(TierFullError, match="need 2 pages, 1 free"):
        a.alloc(2)
    a.check_integrity([(0, 2), (2, 3)])
    with pytest.raises(AssertionError):
        a.check_integrity([(0, 2), (2, 2)])  # page 4 leaked
    a.free(((2, 3),))
    a.free(((0, 2),))
    assert a._free == [(0, 6)] and a.num_free == 6  # adjacent extents merge back into one
    x, _ = a.alloc(2), a.alloc(2)
    a.free(x)  # stack: pages 0, 1 first, then 4, 5
    assert a.alloc(3) == ((0, 2), (4, 1)) and a.num_used == 5
    assert page_runs(((3, 2), (0, 2)), 64, 200) == ((192, 128), (0, 72))


@pytest.mark.parametrize("make", [lambda: CpuTier(128 * 4, 64, pin_memory=False),
                                  lambda: GpuTier(128 * 4, 64, device="cpu")])
def test_memory_tier_fragmented_pages_are_bit_exact(make):
    t = make()
    for i in range(4):
        t.put(KEYS[i], kv(i), None)
    assert t.used_bytes == 512 and t.free_bytes == 0 and not t.can_fit(1)
    t.delete(KEYS[0])
    t.delete(KEYS[2])
    t.put(KEYS[5], kv(5).transpose(0, 1).contiguous().transpose(0, 1), None)  # strided input
    t.put(KEYS[6], kv(6), KEYS[5])
    assert len(t._entries[KEYS[6]].runs) in (1, 2)
    for i in (1, 3, 5, 6):
        assert torch.equal(t.read(KEYS[i]), kv(i))
    assert t.parent_of(KEYS[6]) == KEYS[5] and t.read(KEYS[0]) is None
    with pytest.raises(TierFullError):
        t.put(KEYS[7], kv(7), None)
    with pytest.raises(KeyError):
        t.put(KEYS[1], kv(1), None)
    t.check_integrity()


def test_memory_tier_splits_a_chunk_over_non_adjacent_pages():
    t = CpuTier(64 * 6, 64, pin_memory=False)
    for i in range(3):
        t.put(KEYS[i], kv(i), None)  # pages (0,1) (2,3) (4,5)
    t.delete(KEYS[0])
    t.delete(KEYS[2])  # free stack now yields 4, 5 ... then 0, 1
    t.allocator._free = [(1, 1), (4, 1), (5, 1), (0, 1)]  # next pops: 0, 5 -> two runs
    t.put(KEYS[9], kv(9), None)
    assert t._entries[KEYS[9]].runs == ((0, 64), (320, 64))
    assert torch.equal(t.read(KEYS[9]), kv(9))
    t.check_integrity()


def _disk(tmp_path, cap=10**6, **kw):
    return DiskTier(str(tmp_path / "db"), cap, **kw)


def test_disk_put_is_visible_at_once_and_survives_reopen(tmp_path):
    t = _disk(tmp_path, codec="raw")
    for i in range(5):
        t.put(KEYS[i], kv(i), KEYS[i - 1] if i else None)
    assert all(t.contains(KEYS[i]) for i in range(5))
    assert torch.equal(t.read(KEYS[3]), kv(3))  # possibly still queued
    assert t.flush(10)
    assert t.used_bytes == 5 * (128 + 44 + 49 + 49 + 8) - 48  # raw codec; chunk 0 has no parent
    t.check_integrity()
    t.close()
    t = _disk(tmp_path)
    assert sorted(t.keys()) == sorted(KEYS[:5])
    assert t.parent_of(KEYS[4]) == KEYS[3] and t.parent_of(KEYS[0]) is None
    assert all(torch.equal(t.read(KEYS[i]), kv(i)) for i in range(5))
    t.check_integrity()
    t.close()


def _corrupt(tmp_path, fn):
    t = _disk(tmp_path)
    t.put(KEYS[0], kv(0), None)
    t.put(KEYS[1], kv(1), KEYS[0])
    t.close()
    env = lmdb.open(str(tmp_path / "db"))
    with env.begin(write=True) as txn:
        fn(txn)
    env.close()
    events = []
    t = _disk(tmp_path)
    t.listener = lambda e, tier, n: events.append((e, n))
    return t, events


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_disk_damage_is_a_miss_and_counted(tmp_path, damage):
    a, b = bytes(KEYS[0]), bytes(KEYS[1])

    def fn(txn):
        va, vb = txn.get(a), txn.get(b)
        if damage == "flip":
            bad = bytearray(va)
            bad[-20] ^= 1
            txn.put(a, bytes(bad))
        elif damage == "truncate":
            txn.put(a, va[:-30])
        else:
            txn.put(a, vb)
            txn.put(b, va)

    t, events = _corrupt(tmp_path, fn)
    if damage == "swap":  # the header names another key: caught while re-indexing at open
        assert t.num_bad_at_open == 2 and t.keys() == [] and events == []
        assert t.read(KEYS[0]) is None and t.read(KEYS[1]) is None
    else:  # caught by the checksum on read
        assert t.num_bad_at_open == 0 and t.contains(KEYS[0])
        assert t.read(KEYS[0]) is None
        assert events == [("corruption", 1)] and not t.contains(KEYS[0])
        assert torch.equal(t.read(KEYS[1]), kv(1))
    t.check_integrity()
    t.close()


def test_disk_map_full_evicts_then_drops(tmp_path):
    big = KVLayout(8, 4, 64, "float32", 16)  # 262144-byte chunks, incompressible below
    keys = Namespace("m", big).chunk_keys(list(range(16 * 12)))
    data = [torch.randn(big.shape()) for _ in keys]
    events = []
    t = DiskTier(str(tmp_path / "db"), capacity_bytes=10**8, map_bytes=2**21)  # map: 2 MiB
    t.listener = lambda e, tier, n: events.append(e)
    for k, x in zip(keys[:12], data):
        t.put(k, x, None)
    assert t.flush(30)
    stored = [k for k in keys[:12] if t.contains(k)]
    assert 3 <= len(stored) < 12 and "eviction" in events and "dropped_write" not in events
    assert stored == keys[12 - len(stored):12]  # LRU: the newest survive
    for k in stored:
        assert torch.equal(t.read(k), data[keys.index(k)])
    # now nothing may be evicted: writes that do not fit are dropped and never visible
    t.evictable = lambda k: False
    fresh = [k for k in keys if not t.contains(k)]
    for k in fresh:
        t.put(k, data[keys.index(k)], None)
    assert t.flush(30)
    dropped = [k for k in fresh if not t.contains(k)]
    assert len(dropped) >= 1 and events.count("dropped_write") == len(dropped)
    assert all(t.read(k) is None for k in dropped)
    assert all(torch.equal(t.read(k), data[keys.index(k)]) for k in keys if t.contains(k))
    t.check_integrity()
    t.close()


@pytest.mark.gpu
def test_gpu_tier_on_cuda_and_pinned_cpu_tier():
    g = GpuTier(4 * 128, 64, device="cuda")
    c = CpuTier(4 * 128, 64)
    assert g.pool.is_cuda and c.pinned and c.pool.is_pinned()
    x = kv(3).cuda()
    g.put(KEYS[0], x, None)
    c.put(KEYS[0], g.read(KEYS[0], "cuda"), None)  # device -> pinned host
    assert torch.equal(c.read(KEYS[0], "cuda").cpu(), kv(3))
    assert torch.equal(g.read(KEYS[0]), kv(3))
    g.check_integrity()
    c.check_integrity()


def test_the_disk_tier_reads_ahead(tmp_path):
    """Values are whole chunks read front to back: with lmdb's readahead off (MADV_RANDOM on
    the map) a cold read faults 4 KiB at a time, 30-40x slower on this machine's disk."""
    t = DiskTier(str(tmp_path / "d"), 1 << 20)
    try:
        assert t.env.flags()["readahead"] is True
    finally:
        t.close()

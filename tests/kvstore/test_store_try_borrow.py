"""Non-blocking borrows (``ChunkStore.try_borrow_chunks``, ``BorrowedChunks.try_release``):
what an event loop may call inline. They act exactly as ``borrow_chunks`` / ``release`` when
they can finish at once, and change nothing (no pin, no counter) when they cannot. Tiny
layout: 2 layers, 1 KV head, head_dim 4, fp16, chunk_size 4 -> 128-byte chunks and pages."""
import threading

import torch

from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAY = KVLayout(2, 1, 4, "float16", 4)
CB = LAY.chunk_bytes  # 128
NS = Namespace("tiny-try", LAY)
KEYS = NS.chunk_keys(list(range(4 * 8)))  # 8 chained keys


def kv(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAY.shape(), generator=g).half()  # [2, 2, 4, 1, 4]


def make(tmp_path=None, cpu=4, disk=False):
    return ChunkStore(StoreConfig(cpu_bytes=cpu * CB, page_bytes=CB,
                                  disk_bytes=(64 << 20) if disk else 0,
                                  disk_path=str(tmp_path / "db") if disk else None,
                                  promote_on_hit=False), [NS])


def as_kv(parts):
    return torch.cat(parts).view(torch.float16).view(LAY.shape())


def held_elsewhere(lock):
    """Hold ``lock`` on another thread until the returned event is set."""
    taken, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            done.wait(10)
    th = threading.Thread(target=hold)
    th.start()
    assert taken.wait(10)
    return done, th


def test_try_borrow_of_cpu_hits_and_misses_acts_as_borrow():
    s = make()
    s.put_chunks(NS, KEYS[:2], [kv(0), kv(1)])
    b = s.try_borrow_chunks(NS, [KEYS[0], KEYS[1], KEYS[5]])
    assert b is not None and b.lower == [] and b.parts[2] is None
    assert torch.equal(as_kv(b.parts[0]), kv(0)) and torch.equal(as_kv(b.parts[1]), kv(1))
    assert [s.pin_count(k) for k in KEYS[:2]] == [1, 1]
    st = s.stats()
    assert (st["hits_by_tier"], st["misses"]) == ({"cpu": 2}, 1)
    assert b.try_release() is True and b.released
    assert [s.pin_count(k) for k in KEYS[:2]] == [0, 0]
    assert b.try_release() is True  # idempotent
    assert [s.pin_count(k) for k in KEYS[:2]] == [0, 0]
    s.check_integrity()


def test_try_borrow_returns_none_while_the_store_lock_is_held():
    s = make()
    s.put_chunks(NS, KEYS[:1], [kv(0)])
    done, th = held_elsewhere(s._lock)
    try:
        assert s.try_borrow_chunks(NS, KEYS[:1]) is None
    finally:
        done.set()
        th.join()
    assert s.pin_count(KEYS[0]) == 0 and s.stats()["hits_by_tier"] == {}
    b = s.try_borrow_chunks(NS, KEYS[:1])
    done, th = held_elsewhere(s._lock)
    try:
        assert b.try_release() is False and not b.released  # nothing done: still pinned
        assert s.pin_count(KEYS[0]) == 1
    finally:
        done.set()
        th.join()
    b.release()
    assert s.pin_count(KEYS[0]) == 0


def test_try_borrow_returns_none_for_a_lower_tier_chunk_and_pins_nothing(tmp_path):
    s = make(tmp_path, cpu=1, disk=True)
    s.put_chunks(NS, KEYS[:2], [kv(0), kv(1)])  # KEYS[0] spilled to disk
    s.flush(10)
    # KEYS[1] (in cpu) comes first: its pin must be undone when KEYS[0] needs the disk
    assert s.try_borrow_chunks(NS, [KEYS[1], KEYS[0]]) is None
    assert [s.pin_count(k) for k in KEYS[:2]] == [0, 0]
    assert s.stats()["hits_by_tier"] == {} and s.stats()["misses"] == 0
    b = s.try_borrow_chunks(NS, KEYS[1:2])  # the cpu chunk alone: inline
    assert b is not None and torch.equal(as_kv(b.parts[0]), kv(1))
    assert b.try_release() is True and s.pin_count(KEYS[1]) == 0
    s.close()


def test_try_release_leaves_a_chunk_removed_while_pinned_to_release():
    s = make()
    s.put_chunks(NS, KEYS[:1], [kv(0)])
    b = s.try_borrow_chunks(NS, KEYS[:1])
    assert s.remove(NS, KEYS[:1]) == 1  # removed while pinned: freed at the last release
    assert torch.equal(as_kv(b.parts[0]), kv(0))
    assert b.try_release() is False and s.pin_count(KEYS[0]) == 1
    b.release()
    assert s.pin_count(KEYS[0]) == 0 and not s.tiers[0].contains(KEYS[0])
    s.check_integrity()


def test_without_views_shared_arena_chunks_have_runs_only():
    s = ChunkStore(StoreConfig(cpu_bytes=4 * CB, page_bytes=CB, cpu_shared=True,
                               promote_on_hit=False), [NS])
    try:
        kvs = [kv(i) for i in range(2)]
        assert s.put_chunks(NS, KEYS[:2], kvs) == 2
        arena = next(t.pool for t in s.tiers if t.name == "cpu")  # [nbytes] uint8
        b = s.try_borrow_chunks(NS, KEYS[:3], views=False)
        assert b.parts == [None, None, None] and b.runs[2] is None
        with_views = s.try_borrow_chunks(NS, KEYS[:3])
        assert with_views.runs == b.runs and with_views.parts[2] is None
        for i in range(2):  # the runs name the very bytes the views hold
            (off, n), = b.runs[i]
            assert n == CB and torch.equal(as_kv(with_views.parts[i]), kvs[i])
            assert torch.equal(arena[off:off + n], with_views.parts[i][0])
        assert s.pin_count(KEYS[0]) == 2  # both borrows pin
        b.release()
        with_views.release()
        assert s.pin_count(KEYS[0]) == 0
    finally:
        s.close()


def test_an_undone_try_borrow_counts_no_access(tmp_path):
    """A try that gives up (a chunk on disk) leaves the eviction policy's and the admission
    filter's counts of the chunks it looked at before as they were; a borrow counts one."""
    s = ChunkStore(StoreConfig(cpu_bytes=CB, page_bytes=CB, disk_bytes=64 << 20,
                               disk_path=str(tmp_path / "db"), promote_on_hit=False,
                               cpu_policy="lfu", admission="tinylfu"), [NS])
    try:
        s.put_chunks(NS, KEYS[:2], [kv(0), kv(1)])  # KEYS[1] spilled to disk
        s.flush(10)
        cpu, adm = s.tiers[0], s._st.admission
        assert cpu.contains(KEYS[0]) and not cpu.contains(KEYS[1])
        before = (cpu.policy.frequency(KEYS[0]), adm.estimate(KEYS[0]))
        for _ in range(3):
            assert s.try_borrow_chunks(NS, [KEYS[0], KEYS[1]]) is None
        assert (cpu.policy.frequency(KEYS[0]), adm.estimate(KEYS[0])) == before
        with s.borrow_chunks(NS, [KEYS[0], KEYS[1]]) as b:
            b.read_lower()
        assert (cpu.policy.frequency(KEYS[0]), adm.estimate(KEYS[0])) == (before[0] + 1,
                                                                         before[1] + 1)
    finally:
        s.close()

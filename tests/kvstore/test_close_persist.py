"""A graceful close writes the memory tiers' chunks to the disk tier (``ChunkStore.close(
persist_s=...)``, ``kvstore.close_persist``): a reopened store on the same path finds them, bit
exact and reachable; hottest first when the disk tier has room for only some of them; never by
evicting a disk chunk; nothing with no budget. Real tiers (GPU tier's code on the CPU, CPU
arena, lmdb disk tier), reopened.

Layout: 4 layers, 2 KV heads, head_dim 32, fp16, 16 tokens per chunk -> 16 KiB per chunk of
random values (the disk codec ``auto`` stores them raw: nothing to gain by compressing).
"""
import time

import pytest
import torch

from kvstore.api import PrefixStore
from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAY = KVLayout(4, 2, 32, "float16", 16)
CB = LAY.chunk_bytes  # 16 KiB
NS = Namespace("persist-on-close", LAY)
CHUNKS = 4  # per prompt


def tokens(i: int) -> list[int]:
    return [1000 * (i + 1) + j for j in range(CHUNKS * LAY.chunk_size)]


def kv(i: int) -> torch.Tensor:
    """Random KV of prompt i: [4, 2, 64, 2, 32] fp16."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(LAY.shape(CHUNKS * LAY.chunk_size), generator=g).to(torch.float16)


def store(tmp_path, gpu=0, cpu=64, disk=None, **kw) -> ChunkStore:
    cfg = StoreConfig(gpu_bytes=gpu * CB, cpu_bytes=cpu * CB,
                      disk_bytes=disk if disk is not None else 256 * CB,
                      disk_path=str(tmp_path / "db"), page_bytes=4096, device="cpu", **kw)
    return ChunkStore(cfg, [NS])


def disk_of(s: ChunkStore):
    return s.tiers[-1]


def on_disk(s: ChunkStore, i: int) -> list[bool]:
    return [disk_of(s).contains(k) for k in NS.chunk_keys(tokens(i))]


def reopen_disk_only(tmp_path, disk=None) -> ChunkStore:
    """The same disk path with no memory tier: every hit is a disk hit."""
    cfg = StoreConfig(cpu_bytes=0, disk_bytes=disk if disk is not None else 256 * CB,
                      disk_path=str(tmp_path / "db"))
    return ChunkStore(cfg, [NS])


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "s3fifo", "arc"])
def test_close_with_persist_writes_every_memory_chunk_bit_exact_and_reachable(tmp_path, policy):
    s = store(tmp_path, gpu=8, cpu=192, gpu_policy=policy, cpu_policy=policy)
    # 40 prompts x 4 chunks: the GPU tier spills to the CPU tier, nothing to disk
    for i in range(40):  # (more than close_persist.WINDOW: the pass waits for commits)
        assert PrefixStore(s, NS).put(tokens(i), kv(i)) == CHUNKS
    assert disk_of(s).num_chunks == 0 and s.tiers[0].num_chunks == 8
    keys = [k for i in range(40) for k in NS.chunk_keys(tokens(i))]
    parents = {k: s._st.mover.parent_of(k) for k in keys}
    rep = s.persist_memory_tiers(30.0)
    assert (rep.written_chunks, rep.left_chunks) == (160, 0)
    assert rep.written_bytes == disk_of(s).used_bytes > 160 * CB  # (values carry a header)
    s.close()  # (the pass above did it all: close with the config's default persists nothing)
    r = reopen_disk_only(tmp_path)
    try:
        assert r.stats()["unreachable_bytes"] == 0
        r.check_integrity()
        assert {k: disk_of(r).parent_of(k) for k in keys} == parents  # chains as put
        for i in range(40):
            p = PrefixStore(r, NS)
            hit = p.lookup(tokens(i))
            assert hit.tiers == ("disk",) * CHUNKS
            assert torch.equal(p.get(tokens(i), CHUNKS * LAY.chunk_size), kv(i))  # bit exact
    finally:
        r.close()


def test_close_persist_s_writes_parents_before_children(tmp_path, monkeypatch):
    s = store(tmp_path, cpu=64)
    for i in range(5):
        PrefixStore(s, NS).put(tokens(i), kv(i))
    for i in (4, 3, 2, 1, 0):  # read back to front: each prompt's leaf is its hottest chunk
        PrefixStore(s, NS).get(tokens(i), CHUNKS * LAY.chunk_size)
    order = []
    disk = disk_of(s)
    real_put = type(disk).put
    monkeypatch.setattr(disk, "put", lambda k, *a, **kw: (order.append(k), real_put(disk, k, *a, **kw)))
    s.close(persist_s=30.0)
    assert len(order) == 20
    pos = {k: j for j, k in enumerate(order)}
    for i in range(5):  # every chunk after its parent; prompt 0 (read last: hottest) first
        ks = NS.chunk_keys(tokens(i))
        assert [pos[k] for k in ks] == sorted(pos[k] for k in ks)
    assert set(order[:CHUNKS]) == set(NS.chunk_keys(tokens(0)))
    r = reopen_disk_only(tmp_path)
    try:
        assert all(all(on_disk(r, i)) for i in range(5))
    finally:
        r.close()


@pytest.mark.parametrize("how", ["default", "zero"])
def test_no_budget_writes_nothing(tmp_path, how):
    s = store(tmp_path)
    PrefixStore(s, NS).put(tokens(0), kv(0))
    with pytest.raises(ValueError, match="persist_s"):
        s.close(persist_s=-1.0)
    s.close() if how == "default" else s.close(persist_s=0)
    r = reopen_disk_only(tmp_path)
    try:
        assert disk_of(r).num_chunks == 0
        assert PrefixStore(r, NS).lookup(tokens(0)).num_hit_chunks == 0
    finally:
        r.close()


def test_config_budget_and_a_spent_budget(tmp_path, caplog):
    with pytest.raises(ValueError, match="persist_on_close_s"):
        store(tmp_path, persist_on_close_s=-2)
    s = store(tmp_path)
    PrefixStore(s, NS).put(tokens(0), kv(0))
    rep = s.persist_memory_tiers(1e-9)  # runs out before the first write
    assert (rep.written_chunks, rep.left_time, rep.left_room) == (0, CHUNKS, 0)
    with pytest.raises(ValueError, match="positive"):
        s.persist_memory_tiers(0)
    s.close()
    s = store(tmp_path, persist_on_close_s=10)
    PrefixStore(s, NS).put(tokens(1), kv(1))
    with caplog.at_level("INFO", logger="kvstore.store"):
        s.close()  # the config's budget
    line = [r.getMessage() for r in caplog.records if "persist on close" in r.getMessage()]
    assert len(line) == 1 and "wrote 4 chunks" in line[0] and "left out 0" in line[0], line
    r = reopen_disk_only(tmp_path)
    try:
        assert on_disk(r, 1) == [True] * CHUNKS and on_disk(r, 0) == [False] * CHUNKS
    finally:
        r.close()


def test_small_disk_keeps_the_hottest_and_evicts_no_disk_chunk(tmp_path):
    room = 16  # chunks the disk tier holds (values of one raw chunk + header at most)
    cap = room * (CB + HEADER_BYTES_MAX)
    s = store(tmp_path, cpu=64, disk=cap)
    old = NS.chunk_keys(tokens(99))
    assert s.persist(NS, old, list(kv(99).split(LAY.chunk_size, dim=2))) == CHUNKS  # on disk
    for i in range(10):  # 40 chunks in the CPU tier, room for 12 more on disk
        PrefixStore(s, NS).put(tokens(i), kv(i))
    for i in (0, 5, 7):  # the hottest prompts, 7 last
        PrefixStore(s, NS).get(tokens(i), CHUNKS * LAY.chunk_size)
    rep = s.persist_memory_tiers(30.0)
    assert rep.written_chunks == 12 and rep.left_room == 28 and rep.left_time == 0
    s.close()
    r = reopen_disk_only(tmp_path, disk=cap)
    try:
        assert on_disk(r, 99) == [True] * CHUNKS  # no disk chunk evicted for it
        assert [all(on_disk(r, i)) for i in range(10)] == [i in (0, 5, 7) for i in range(10)]
        assert not any(any(on_disk(r, i)) for i in range(10) if i not in (0, 5, 7))
        assert r.stats()["unreachable_bytes"] == 0
        r.check_integrity()
        for i in (0, 5, 7, 99):
            assert torch.equal(PrefixStore(r, NS).get(tokens(i), CHUNKS * LAY.chunk_size), kv(i))
    finally:
        r.close()


def test_orphans_are_left_out(tmp_path):
    s = store(tmp_path, cpu=64)
    PrefixStore(s, NS).put(tokens(0), kv(0))
    PrefixStore(s, NS).put(tokens(1), kv(1))
    head = NS.chunk_keys(tokens(1))[:1]
    assert s.remove(NS, head) == 1  # its 3 descendants stay, unreachable
    rep = s.persist_memory_tiers(30.0)
    assert (rep.written_chunks, rep.left_orphan) == (CHUNKS, CHUNKS - 1)
    s.close()
    r = reopen_disk_only(tmp_path)
    try:
        assert on_disk(r, 0) == [True] * CHUNKS and not any(on_disk(r, 1))
        assert r.stats()["unreachable_bytes"] == 0
    finally:
        r.close()


def test_a_slow_disk_writer_runs_out_the_budget_and_keeps_whole_prefixes(tmp_path, monkeypatch):
    s = store(tmp_path, cpu=192)
    for i in range(40):
        PrefixStore(s, NS).put(tokens(i), kv(i))
    disk = disk_of(s)
    real = disk._write_batch

    def slow(batch):  # real lmdb writes, each transaction 0.2 s late
        time.sleep(0.2)
        real(batch)
    monkeypatch.setattr(disk, "_write_batch", slow)
    t0 = time.monotonic()
    s.close(persist_s=0.5)
    assert time.monotonic() - t0 < 0.5 + 3 * 0.2  # the budget, then the batch in flight
    r = reopen_disk_only(tmp_path)
    try:
        kept = [sum(on_disk(r, i)) for i in range(40)]
        assert 0 < sum(kept) < 160  # some, not all
        for i in range(40):  # each prompt's kept chunks are a prefix of it
            assert on_disk(r, i) == [j < kept[i] for j in range(CHUNKS)]
        assert r.stats()["unreachable_bytes"] == 0
        r.check_integrity()
    finally:
        r.close()

"""EngineMinConnector's device handling (``connectors.engine_min_device``), on the CPU twin of
each CUDA path: which stores get host copies of a device pool's chunks, the host-copy path
itself (run here into plain memory) with its event waited for before every put, loads moved to
the pool's device, and the wait for those copies before borrowed pages go back to the store.

Block size 4, chunk size 8 (``fake_engine``)."""
from __future__ import annotations

import torch

import connectors.engine_min_device as dev
import connectors.engine_min_load as load_mod
import connectors.engine_min_save as save_mod
from connectors.chunk_geometry import ChunkGeometry
from connectors.engine_min_save import Saver
from connectors.engine_min_stats import ConnectorStats
from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.direct import BorrowedChunks
from kvstore.store import ChunkStore

from tests.connectors.fake_engine import BS, STORE_MARK, FakeEngine, kv_value, make_conn, prompt

CPU = torch.device("cpu")


def _meta_pool() -> torch.Tensor:
    return torch.empty(2, 2, 16, BS, 1, 2, device="meta")  # [L, 2, blocks, BS, H, D]


def test_an_off_cpu_pool_gives_host_copies_unless_the_store_has_a_gpu_tier_on_top():
    cpu_store = ChunkStore(StoreConfig(cpu_bytes="1MiB"))
    gpu_store = ChunkStore(StoreConfig(gpu_bytes="1MiB", cpu_bytes="1MiB", device="cpu"))
    assert (dev.takes_device_chunks(cpu_store), dev.takes_device_chunks(gpu_store)) == \
        (False, True)
    geometry = ChunkGeometry(BS, 8, 4)
    for store, pool, host in [(cpu_store, _meta_pool(), True), (gpu_store, _meta_pool(), False),
                              (cpu_store, torch.zeros(2, 2, 16, BS, 1, 2), False)]:
        saver = Saver(store, ConnectorStats(), 1 << 20)
        saver.bind(pool, geometry, None)
        assert saver._host_copies is host, (store.capabilities.tiers, pool.device)
        saver.close(1.0)
    cpu_store.close()
    gpu_store.close()


def test_staging_keeps_cpu_chunks_and_copies_for_the_host_path():
    kvs = [torch.arange(16.0).view(2, 2, 4, 1, 1), torch.ones(2, 2, 4, 1, 1)]
    same = dev.stage_for_store(kvs, CPU, host=False)
    assert [a is b for a, b in zip(same, kvs)] == [True, True]
    copies = dev.stage_for_store(kvs, CPU, host=True)
    same.ready.wait()
    copies.ready.wait()
    for a, b in zip(copies, kvs):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr() and not a.is_pinned()
    kv = kvs[0]
    assert dev.to_pool(kv, CPU) == (kv, False)
    moved, in_flight = dev.to_pool(kv, torch.device("meta"))
    assert (moved.device.type, moved.shape, in_flight) == ("meta", kv.shape, False)
    dev.sync_pool(CPU)


def test_host_copy_saves_wait_for_their_event_and_store_exact_kv(monkeypatch):
    """The CUDA save path run on the CPU: every gathered chunk is copied to new host memory,
    the writer waits for the staged chunks' event before each put, the store receives plain
    lists of the copies, and what it holds is bit-exact: a second request loads it."""
    waits, staged, puts = [], [], []
    monkeypatch.setattr(dev.DeviceEvent, "wait", lambda self: waits.append(self))
    real_stage = save_mod.stage_for_store

    def stage(kvs, device, host):
        out = real_stage(kvs, device, host)
        staged.append((list(kvs), host, out))
        return out
    monkeypatch.setattr(save_mod, "stage_for_store", stage)
    toks = prompt(16)
    conn = make_conn(chunk=8)
    eng = FakeEngine(conn, prefix_caching=False)
    conn._saver._host_copies = True           # as for a CUDA pool and a CPU-tier store
    real_put = conn.store.put_chunks
    monkeypatch.setattr(conn.store, "put_chunks", lambda ns, keys, kvs, *p: (
        puts.append((type(kvs), [kv.data_ptr() for kv in kvs])), real_put(ns, keys, kvs, *p))[1])
    eng.add("a", toks)
    eng.run()
    assert conn.wait_for_save(5)
    # two saves: the prompt's 2 chunks, then its 4-token tail pieces (none: 16 = 2 chunks)
    assert [len(out) for _, host, out in staged if host] == [len(out) for _, _, out in staged]
    assert sum(len(out) for _, _, out in staged) == 2
    assert len(waits) == len(puts) == len(staged)
    for (gathered, _, out), (kind, ptrs) in zip(staged, puts):
        assert kind is list and ptrs == [kv.data_ptr() for kv in out]
        assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr()
                   for a, b in zip(out, gathered))
    assert torch.equal(PrefixStore(conn.store, conn.ns).get(toks, 16), kv_value(toks, 0, 16))
    eng.computed_tokens = 0
    seq = eng.add("b", toks)
    eng.step()
    assert (seq.num_cached_tokens, eng.computed_tokens) == (15, 1)
    assert torch.equal(eng.seq_kv(seq, 0, 16), kv_value(toks, 0, 16))
    conn.close()


def test_loads_wait_for_their_copies_before_borrowed_pages_go_back(monkeypatch):
    """A load scatters from the CPU tier's borrowed pages; the pool's copies are waited for
    (``sync_pool``) before the pages are released, and once more before the worker returns."""
    events = []
    monkeypatch.setattr(load_mod, "sync_pool", lambda device: events.append(("sync", device)))
    real_release = BorrowedChunks.release
    monkeypatch.setattr(BorrowedChunks, "release",
                        lambda self: (events.append(("release",)), real_release(self))[1])
    real_to_pool = load_mod.to_pool
    monkeypatch.setattr(load_mod, "to_pool", lambda kv, device: (
        events.append(("to_pool", tuple(kv.shape), device)), real_to_pool(kv, device))[1])
    toks = prompt(24)
    conn = make_conn(chunk=8)
    eng = FakeEngine(conn, prefix_caching=False)
    PrefixStore(conn.store, conn.ns).put(toks, kv_value(toks, 0, 24, STORE_MARK))
    seq = eng.add("r", toks)
    eng.step()
    assert seq.num_cached_tokens == 23
    assert torch.equal(eng.seq_kv(seq, 0, 23), kv_value(toks, 0, 23, STORE_MARK))
    piece = lambda n: ("to_pool", (2, 2, n, 1, 2), CPU)   # noqa: E731 - [L, 2, n, H, D]
    # chunks 0 and 1 whole, chunk 2 up to its last block (tokens 16..24), then the tail
    # namespace (no pieces looked up past the leading chunks): sync, release; final sync
    assert events[:5] == [piece(8), piece(8), piece(8), ("sync", CPU), ("release",)]
    assert events[-1] == ("sync", CPU)
    conn.close()

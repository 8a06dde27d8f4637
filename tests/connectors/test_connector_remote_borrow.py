"""EngineMinConnector over a same-host daemon (``KVStoreClient`` on the daemon's Unix socket,
behind the factory's circuit breaker): loads scatter straight from borrowed views of the
daemon's arena (``connectors.remote_borrow``), no copy into a chunk tensor first; the loaded
KV is the saved KV exactly; the daemon's pins are back to 0 after a load that succeeds and
after one whose scatter raises.

Stand-in engine of ``fake_engine``; block size 4, chunks of 8 tokens (256 bytes, fp32).
"""
from __future__ import annotations

import pytest
import torch

from connectors.remote_borrow import borrowing_read
from kernels import ops
from kvstore.config import StoreConfig
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.shm_borrow import ArenaBorrow
from kvstore.daemon.shm_conn import Arena
from kvstore.layered import CircuitBreakerStore, RemoteSkipped
from kvstore.store import ChunkStore
from tests.connectors.fake_engine import FakeEngine, kv_value, make_conn, prompt
from tests.kvstore.daemon.shm_helpers import wait_until


@pytest.fixture
def daemon(tmp_path):
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, cpu_shared=True, page_bytes=256))
    srv = ThreadedServer(create_app(store, ServerLimits()), unix_socket=str(tmp_path / "kv"))
    yield srv, store
    srv.stop()
    store.close()


def spy(monkeypatch, cls, name) -> list:
    calls, orig = [], getattr(cls, name)

    def wrapped(self, *a, **kw):
        calls.append(a)
        return orig(self, *a, **kw)
    monkeypatch.setattr(cls, name, wrapped)
    return calls


def test_loads_scatter_from_borrowed_arena_views_bit_exact(daemon, monkeypatch):
    srv, store = daemon
    client = KVStoreClient(srv.unix_url, timeout_s=5.0)
    breaker = CircuitBreakerStore(client, get_timeout_s_per_chunk=0.05, get_timeout_s_base=0.5)
    conn = make_conn(breaker, chunk=8)
    eng = FakeEngine(conn, prefix_caching=False)
    toks = prompt(33)
    eng.add("a", toks)
    eng.run()
    assert conn.wait_for_save(10)
    copies = spy(monkeypatch, Arena, "copy_runs")
    releases = spy(monkeypatch, ArenaBorrow, "release")
    eng.computed_tokens = 0
    seq = eng.add("b", toks)
    eng.run()
    assert seq.num_cached_tokens == 32 and eng.computed_tokens == 1
    assert torch.equal(eng.seq_kv(seq, 0, 32), kv_value(toks, 0, 32))
    assert copies == [] and len(releases) == 1  # one borrowed read of 4 chunks, no copy
    assert wait_until(lambda: store.stats()["num_pinned_chunks"] == 0)
    store.check_integrity()
    conn.close()


def test_a_scatter_that_raises_still_releases_the_borrow(daemon, monkeypatch, caplog):
    srv, store = daemon
    conn = make_conn(KVStoreClient(srv.unix_url, timeout_s=5.0), chunk=8)
    eng = FakeEngine(conn, prefix_caching=False)
    toks = prompt(17)
    eng.add("a", toks)
    eng.run()
    assert conn.wait_for_save(10)

    def broken(*a, **kw):
        raise RuntimeError("scatter failed")
    monkeypatch.setattr(ops, "scatter_chunk", broken)
    eng.computed_tokens = 0
    seq = eng.add("b", toks)
    eng.run()
    assert seq.num_cached_tokens == 0 and eng.computed_tokens == 17  # recomputed
    assert "load failed (RuntimeError: scatter failed)" in caplog.text
    assert wait_until(lambda: store.stats()["num_pinned_chunks"] == 0)
    conn.close()


def test_borrowing_read_per_store_kind(daemon):
    srv, store = daemon
    assert borrowing_read(store) == store.borrow_chunks
    client = KVStoreClient(srv.unix_url, timeout_s=5.0)
    assert borrowing_read(client) == client.get_borrowed
    t = [0.0]
    breaker = CircuitBreakerStore(client, clock=lambda: t[0])
    read = borrowing_read(breaker)
    srv.stop()  # the daemon goes away: the read trips the breaker, the next is skipped
    with pytest.raises(TimeoutError):
        read(store_ns := _ns(), store_ns.chunk_keys(prompt(8)))
    with pytest.raises(RemoteSkipped):
        read(store_ns, store_ns.chunk_keys(prompt(8)))
    assert breaker.trips == 1 and breaker.skipped_calls == 1
    client.close()


def _ns():
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    return Namespace("m", KVLayout(num_layers=2, num_kv_heads=1, head_dim=2,
                                   dtype="float32", chunk_size=8))

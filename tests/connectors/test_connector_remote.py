"""EngineMinConnector over a layered (local + remote) store: local-first reads, a dead remote,
the circuit breaker and its deadlines, and the factory and server flags that build each store kind.

Stand-in engine of ``fake_engine``; block size 4 throughout.
"""
from __future__ import annotations

import time

import pytest
import torch

from connectors.engine_min import EngineMinConnector
from connectors.factory import create_connector
from kvstore.layered import LayeredStore
from kvstore.api import KVStoreBase, PrefixStore
from kvstore.config import StoreConfig
from kvstore.keys import ChunkKey, chain_hashes
from kvstore.store import ChunkStore

from tests.connectors.fake_engine import FakeEngine, kv_value, make_conn, make_store, prompt


# ---- layered store -------------------------------------------------------------------------
def test_layered_store_reads_local_first_then_remote_and_copies_back():
    local, remote = make_store(), make_store()
    conn = make_conn(LayeredStore(local, remote), chunk=8)
    FakeEngine(conn, prefix_caching=False)
    toks = prompt(33)
    PrefixStore(remote, conn.ns).put(toks, kv_value(toks, 0, 32))
    PrefixStore(local, conn.ns).put(toks[:8], kv_value(toks, 0, 8))
    res = PrefixStore(conn.store, conn.ns).lookup(toks)
    assert res.tiers == ("cpu", "remote:cpu", "remote:cpu", "remote:cpu")
    eng = FakeEngine(conn, prefix_caching=False)
    seq = eng.add("r", toks)
    eng.step()
    assert seq.num_cached_tokens == 32
    assert conn.get_stats()["kvstore_hit_tokens_by_tier"] == {"cpu": 8, "remote:cpu": 24}
    assert PrefixStore(local, conn.ns).lookup(toks).num_hit_chunks == 4   # copied back
    conn.close()


def test_layered_store_survives_a_dead_remote(caplog):
    from kvstore.daemon.client import KVStoreClient
    local = make_store()
    dead = KVStoreClient("http://127.0.0.1:9", timeout_s=0.2)
    conn = make_conn(LayeredStore(local, dead), chunk=4)
    eng = FakeEngine(conn, prefix_caching=False)
    toks = prompt(12)
    eng.add("a", toks)
    eng.run()
    assert conn.wait_for_save(10)
    eng.computed_tokens = 0
    seq = eng.add("b", toks)
    eng.run()
    assert seq.num_cached_tokens == 11 and eng.computed_tokens == 1
    assert conn.store.remote_errors >= 1
    conn.close()


def test_circuit_breaker_skips_a_failed_remote_for_a_doubling_cooldown_then_probes():
    from kvstore.daemon.client import RemoteError, StoreUnavailable

    from kvstore.layered import CircuitBreakerStore, RemoteSkipped
    now = [100.0]

    class Remote(ChunkStore):
        url = "http://127.0.0.1:9"
        fail: BaseException | None = None
        calls = 0

        def exists(self, ns, keys):
            self.calls += 1
            if self.fail is not None:
                raise self.fail
            return super().exists(ns, keys)

    remote = Remote(StoreConfig(cpu_bytes="1MiB"))
    br = CircuitBreakerStore(remote, cooldown_s=2.0, max_cooldown_s=5.0, clock=lambda: now[0])
    conn = make_conn(br, chunk=4)
    FakeEngine(conn)
    ns = conn.ns
    keys = [ChunkKey(ns.ns_id, h) for h in chain_hashes(ns.digest, prompt(8), 4, "sha256")]
    assert br.exists(ns, keys) == [False, False] and not br.is_open
    remote.fail = StoreUnavailable("connection refused")
    for expect_cooldown in (2.0, 4.0, 5.0, 5.0):   # doubles, capped at max_cooldown_s
        with pytest.raises(StoreUnavailable, match="connection refused"):
            br.exists(ns, keys)                      # the probe (or first call) fails: opens
        calls = remote.calls
        now[0] += expect_cooldown - 0.01
        for _ in range(3):
            with pytest.raises(RemoteSkipped, match="failed recently"):
                br.exists(ns, keys)
        assert remote.calls == calls and br.is_open  # skipped: never sent
        now[0] += 0.01
    assert (br.skipped_calls, br.trips) == (12, 4)
    remote.fail = None
    assert br.exists(ns, keys) == [False, False] and not br.is_open   # the probe closes it
    remote.fail = StoreUnavailable("hung")
    with pytest.raises(StoreUnavailable):
        br.exists(ns, keys)
    assert br._open_until == now[0] + 2.0          # reset to the first cool-down
    now[0] += 2.0
    for exc in (RemoteError(401, "bad token"), ValueError("bad tensor")):  # not unavailability
        remote.fail = exc
        with pytest.raises(type(exc)):
            br.exists(ns, keys)
    remote.fail = None
    assert br.exists(ns, keys) == [False, False] and br.trips == 5
    assert conn.get_stats()["kvstore_remote_skipped_calls"] == 12
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreakerStore(remote, cooldown_s=0)
    conn.close()


def test_dead_daemon_costs_requests_nothing_after_the_first_failure(caplog):
    from socket import socket
    with socket() as sk:
        sk.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sk.getsockname()[1]}"   # nothing listens once closed
    conn = create_connector(url=url, chunk_size=4, deadline_s=0.5)
    eng = FakeEngine(conn, prefix_caching=False)
    seqs = [eng.add(f"r{i}", prompt(12, base=100 * i)) for i in range(6)]
    t0 = time.monotonic()
    eng.run()
    elapsed = time.monotonic() - t0
    assert all(s.is_finished and s.num_cached_tokens == 0 for s in seqs)  # recomputed
    assert eng.computed_tokens == 6 * 12
    assert conn.wait_for_save(5)
    st = conn.get_stats()
    # the first lookup is refused (2 tries, ~50 ms) and opens the breaker for 2 s: the other
    # lookups and the saves are skipped without a connection attempt
    assert st["kvstore_lookup_fallbacks"] == 6 and st["kvstore_remote_breaker_trips"] == 1
    assert st["kvstore_remote_skipped_calls"] >= 5 and st["kvstore_remote_breaker_open"]
    assert st["kvstore_lookup_seconds_max"] < 0.4 and elapsed < 1.0
    conn.close()


def test_factory_validates_and_builds_each_store_kind(tmp_path):
    with pytest.raises(ValueError, match="no store"):
        create_connector()
    with pytest.raises(ValueError, match="disk_bytes needs disk_path"):
        create_connector(disk_bytes="1MiB")
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        create_connector(url="127.0.0.1:9")
    for url, why in (("http://127.0.0.1:99999", "out of range"), ("tcp://h:port", "port"),
                     ("http://:8500", "no host")):  # each used to be accepted silently
        with pytest.raises(ValueError, match=why):
            create_connector(url=url)
    c = create_connector(cpu_bytes="1MiB", chunk_size=8)
    assert isinstance(c.store, ChunkStore) and c.store.config.tiers == ("cpu",)
    c.close()
    c = create_connector(disk_path=str(tmp_path / "d"), disk_bytes="4MiB", chunk_size=8)
    assert c.store.config.tiers == ("disk",)
    c.close()
    c = create_connector(cpu_bytes="1MiB", url="tcp://127.0.0.1:9", chunk_size=8)
    assert isinstance(c.store, LayeredStore) and c.store.remote.url == "http://127.0.0.1:9"
    assert type(c.store.remote).__name__ == "CircuitBreakerStore"
    c.close()
    assert isinstance(KVStoreBase, type)


def test_server_flags_build_the_connector_through_the_factory(tmp_path):
    import argparse

    from engine_min.serve.cli import add_serve_args, build_connector
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    assert build_connector(parse([])) is None
    c = build_connector(parse(["--kvstore-cpu-bytes", "8MiB", "--kvstore-disk-path",
                               str(tmp_path / "d"), "--kvstore-disk-bytes", "16MiB",
                               "--kvstore-chunk-size", "32"]))
    assert isinstance(c, EngineMinConnector) and c.chunk_size == 32
    assert c.store.config.tiers == ("cpu", "disk") and c.store.config.disk_bytes == 16 << 20
    c.close()


def test_breaker_gives_background_saves_a_long_deadline_and_gets_a_per_chunk_one():
    """A save of many chunks must not inherit the 0.5 s lookup deadline: on a busy host it
    timed out, tripped the breaker and so turned the next lookups into misses."""
    from connectors.factory import SAVE_TIMEOUT_S, create_connector
    from kvstore.layered import CircuitBreakerStore

    class Remote(ChunkStore):
        url = "http://127.0.0.1:9"

        def __init__(self, cfg):
            super().__init__(cfg)
            self.seen: list[tuple[str, float | None]] = []

        def put_chunks(self, ns, keys, kvs, *, timeout_s=None):
            self.seen.append(("put", timeout_s))
            return super().put_chunks(ns, keys, kvs)

        def get_chunks(self, ns, keys, *, timeout_s=None):
            self.seen.append(("get", timeout_s))
            return super().get_chunks(ns, keys)

    remote = Remote(StoreConfig(cpu_bytes="4MiB"))
    br = CircuitBreakerStore(remote, put_timeout_s=30.0, get_timeout_s_per_chunk=0.05,
                             get_timeout_s_base=0.5)
    conn = make_conn(br, chunk=4)
    FakeEngine(conn)
    ns = conn.ns
    toks = prompt(8)
    keys = ns.chunk_keys(toks)
    kvs = [torch.zeros(ns.layout.shape(), dtype=ns.layout.torch_dtype) for _ in keys]
    assert br.put_chunks(ns, keys, kvs) == 2
    assert [c is not None for c in br.get_chunks(ns, keys)] == [True, True]
    assert remote.seen == [("put", 30.0), ("get", pytest.approx(0.5 + 2 * 0.05))]
    # The factory wires the same deadlines around its daemon client.
    c = create_connector(url="http://127.0.0.1:9", chunk_size=16, deadline_s=0.5)
    store = c.store
    assert isinstance(store, CircuitBreakerStore)
    assert (store.put_timeout_s, store.get_timeout_s_per_chunk, store.get_timeout_s_base) == (
        SAVE_TIMEOUT_S, 0.05, 0.5)
    c.close()

"""Hit tokens by tier (``kvstore_hit_tokens_by_tier``) are reported for every tier the store
can name from the start, at 0, so the server's ``engine_kvstore_hit_tokens_by_tier_total``
series exist before the first hit; the names are the ones lookups report (a daemon's tiers
as ``"remote:<tier>"``)."""
from __future__ import annotations

from connectors.engine_min_lookup import hit_tier_names
from engine_min.serve.metrics import ServerMetrics
from kvstore.api import PrefixStore
from kvstore.circuit_store import CircuitBreakerStore
from kvstore.config import TIER_NAMES, StoreConfig
from kvstore.daemon.client import KVStoreClient
from kvstore.layered import LayeredStore
from kvstore.store import REMOTE, ChunkStore
from tests.connectors.fake_engine import FakeEngine, kv_value, make_conn, make_store, prompt

DAEMON_TIERS = tuple(f"remote:{t}" for t in TIER_NAMES + (REMOTE,))


def test_names_of_in_process_layered_and_daemon_stores(tmp_path):
    disk = ChunkStore(StoreConfig(cpu_bytes="1MiB", disk_bytes="1MiB", disk_path=str(tmp_path)))
    client = KVStoreClient("http://127.0.0.1:9")     # nothing is asked of it here
    try:
        assert hit_tier_names(disk) == ("cpu", "disk") == disk.capabilities.tiers
        assert hit_tier_names(LayeredStore(make_store(), make_store())) == ("cpu", "remote:cpu")
        assert DAEMON_TIERS == ("remote:gpu", "remote:cpu", "remote:disk", "remote:remote")
        assert hit_tier_names(client) == DAEMON_TIERS
        assert hit_tier_names(CircuitBreakerStore(client)) == DAEMON_TIERS
        assert hit_tier_names(LayeredStore(disk, CircuitBreakerStore(client))) == (
            "cpu", "disk") + DAEMON_TIERS
    finally:
        client.close()
        disk.close()


def test_every_tier_is_exported_at_zero_before_a_hit_then_counts_its_own(tmp_path):
    conn = make_conn(ChunkStore(StoreConfig(cpu_bytes="1MiB", disk_bytes="1MiB",
                                            disk_path=str(tmp_path))))
    metrics = ServerMetrics()
    try:
        assert conn.get_stats()["kvstore_hit_tokens_by_tier"] == {"cpu": 0, "disk": 0}
        metrics.update_from_stats(conn.get_stats())

        def series():
            return {t: metrics.registry.get_sample_value(
                "engine_kvstore_hit_tokens_by_tier_total", {"tier": t}) for t in ("cpu", "disk")}

        assert series() == {"cpu": 0.0, "disk": 0.0}
        FakeEngine(conn, prefix_caching=False)   # binds the connector's namespace
        toks = prompt(17)
        PrefixStore(conn.store, conn.ns).put(toks, kv_value(toks, 0, 16))
        eng = FakeEngine(conn, prefix_caching=False)
        seq = eng.add("r", toks)
        eng.step()
        assert seq.num_cached_tokens == 16
        metrics.update_from_stats(conn.get_stats())
        assert series() == {"cpu": 16.0, "disk": 0.0}
    finally:
        conn.close()


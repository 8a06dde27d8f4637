"""Every labelled counter of a store has its series from the first scrape, at 0, for each
tier (``rate()`` and alerts need a series before its first event), and so have the latency
histogram of each store call and the daemon's checksum rejections: scraped from the daemon's
``/metrics`` of an in-process server, and from the registry of a store over Redis."""
import re

import pytest

from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.metrics import StoreMetrics, _COUNTERS

from tests.kvstore import store_helpers as H
from tests.kvstore.daemon.server_helpers import request
from tests.kvstore.remote_helpers import make_store as make_remote_store
from tests.redis_fixtures import redis_server  # noqa: F401  (fixture)

TIER_COUNTERS = sorted(name for name, (_, by_tier) in _COUNTERS.items() if by_tier)


def samples(text: str, metric: str) -> dict[str, float]:
    """``{tier: value}`` of ``metric``'s samples in exposition ``text``."""
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(rf'^{metric}{{tier="([^"]+)"}} (\S+)$', text, re.M)}


def test_daemon_exports_each_tier_counter_of_each_tier_at_zero_before_any_event(tmp_path):
    store = H.make(tmp_path, cpu=2, gpu=1, disk=1 << 20)
    srv = ThreadedServer(create_app(store, ServerLimits()))
    try:
        status, data, _ = request(srv, "GET", "/metrics", auth=False)
        assert status == 200
        text = data.decode()
        assert len(TIER_COUNTERS) == 9  # hits .. stale_index_entries
        for name in TIER_COUNTERS:
            got = samples(text, f"kvstore_{name}_total")
            assert got == {"gpu": 0.0, "cpu": 0.0, "disk": 0.0}, (name, got)
        assert "kvstore_remote_" not in text  # no remote tier, no remote series
        for op in ("lookup", "get", "put"):  # the latency histogram of each store call
            assert f'kvstore_op_latency_seconds_count{{op="{op}"}} 0.0\n' in text, op
        assert 'kvstore_server_rejected_chunks_total{reason="checksum"} 0.0\n' in text
        # the first events then count on the series already there
        for i in range(4):  # 1 gpu chunk, 2 cpu: evictions and spills
            H.put(store, H.prompt(i))
        store.flush(5.0)
        text = request(srv, "GET", "/metrics", auth=False)[1].decode()
        assert samples(text, "kvstore_evictions_total")["gpu"] == store.metrics.count(
            "evictions", "gpu") >= 3
        assert samples(text, "kvstore_spills_total")["gpu"] >= 3
        assert samples(text, "kvstore_promotions_total") == {"gpu": 0.0, "cpu": 0.0, "disk": 0.0}
    finally:
        srv.stop()
        store.close()


def test_remote_tier_hits_and_promotions_exported_at_zero(redis_server):  # noqa: F811
    store = make_remote_store(redis_server.url)
    try:
        text = store.metrics.exposition().decode()
        assert samples(text, "kvstore_hits_total") == {"cpu": 0.0, "remote": 0.0}
        assert samples(text, "kvstore_promotions_total") == {"cpu": 0.0, "remote": 0.0}
        assert samples(text, "kvstore_evictions_total") == {"cpu": 0.0}  # (counted by Redis)
        for op in ("lookup", "get", "put"):
            assert f'kvstore_remote_latency_seconds_count{{op="{op}"}} 0.0\n' in text, op
    finally:
        store.close()


def test_add_tier_rejects_unknown_and_unlabelled_counters_and_keeps_counts():
    m = StoreMetrics()
    m.inc("hits", 2, tier="cpu")
    m.add_tier("cpu")
    assert m.registry.get_sample_value("kvstore_hits_total", {"tier": "cpu"}) == 2
    assert m.registry.get_sample_value("kvstore_spills_total", {"tier": "cpu"}) == 0
    with pytest.raises(KeyError):
        m.add_tier("cpu", ("nope",))
    with pytest.raises(ValueError, match="'lookups' has no tier label"):
        m.add_tier("cpu", ("lookups",))

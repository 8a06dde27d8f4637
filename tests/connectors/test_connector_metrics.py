"""engine_min's /metrics with the KV connector's ``engine_kvstore_*`` series: every series parses
with prometheus_client's own parser under a valid name, counters never go down across scrapes
(also when the connector is replaced and its counts restart), and values equal the connector's
``get_stats()``. Stand-in engine of ``fake_engine`` (block 4, chunk 8, pieces of 4)."""
from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from connectors.engine_min import EngineMinConnector
from connectors.engine_min_stats import LATENCY_BUCKETS_S, Latency
from connectors.factory import create_connector
from engine_min.serve.metrics import ServerMetrics
from kvstore.config import StoreConfig
from kvstore.store import ChunkStore
from tests.connectors.fake_engine import FakeEngine, prompt

NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def scrape(m: ServerMetrics) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one render, checking names and types."""
    text, ctype = m.render()
    assert ctype.startswith("text/plain")
    out, types = {}, {}
    for fam in text_string_to_metric_families(text.decode()):
        assert NAME.match(fam.name), fam.name
        types[fam.name] = fam.type
        for s in fam.samples:
            assert NAME.match(s.name), s.name
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out, types


def counters(samples: dict, types: dict) -> dict:
    return {k: v for k, v in samples.items()
            if k[0].endswith("_total") and types.get(k[0][:-len("_total")]) == "counter"}


def run_round(conn, toks, rid):
    eng = FakeEngine(conn, prefix_caching=False)
    eng.add(rid, toks)
    eng.run()
    assert conn.wait_for_save(10)


def test_kvstore_series_parse_match_the_connector_and_never_go_down():
    m = ServerMetrics()
    conn = EngineMinConnector(ChunkStore(StoreConfig(cpu_bytes="1MiB")), chunk_size=8,
                              tail_chunk_size=4, deadline_s=10.0)
    prev: dict = {}
    for i in range(3):
        run_round(conn, prompt(23), f"r{i}")
        st = conn.get_stats()
        m.update_from_stats(st)
        samples, types = scrape(m)
        assert samples[("engine_kvstore_saved_tail_chunks_total", ())] == \
            st["kvstore_saved_tail_chunks"] == 1
        assert samples[("engine_kvstore_loaded_tail_chunks_total", ())] == \
            st["kvstore_loaded_tail_chunks"] == i
        # (the labelled series appears with the first hit)
        assert samples.get(("engine_kvstore_hit_tokens_by_tier_total", (("tier", "cpu"),)),
                           0) == 20 * i
        assert samples[("engine_external_prefix_cache_hits_total", ())] == 20 * i
        assert types["engine_kvstore_save_queue_bytes"] == "gauge"
        assert types["engine_kvstore_lookup_seconds_max"] == "gauge"
        now = counters(samples, types)
        assert all(now.get(k, 0) >= v for k, v in prev.items()), \
            {k: (v, now.get(k)) for k, v in prev.items() if now.get(k, 0) < v}
        prev = now
    # a new connector (counts restart at 0): the counters keep their totals and grow again
    conn.close()
    conn = EngineMinConnector(ChunkStore(StoreConfig(cpu_bytes="1MiB")), chunk_size=8,
                              tail_chunk_size=4, deadline_s=10.0)
    run_round(conn, prompt(23), "fresh")
    m.update_from_stats(conn.get_stats())
    samples, types = scrape(m)
    now = counters(samples, types)
    assert all(now.get(k, 0) >= v for k, v in prev.items())
    # 3, then a count restarted at 1: +1 (was +0: the restarted connector's first request,
    # and everything else it had counted by the first scrape, were lost)
    assert samples[("engine_kvstore_requests_total", ())] == 4
    # (a restarted count that is already back at or above the old value cannot be told from
    # no change: saved_tail_chunks went 1 -> 1 here; only drops are seen as restarts)
    assert samples[("engine_external_prefix_cache_queries_total", ())] == 4 * 23
    run_round(conn, prompt(23), "again")
    m.update_from_stats(conn.get_stats())
    samples, _ = scrape(m)
    assert samples[("engine_kvstore_requests_total", ())] == 5
    conn.close()


def test_a_dead_daemon_breaker_exports_gauge_and_counters_that_parse():
    m = ServerMetrics()
    conn = create_connector(url="http://127.0.0.1:9", chunk_size=8, tail_chunk_size=4,
                            deadline_s=0.5)
    run_round(conn, prompt(23), "r")
    st = conn.get_stats()
    assert isinstance(st["kvstore_remote_breaker_open"], bool)
    m.update_from_stats(st)
    samples, types = scrape(m)
    assert types["engine_kvstore_remote_breaker_open"] == "gauge"
    assert samples[("engine_kvstore_remote_breaker_open", ())] == float(st["kvstore_remote_breaker_open"])
    assert samples[("engine_kvstore_lookup_fallbacks_total", ())] == st["kvstore_lookup_fallbacks"] >= 1
    conn.close()


def test_latencies_are_histograms_that_match_the_connector_and_survive_a_restart():
    m = ServerMetrics()
    conn = EngineMinConnector(ChunkStore(StoreConfig(cpu_bytes="1MiB")), chunk_size=8,
                              tail_chunk_size=4, deadline_s=10.0)
    before = scrape(m)[1]
    assert not any(name.startswith("engine_kvstore_") for name in before)  # none before stats
    for i in range(2):
        run_round(conn, prompt(23), f"r{i}")
    st = conn.get_stats()
    m.update_from_stats(st)
    samples, types = scrape(m)
    bounds = [str(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
    for kind in ("lookup", "load", "save"):
        name = f"engine_kvstore_{kind}_seconds"
        assert types[name] == "histogram" and types[f"{name}_max"] == "gauge"
        count = st[f"kvstore_{kind}_count"]
        assert count >= 1 and samples[(f"{name}_count", ())] == count
        assert samples[(f"{name}_sum", ())] == st[f"kvstore_{kind}_seconds_sum"] > 0
        got = [samples[(f"{name}_bucket", (("le", b),))] for b in bounds]
        assert got == sorted(got) and got[-1] == count
        assert got[:-1] == [st[f"kvstore_{kind}_seconds_bucket"][b] for b in LATENCY_BUCKETS_S]
        # the histogram replaces the sum and count counters
        assert f"engine_kvstore_{kind}_seconds_total" not in types
        assert f"engine_kvstore_{kind}_count" not in types
    lookups = samples[("engine_kvstore_lookup_seconds_count", ())]
    # a new connector (counts restart at 0): the histogram keeps its counts and grows again
    conn.close()
    conn = EngineMinConnector(ChunkStore(StoreConfig(cpu_bytes="1MiB")), chunk_size=8,
                              tail_chunk_size=4, deadline_s=10.0)
    run_round(conn, prompt(23), "fresh")
    st = conn.get_stats()
    m.update_from_stats(st)
    samples, _ = scrape(m)
    assert samples[("engine_kvstore_lookup_seconds_count", ())] == \
        lookups + st["kvstore_lookup_count"] > lookups
    assert samples[("engine_kvstore_lookup_seconds_bucket", (("le", "+Inf"),))] == \
        lookups + st["kvstore_lookup_count"]
    conn.close()


def test_latency_buckets_count_each_duration_in_its_le_bucket():
    lat = Latency()
    for s in (0.0002, 0.0005, 0.003, 0.003, 2.0, 30.0):
        lat.add(s)
    d = lat.as_dict("kvstore_load")
    assert d["kvstore_load_count"] == 6 and d["kvstore_load_seconds_max"] == 30.0
    assert d["kvstore_load_seconds_sum"] == pytest.approx(32.0067)
    b = d["kvstore_load_seconds_bucket"]
    assert list(b) == list(LATENCY_BUCKETS_S)
    assert (b[0.0005], b[0.001], b[0.0025], b[0.005], b[1.0], b[2.5], b[10.0]) == \
        (2, 2, 2, 4, 4, 5, 5)  # 30 s: only in +Inf (the count)

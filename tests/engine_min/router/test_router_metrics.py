"""The router's per-engine series exist from the start, at 0: ``router_requests_total`` for
every (engine, reason) pair once the engine is added, so ``rate()`` and alerts on a reason
work before its first request (scraped from ``/metrics`` of an in-process router over two
fake engines)."""
from __future__ import annotations

import pytest

from engine_min.router.metrics import REQUEST_REASONS, RouterMetrics
from engine_min.tokenizer import load_tokenizer
from tests.engine_min.router.fake_engine import completion_body, fake_engine
from tests.engine_min.router.served import metric, metrics, request, start_router, wait_health


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_every_engine_and_reason_is_exported_at_zero_before_its_first_request(tokenizer):
    assert REQUEST_REASONS == ("hit", "load", "round_robin", "retry")
    engines = [fake_engine("hang"), fake_engine("hang")]
    srv = start_router([e.url for e in engines], tokenizer, policy="round-robin")
    try:
        wait_health(srv.url, timeout_s=30)
        m = metrics(srv.url)
        series = {k: v for k, v in m.items() if k.startswith("router_requests_total{")}
        assert series == {f'router_requests_total{{engine="{e.url}",reason="{r}"}}': 0.0
                          for e in engines for r in REQUEST_REASONS}
        for e in engines:  # beside the engine's other series, also at 0 from the start
            assert metric(m, "router_predicted_hit_tokens_total", engine=e.url) == 0.0
        status, _, _ = request(srv.url, "/v1/completions", completion_body(0.0), timeout=30)
        assert status == 200
        m = metrics(srv.url)
        counts = {(e.url, r): metric(m, "router_requests_total", engine=e.url, reason=r)
                  for e in engines for r in REQUEST_REASONS}
        assert sum(counts.values()) == 1 and list(counts.values()).count(0.0) == 7
        assert max(counts, key=counts.get)[1] == "round_robin"
    finally:
        srv.stop()
        for e in engines:
            e.stop()


def test_add_engine_keeps_counts_of_an_engine_added_again():
    m = RouterMetrics()
    m.requests.labels("http://e:1", "hit").inc(3)
    m.add_engine("http://e:1")
    assert m.registry.get_sample_value(
        "router_requests_total", {"engine": "http://e:1", "reason": "hit"}) == 3
    assert m.registry.get_sample_value(
        "router_requests_total", {"engine": "http://e:1", "reason": "retry"}) == 0

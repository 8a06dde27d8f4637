"""``router_store_lookups_total{result}`` is exported for every result at 0 from the start,
as the router's other labelled series are, so ``rate()`` and alerts on timeouts or errors
work before the first one happens."""
from __future__ import annotations

from engine_min.router.metrics import STORE_LOOKUP_RESULTS, RouterMetrics


def test_every_store_lookup_result_is_rendered_at_zero_before_any_lookup():
    assert STORE_LOOKUP_RESULTS == ("ok", "timeout", "error", "skipped")
    text = RouterMetrics().render()[0].decode()
    lines = {ln for ln in text.splitlines() if ln.startswith("router_store_lookups_total{")}
    assert lines == {f'router_store_lookups_total{{result="{r}"}} 0.0'
                     for r in STORE_LOOKUP_RESULTS}


def test_a_counted_result_moves_alone():
    m = RouterMetrics()
    m.store_lookups.labels("timeout").inc()
    got = {r: m.registry.get_sample_value("router_store_lookups_total", {"result": r})
           for r in STORE_LOOKUP_RESULTS}
    assert got == {"ok": 0.0, "timeout": 1.0, "error": 0.0, "skipped": 0.0}

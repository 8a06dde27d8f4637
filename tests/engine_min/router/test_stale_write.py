"""A request written to a pooled connection the engine is closing (aiohttp's
``ClientConnectionResetError``, "Cannot write to closing transport": the engine's FIN came in
before the router's write) is a stale connection like a disconnect: sent again on a fresh
connection to the same engine, which stays in service, so the streams it is serving go on.
The failure is injected at the router's pooled session, the first write only; the engines and
the router are real."""
from __future__ import annotations

import json

import aiohttp

from tests.engine_min.router.served import (MODEL, metric, metrics, request, start_router,
                                            wait_health)


class _ClosingOnce:
    """The router's pooled session, whose first ``post`` fails as a closing transport's
    write does; everything else goes to the real session."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session, self.failed = session, 0

    def post(self, *args, **kwargs):
        if self.failed == 0:
            self.failed += 1

            async def closing():
                raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
            return closing()
        return self._session.post(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_a_write_to_a_closing_connection_is_retried_on_a_fresh_one(engines):
    eng = engines[0]
    url = f"http://127.0.0.1:{eng.port}"
    srv = start_router([url], eng.engine.tokenizer, health_interval_s=30.0)
    try:
        wait_health(srv.url)
        flaky = _ClosingOnce(srv.router.session)
        srv.router.session = flaky
        status, _, body = request(srv.url, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": "Closing transport test:", "max_tokens": 3,
             "temperature": 0}).encode())
        assert flaky.failed == 1
        assert status == 200, body
        assert len(json.loads(body)["choices"][0]["text"]) > 0
        m = metrics(srv.url)
        assert metric(m, "router_stale_connection_retries_total", engine=url) == 1
        assert metric(m, "router_engine_healthy", engine=url) == 1
        assert m["router_failed_requests_total"] == 0
        assert srv.router.engines[0].healthy
    finally:
        srv.stop()

"""A request written to a pooled connection the engine is closing (aiohttp's
``ClientConnectionResetError``, "Cannot write to closing transport": the engine's FIN came in
before the router's write) is a stale connection like a disconnect: sent again on a fresh
connection to the same engine, which stays in service, so the streams it is serving go on.
The same holds when the connection drops after the request went out but before the answer's
headers came back (the engine got the request: it runs twice, the client gets one answer).
The failures are injected at the router's pooled session, once; the engines and the router are
real."""
from __future__ import annotations

import json

import aiohttp

from tests.engine_min.router.served import (MODEL, STREAM_END, metric, metrics, post_json,
                                            post_stream, read_until, request, start_router,
                                            stream_choices, wait_health)


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


class _DisconnectedAfterSend:
    """The router's pooled session; once ``armed``, the next ``post`` goes to the engine whole,
    then its connection drops before the router sees any byte of the answer (the real answer
    is discarded, the connection closed) and it fails as ``ServerDisconnectedError``."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session, self.armed, self.failed = session, False, 0

    def post(self, *args, **kwargs):
        if not self.armed:
            return self._session.post(*args, **kwargs)
        self.armed = False

        async def sent_then_disconnected():
            resp = await self._session.post(*args, **kwargs)   # the engine got it all
            resp.close()
            self.failed += 1
            raise aiohttp.ServerDisconnectedError()
        return sent_then_disconnected()

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_a_disconnect_after_the_send_is_retried_and_spares_other_streams(engines):
    eng = engines[1]
    url = f"http://127.0.0.1:{eng.port}"
    # health checks 30 s apart: an engine taken out stays out for the rest of the test
    srv = start_router([url], eng.engine.tokenizer, policy="round-robin", health_interval_s=30.0)
    other = retried = None
    prompt = "Disconnected after the send:"
    try:
        wait_health(srv.url)
        flaky = _DisconnectedAfterSend(srv.router.session)
        srv.router.session = flaky
        other = post_stream(srv.port, "Write a long story about a mountain railway.", 64)
        other_got = read_until(other, b"data: {")          # the other stream is under way
        assert other_got.startswith(b"HTTP/1.1 200"), other_got[:200]
        flaky.armed = True
        retried = post_stream(srv.port, prompt, 8)
        got = read_until(retried, STREAM_END)
        assert flaky.failed == 1
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(STREAM_END), got[-400:]
        assert b'"error"' not in got, got[-400:]
        direct = post_json(url, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                     "max_tokens": 8, "ignore_eos": True,
                                                     "temperature": 0})
        text = "".join(c["text"] for c in stream_choices(got))
        assert text == direct["choices"][0]["text"] and text, (text, direct)
        other_got = read_until(other, STREAM_END, other_got)
        assert b'"error"' not in other_got and other_got.endswith(STREAM_END), other_got[-400:]
        assert stream_choices(other_got)[-1]["finish_reason"] == "length"
        m = metrics(srv.url)
        assert metric(m, "router_stale_connection_retries_total", engine=url) == 1
        assert metric(m, "router_engine_healthy", engine=url) == 1
        assert srv.router.engines[0].healthy
        assert m["router_failed_requests_total"] == 0
        assert metric(m, "router_requests_total", engine=url, reason="retry") == 0
        assert request(srv.url, "/health")[0] == 200
    finally:
        for sock in (other, retried):
            if sock is not None:
                sock.close()
        srv.stop()

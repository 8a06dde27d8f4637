"""A client that leaves right after ``data: [DONE]`` (as ``bench.client`` does: it stops reading
there and its connection is closed) is not an engine failure. When the client's FIN comes in
the same event-loop turn as the engine's last bytes, the router's final write to the client
(the stream's last chunk) fails with aiohttp's ``ClientConnectionResetError`` ("Cannot write to
closing transport"), an ``aiohttp.ClientConnectionError`` like an engine's: it must not take the
engine out (which ends every other stream it serves) nor send the request to another engine.
The client's connection closing is injected at that moment (the router's server transport is
closed as its FIN closes it); the engine and the router are real."""
from __future__ import annotations

import json
import socket
import time

from engine_min.router import proxy
from tests.engine_min.router.served import (MODEL, STREAM_END, metric, metrics, post_stream,
                                            read_until, request, start_router,
                                            stream_choices, wait_health)


class _Content:
    """An engine stream's body whose end comes after the client's connection closed."""

    def __init__(self, content, request, hook) -> None:
        self._content, self._request, self._hook = content, request, hook

    async def _chunks(self):
        async for chunk in self._content.iter_any():
            yield chunk
        self._request.transport.close()   # the client's FIN: the transport is closing
        self._hook.closed += 1

    def iter_any(self):
        return self._chunks()

    def __getattr__(self, name):
        return getattr(self._content, name)


class _Response:
    def __init__(self, up, content) -> None:
        self._up, self.content = up, content

    def __getattr__(self, name):
        return getattr(self._up, name)


class _ClientLeavesAtTheEnd:
    """The router's ``_relay_stream``; once ``armed``, the next stream's client is gone when
    the engine's stream ends (then disarmed)."""

    def __init__(self, relay) -> None:
        self._relay, self.armed, self.closed = relay, False, 0

    async def __call__(self, request, up, e):
        if self.armed:
            self.armed = False
            up = _Response(up, _Content(up.content, request, self))
        return await self._relay(request, up, e)


def test_a_client_leaving_after_done_does_not_take_the_engine_out(engines):
    eng = engines[0]
    url = f"http://127.0.0.1:{eng.port}"
    # health checks 30 s apart: an engine taken out stays out for the rest of the test
    srv = start_router([url], eng.engine.tokenizer, policy="round-robin", health_interval_s=30.0)
    other = leaving = None
    try:
        wait_health(srv.url)
        hook = _ClientLeavesAtTheEnd(srv.router._relay_stream)
        srv.router._relay_stream = hook
        other = post_stream(srv.port, "Write a long story about a lighthouse keeper.", 64)
        other_got = read_until(other, b"data: {")        # the other stream is under way
        assert other_got.startswith(b"HTTP/1.1 200"), other_got[:200]
        hook.armed = True
        leaving = post_stream(srv.port, "Client leaves after done:", 3)
        got = read_until(leaving, b"data: [DONE]\n\n")
        assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]\n\n" in got, got[-300:]
        assert b'"error"' not in got, got[-300:]
        leaving.close()
        other_got = read_until(other, STREAM_END, other_got)
        assert hook.closed == 1
        # the other stream on the same engine went on to its end
        assert b'"error"' not in other_got, other_got[-400:]
        assert other_got.endswith(STREAM_END), other_got[-400:]
        choices = stream_choices(other_got)
        assert choices[-1]["finish_reason"] == "length", choices[-1]   # all 64 tokens
        assert len("".join(c["text"] for c in choices)) > 64
        time.sleep(0.2)   # a retry sent elsewhere would have been counted by now
        m = metrics(srv.url)
        assert srv.router.engines[0].healthy
        assert metric(m, "router_engine_healthy", engine=url) == 1
        assert m["router_failed_requests_total"] == 0
        assert metric(m, "router_requests_total", engine=url, reason="retry") == 0
        assert metric(m, "router_requests_total", engine=url, reason="round_robin") == 2
        assert metric(m, "router_stale_connection_retries_total", engine=url) == 0
        assert m["router_client_gone_total"] == 1
    finally:
        for sock in (other, leaving):
            if sock is not None:
                sock.close()
        srv.stop()


class _WholeAnswer:
    """An engine's whole answer, read after which the client's connection is closing."""

    def __init__(self, up, request, hook) -> None:
        self._up, self._request, self._hook = up, request, hook

    async def read(self) -> bytes:
        body = await self._up.read()
        self._request.transport.close()   # the client's FIN as the router writes the answer
        self._hook.closed += 1
        return body

    def __getattr__(self, name):
        return getattr(self._up, name)


class _ClientLeavesBeforeTheAnswer:
    """``relay_whole``; once ``armed``, the next answer's client is gone when the router has
    read the engine's answer and writes it (then disarmed)."""

    def __init__(self, relay) -> None:
        self._relay, self.armed, self.closed, self.returned = relay, False, 0, 0

    async def __call__(self, request, up, e, metrics):
        if self.armed:
            self.armed = False
            up = _WholeAnswer(up, request, self)
        resp = await self._relay(request, up, e, metrics)
        self.returned += 1
        return resp


def test_a_client_leaving_as_a_whole_answer_is_written_ends_only_its_request(engines,
                                                                            monkeypatch):
    eng = engines[0]
    url = f"http://127.0.0.1:{eng.port}"
    srv = start_router([url], eng.engine.tokenizer, policy="round-robin", health_interval_s=30.0)
    other = leaving = None
    try:
        wait_health(srv.url)
        assert metrics(srv.url)["router_client_gone_total"] == 0   # exported from the start
        hook = _ClientLeavesBeforeTheAnswer(proxy.relay_whole)
        monkeypatch.setattr(proxy, "relay_whole", hook)
        other = post_stream(srv.port, "Write a long story about a lighthouse keeper.", 64)
        other_got = read_until(other, b"data: {")        # the other stream is under way
        assert other_got.startswith(b"HTTP/1.1 200"), other_got[:200]
        hook.armed = True
        body = json.dumps({"model": MODEL, "prompt": "Client leaves before the answer:",
                           "max_tokens": 3, "ignore_eos": True, "temperature": 0}).encode()
        leaving = socket.create_connection(("127.0.0.1", srv.port), timeout=120)
        leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert read_until(leaving, b"never sent") == b""   # closed, no byte of an answer
        other_got = read_until(other, STREAM_END, other_got)
        assert hook.closed == 1 and hook.returned == 1
        assert b'"error"' not in other_got, other_got[-400:]
        assert other_got.endswith(STREAM_END), other_got[-400:]
        assert stream_choices(other_got)[-1]["finish_reason"] == "length"
        time.sleep(0.2)   # a retry sent elsewhere would have been counted by now
        m = metrics(srv.url)
        assert srv.router.engines[0].healthy
        assert metric(m, "router_engine_healthy", engine=url) == 1
        assert m["router_failed_requests_total"] == 0
        assert m["router_client_gone_total"] == 1
        assert metric(m, "router_requests_total", engine=url, reason="retry") == 0
        assert metric(m, "router_requests_total", engine=url, reason="round_robin") == 2
        # the engine answers the next whole request as before
        status, _, got = request(srv.url, "/v1/completions", body)
        assert status == 200, got
        assert json.loads(got)["choices"][0]["finish_reason"] == "length"
        assert metrics(srv.url)["router_client_gone_total"] == 1
    finally:
        for sock in (other, leaving):
            if sock is not None:
                sock.close()
        srv.stop()

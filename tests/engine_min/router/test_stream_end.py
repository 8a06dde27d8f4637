"""A relayed stream the router cannot finish ends as an engine's stream does at its shutdown
(a chunk with ``finish_reason`` ``"abort"``, an error event, ``data: [DONE]``): the engine
dying mid-stream (a fake engine that sends part of a stream, half an event included, and then
drops the connection) and the router stopping with a stream open. One warning line, no
traceback."""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from engine_min.router.stream_end import SseRelayState
from engine_min.tokenizer import load_tokenizer
from tests.engine_min.router.fake_engine import EVENTS, ID, event as _event, fake_engine
from tests.engine_min.router.served import metric, metrics, request, start_router, wait_health


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


BODY = json.dumps({"model": "fake", "stream": True,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


def _events(body: bytes) -> list:
    out = []
    for ev in body.decode().split("\n\n"):
        if ev.startswith("data: "):
            out.append(ev[6:] if ev[6:] == "[DONE]" else json.loads(ev[6:]))
    return out


def _check_ending(body: bytes, code: str) -> None:
    assert body.startswith(b"".join(EVENTS)), body[:300]
    assert b"PARTIAL" not in body
    events = _events(body)
    assert len(events) == len(EVENTS) + 3, events
    abort, error, done = events[-3:]
    assert abort["id"] == ID and abort["object"] == "chat.completion.chunk"
    assert abort["model"] == "fake" and abort["created"] == 7
    assert abort["choices"][0]["finish_reason"] == "abort"
    assert error["error"]["code"] == code and error["error"]["type"] == "server_error"
    assert done == "[DONE]" and body.endswith(b"data: [DONE]\n\n")


def test_engine_dying_mid_stream_ends_the_clients_stream(tokenizer, caplog):
    eng = fake_engine("cut")
    srv = start_router([eng.url], tokenizer, policy="round-robin")
    try:
        wait_health(srv.url, timeout_s=30)
        with caplog.at_level(logging.INFO):
            status, headers, body = request(srv.url, "/v1/chat/completions", BODY, timeout=30)
        assert status == 200 and headers["Content-Type"] == "text/event-stream"
        _check_ending(body, "engine_failed")
        relayed = len(b"".join(EVENTS))
        # the client is told which engine failed and how far its stream got, in our words
        assert _events(body)[-2]["error"]["message"] == (
            f"The engine {eng.url} failed mid-stream: its stream was cut after "
            f"{len(EVENTS)} events ({relayed} bytes) had been relayed; the request was "
            f"aborted."), _events(body)[-2]
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING
                    and r.name == "engine_min.router" and "mid-stream" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        line = warnings[0].getMessage()
        assert eng.url in line and ID in line
        assert f"{relayed} bytes relayed" in line
        # aiohttp's account of the cut is for the log only
        assert "payload is not completed" in line, line
        assert b"payload" not in body and b"TransferEncoding" not in body, body[-400:]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], \
            [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        m = metrics(srv.url)
        assert m["router_failed_requests_total"] == 1
        assert metric(m, "router_failed_requests_by_code_total", code="engine_failed") == 1
        assert 'router_failed_requests_by_code_total{code="server_shutting_down"}' in m
        assert metric(metrics(srv.url), "router_engine_healthy", engine=eng.url) in (0, 1)
        # bytes went to the client: not retried, on a fresh connection or elsewhere
        assert metric(m, "router_stale_connection_retries_total", engine=eng.url) == 0
        assert metric(m, "router_requests_total", engine=eng.url, reason="retry") == 0
        assert eng.received == ["/v1/chat/completions"]
    finally:
        srv.stop()
        eng.stop()


def test_router_stopping_ends_an_open_stream(tokenizer, caplog):
    eng = fake_engine("hang")
    srv = start_router([eng.url], tokenizer, policy="round-robin")
    srv.router.shutdown_timeout_s = 0.3
    got: list[bytes] = []
    try:
        wait_health(srv.url, timeout_s=30)
        t = threading.Thread(target=lambda: got.append(
            request(srv.url, "/v1/chat/completions", BODY, timeout=30)[2]), daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not srv.router.streams and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)   # the events went out
        with caplog.at_level(logging.INFO, logger="engine_min.router"):
            t0 = time.monotonic()
            srv.stop()
            took = time.monotonic() - t0
        t.join(10)
        assert got, "the client got no answer"
        _check_ending(got[0], "server_shutting_down")
        assert took < 5, took
        lines = [r.getMessage() for r in caplog.records if r.name == "engine_min.router"]
        assert "stopping: 1 request in flight (1 stream); waiting up to 0.3 s" in lines, lines
        # the stream the stop cut is a failed request, as one an engine cut is
        registry = srv.router.metrics.registry
        assert registry.get_sample_value("router_failed_requests_total") == 1
        assert registry.get_sample_value("router_failed_requests_by_code_total",
                                         {"code": "server_shutting_down"}) == 1
        assert registry.get_sample_value("router_failed_requests_by_code_total",
                                         {"code": "engine_failed"}) == 0
    finally:
        eng.stop()


def test_relay_state_passes_whole_events_only():
    st = SseRelayState()
    one, two = EVENTS[1], EVENTS[2]
    assert st.feed(one[:10]) == b""
    assert st.feed(one[10:] + two[:5]) == one
    assert st.request_id == ID and st.bytes_relayed == len(one)
    assert st.feed(two[5:]) == two and st.bytes_relayed == len(one) + len(two)
    assert st.feed(_event({}, "stop")) and st.finished
    # a finished stream cut before [DONE]: no second finishing chunk, the error and [DONE]
    assert _events(st.ending("m", "engine_failed")) == [
        {"error": {"message": "m", "type": "server_error", "param": None,
                   "code": "engine_failed"}}, "[DONE]"]
    # a completion stream: the abort chunk in its shape
    st = SseRelayState()
    st.feed(b'data: {"id":"cmpl-1","object":"text_completion","created":3,"model":"m",'
            b'"choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}\n\n')
    abort = _events(st.ending("m", "x"))[0]
    assert abort["object"] == "text_completion" and abort["choices"][0]["text"] == ""
    assert abort["choices"][0]["finish_reason"] == "abort" and abort["id"] == "cmpl-1"

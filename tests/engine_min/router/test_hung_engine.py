"""Requests in flight to an engine that hangs (``kill -STOP``: it accepts connections and answers
nothing) end once its health checks fail and it is taken out: one that has sent nothing to the
client yet goes to another healthy engine, or gets 503 when there is none; a stream already
started ends with the abort chunk, an ``engine_failed`` error event and ``[DONE]``. The fake
engines here hang their requests while their ``/health`` answers 503."""
from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from engine_min.tokenizer import load_tokenizer
from tests.engine_min.router.fake_engine import EVENTS, completion_body, fake_engine
from tests.engine_min.router.served import metric, metrics, request, start_router, wait_health
from tests.engine_min.router.test_stream_end import BODY, _check_ending, _events

#: the client's wait; without the router ending them these requests would hang past it
CLIENT_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _send(url: str, path: str, body: bytes, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(
        request(url, path, body, timeout=CLIENT_TIMEOUT_S)), daemon=True)
    t.start()
    return t


def _wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_request_waiting_on_a_hung_engine_goes_to_another(tokenizer):
    hung, ok = fake_engine("silent"), fake_engine("ok")
    srv = start_router([hung.url, ok.url], tokenizer, policy="round-robin")
    got: list = []
    try:
        wait_health(srv.url, timeout_s=30)
        _wait_for(lambda: all(e.healthy for e in srv.router.engines))
        t = _send(srv.url, "/v1/chat/completions", BODY, got)
        _wait_for(lambda: hung.received)          # round-robin: the first goes to engine 0
        time.sleep(0.3)
        assert not got and not ok.received        # it waits on the hung engine
        t0 = time.monotonic()
        hung.sick.set()
        t.join(CLIENT_TIMEOUT_S + 5)
        assert got, "no answer"
        status, headers, body = got[0]
        assert status == 200 and headers["Content-Type"] == "text/event-stream"
        assert body.startswith(b"".join(EVENTS)) and body.endswith(b"data: [DONE]\n\n")
        assert _events(body)[-2]["choices"][0]["finish_reason"] == "stop"
        assert time.monotonic() - t0 < 5      # 3 failed checks 0.2 s apart, then the retry
        assert ok.received == ["/v1/chat/completions"]
        m = metrics(srv.url)
        assert metric(m, "router_requests_total", engine=ok.url, reason="retry") == 1
        assert metric(m, "router_engine_healthy", engine=hung.url) == 0
        assert m["router_failed_requests_total"] == 0
        assert srv.router.engines[0].inflight == 0
    finally:
        srv.stop()
        hung.stop()
        ok.stop()


def test_requests_on_the_only_engine_get_503_when_it_hangs(tokenizer):
    hung = fake_engine("silent")
    srv = start_router([hung.url], tokenizer, policy="round-robin")
    stream, whole = [], []
    try:
        wait_health(srv.url, timeout_s=30)
        _wait_for(lambda: srv.router.engines[0].healthy)
        threads = [_send(srv.url, "/v1/chat/completions", BODY, stream),
                   _send(srv.url, "/v1/completions", completion_body(3600), whole)]
        _wait_for(lambda: len(hung.received) == 2)
        hung.sick.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT_S + 5)
        assert stream and whole, "no answer"
        for status, headers, body in (stream[0], whole[0]):
            assert status == 503, (status, body)
            assert headers["Content-Type"].startswith("application/json")
            err = json.loads(body)["error"]
            assert err["code"] == "no_healthy_engine" and err["type"] == "server_error"
            assert err["message"] == "Every engine failed this request."
        m = metrics(srv.url)
        assert m["router_failed_requests_total"] == 2
        assert metric(m, "router_failed_requests_by_code_total", code="no_healthy_engine") == 2
        assert srv.router.engines[0].inflight == 0
    finally:
        srv.stop()
        hung.stop()


def test_a_started_stream_from_an_engine_that_hangs_ends_with_an_error(tokenizer, caplog):
    hung = fake_engine("hang")        # sends EVENTS, then nothing
    srv = start_router([hung.url], tokenizer, policy="round-robin")
    got: list = []
    try:
        wait_health(srv.url, timeout_s=30)
        _wait_for(lambda: srv.router.engines[0].healthy)
        t = _send(srv.url, "/v1/chat/completions", BODY, got)
        _wait_for(lambda: srv.router.streams)
        time.sleep(0.3)                # the events went out
        with caplog.at_level(logging.INFO, logger="engine_min.router"):
            hung.sick.set()
            t.join(CLIENT_TIMEOUT_S + 5)
        assert got, "no answer"
        status, _headers, body = got[0]
        assert status == 200
        _check_ending(body, "engine_failed")
        relayed = len(b"".join(EVENTS))
        assert _events(body)[-2]["error"]["message"] == (
            f"The engine {hung.url} failed mid-stream: its stream was cut after "
            f"{len(EVENTS)} events ({relayed} bytes) had been relayed; the request was "
            f"aborted.")
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("taken out: /health failed 3 times in a row" in x for x in lines), lines
        cut = [x for x in lines if "mid-stream" in x]
        assert len(cut) == 1 and "taken out while the request waited for it" in cut[0], lines
        m = metrics(srv.url)
        assert m["router_failed_requests_total"] == 1
        assert metric(m, "router_failed_requests_by_code_total", code="engine_failed") == 1
    finally:
        srv.stop()
        hung.stop()

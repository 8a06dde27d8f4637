"""The router's shutdown answers every request still in flight when ``--shutdown-timeout-s``
runs out: a non-streamed request gets 503 with an OpenAI error object (code
``server_shutting_down``) instead of a dropped connection, a stream ends with an abort chunk,
the error event and ``[DONE]``; both count in ``router_failed_requests_total``. A request
that finishes within the grace period gets its answer. In-process (``ServerThread.stop``) and
``python -m engine_min route`` stopped by SIGTERM or SIGINT, over a fake engine whose answers
hang. A client leaving a non-streamed request still cancels the engine's."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from aiohttp import web

from engine_min.tokenizer import load_tokenizer
from tests.engine_min.router.fake_engine import EVENTS, completion_body, fake_engine
from tests.engine_min.router.served import (ROOT, free_port, metrics, request, start_router,
                                            wait_health)

SHUTTING_DOWN = {"error": {"message": "The router is shutting down; the request was aborted.",
                           "type": "server_error", "param": None,
                           "code": "server_shutting_down"}}
STREAM_BODY = json.dumps({"model": "fake", "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def _send(url: str, path: str, body: bytes, out: dict, key: str) -> threading.Thread:
    """POST on a thread; ``out[key]`` is (status, headers, body) or the OSError raised."""
    def go() -> None:
        try:
            out[key] = request(url, path, body, timeout=60)
        except OSError as exc:   # the connection dropped without an answer
            out[key] = exc
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _wait_received(eng, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(eng.received) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(eng.received) >= n, eng.received
    time.sleep(0.2)   # the stream's first events went out


def _check_503(got) -> None:
    assert isinstance(got, tuple), f"no answer: {got!r}"
    status, headers, body = got
    assert status == 503 and headers["Content-Type"].startswith("application/json"), got
    assert json.loads(body) == SHUTTING_DOWN


def _check_stream_ended(got) -> None:
    assert isinstance(got, tuple), f"no answer: {got!r}"
    status, _, body = got
    assert status == 200 and body.startswith(b"".join(EVENTS)), body[:300]
    events = [ev[6:] for ev in body.decode().split("\n\n") if ev.startswith("data: ")]
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    assert events[-1] == "[DONE]"


def test_a_stop_answers_a_request_still_in_flight_503(tokenizer, caplog):
    eng = fake_engine("hang")
    srv = start_router([eng.url], tokenizer, policy="round-robin")
    srv.router.shutdown_timeout_s = 1.0
    got: dict = {}
    try:
        wait_health(srv.url, timeout_s=30)
        threads = [_send(srv.url, "/v1/completions", completion_body(3600), got, "slow"),
                   _send(srv.url, "/v1/completions", completion_body(0.3), got, "quick")]
        _wait_received(eng, 2)
        with caplog.at_level(logging.INFO, logger="engine_min.router"):
            t0 = time.monotonic()
            srv.stop()
            took = time.monotonic() - t0
        for t in threads:
            t.join(30)
        _check_503(got.get("slow"))
        # finished within the grace period: its answer, not a 503
        status, _, body = got["quick"]
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "done", got["quick"]
        assert took < 5, f"the stop took {took:.1f} s (grace period 1 s)"
        lines = [r.getMessage() for r in caplog.records if r.name == "engine_min.router"]
        assert "stopping: 2 requests in flight (0 streams); waiting up to 1.0 s" in lines, lines
        assert "stopping: after 1.0 s, ending 0 streams still open and answering 1 request " \
               "503 (server_shutting_down)" in lines, lines
        registry = srv.router.metrics.registry
        assert registry.get_sample_value("router_failed_requests_total") == 1
        assert registry.get_sample_value("router_failed_requests_by_code_total",
                                         {"code": "server_shutting_down"}) == 1
    finally:
        eng.stop()


def test_a_stream_sent_to_another_engine_after_a_cut_is_still_answered_503(tokenizer):
    """A stream cut before its first event is sent to the next engine; still waiting for that
    engine's answer when the grace period is over, it gets the 503 like any request."""
    cut, silent = fake_engine("cut-at-once"), fake_engine("silent")
    srv = start_router([cut.url, silent.url], tokenizer, policy="round-robin")
    srv.router.shutdown_timeout_s = 0.5
    got: dict = {}
    try:
        wait_health(srv.url, timeout_s=30)
        t = _send(srv.url, "/v1/chat/completions", STREAM_BODY, got, "stream")
        _wait_received(cut, 1)
        _wait_received(silent, 1)
        t0 = time.monotonic()
        srv.stop()
        took = time.monotonic() - t0
        t.join(30)
        _check_503(got.get("stream"))
        assert took < 5, f"the stop took {took:.1f} s (grace period 0.5 s)"
        assert srv.router.metrics.registry.get_sample_value(
            "router_failed_requests_by_code_total", {"code": "server_shutting_down"}) == 1
    finally:
        cut.stop()
        silent.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_route_stopped_by_a_signal_answers_every_request_in_flight(sig):
    eng = fake_engine("hang")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_min", "route", "--engines", eng.url, "--port", str(port),
         "--policy", "round-robin", "--shutdown-timeout-s", "1", "--log-level", "info"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal
    url = f"http://127.0.0.1:{port}"
    got: dict = {}
    try:
        wait_health(url, proc, timeout_s=120)
        threads = [_send(url, "/v1/completions", completion_body(3600), got, "slow"),
                   _send(url, "/v1/chat/completions", STREAM_BODY, got, "stream")]
        _wait_received(eng, 2)
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
        log = proc.stderr.read().decode()
        assert rc == 0, log[-2000:]
        assert took < 10, f"the router took {took:.1f} s to exit (timeout 1 s)"
        _check_503(got.get("slow"))
        _check_stream_ended(got.get("stream"))
        assert "stopping: 2 requests in flight (1 stream); waiting up to 1.0 s" in log, log
        assert "stopping: after 1.0 s, ending 1 stream still open and answering 1 request " \
               "503 (server_shutting_down)" in log, log
        assert "Traceback" not in log and "Error handling request" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stderr.close()
        eng.stop()


def test_a_client_leaving_cancels_the_engines_request(tokenizer):
    eng = fake_engine("hang")
    srv = start_router([eng.url], tokenizer, policy="round-robin")
    try:
        wait_health(srv.url, timeout_s=30)
        body = completion_body(3600)
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            _wait_received(eng, 1)
        deadline = time.monotonic() + 10
        while (not eng.cancelled or srv.router.inflight.requests) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.cancelled == ["/v1/completions"], "the engine's request went on"
        assert not srv.router.inflight.requests and srv.router.engines[0].inflight == 0
        assert metrics(srv.url)["router_failed_requests_total"] == 0   # the client left
    finally:
        srv.stop()
        eng.stop()


def test_inflight_ends_only_what_is_not_being_answered():
    """``Inflight`` on its own: past the grace period a request waiting gets the 503, one
    whose answer is being written finishes, one whose client leaves while it is being ended
    is cancelled, and one that comes after gets the 503 at once."""
    from aiohttp.test_utils import make_mocked_request

    from engine_min.router.metrics import RouterMetrics
    from engine_min.router.shutdown import Inflight, answering

    async def waiting(_request):
        await asyncio.sleep(3600)

    async def cleaning_up(_request):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)        # the handler's own cleanup, then the cancellation
            raise

    async def writing(request):
        answering(request)
        await asyncio.sleep(0.3)
        return web.Response(text="written")

    async def main():
        metrics = RouterMetrics()
        inflight = Inflight(metrics)
        tasks = {name: asyncio.create_task(inflight.run(
            make_mocked_request("POST", "/v1/completions"), handler))
            for name, handler in (("waiting", waiting), ("writing", writing),
                                  ("left", cleaning_up))}
        await asyncio.sleep(0.05)
        assert len(inflight.requests) == 3
        drain = asyncio.create_task(inflight.drain(0.1, logging.getLogger("test")))
        await asyncio.sleep(0.15)            # past the grace period: being ended
        tasks["left"].cancel()               # and the client leaves meanwhile
        await drain
        waited = await tasks["waiting"]
        assert waited.status == 503 and json.loads(waited.body) == SHUTTING_DOWN
        assert (await tasks["writing"]).text == "written"
        with pytest.raises(asyncio.CancelledError):
            await tasks["left"]
        late = await inflight.run(make_mocked_request("POST", "/v1/completions"), writing)
        assert late.status == 503 and json.loads(late.body) == SHUTTING_DOWN
        assert not inflight.requests
        return metrics.registry.get_sample_value("router_failed_requests_by_code_total",
                                                 {"code": "server_shutting_down"})
    assert asyncio.run(main()) == 2   # the waiting one and the late one

"""Shutting ``python -m engine_min serve`` down with Ctrl-C, as a subprocess on the real model.

One Ctrl-C with a stream in flight: the log says it waits for 1 request, the stream is aborted
after ``--shutdown-timeout-s`` and ends with finish_reason "abort", an error event and [DONE],
the process exits 0. Two Ctrl-C mid-stream (with the in-process CPU + disk store): exit 130 at
once, one log line, no "terminate called" / SIGABRT, and the disk tier opens again.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Served:
    """``engine_min serve`` in a subprocess, its stderr collected, and one streamed request."""

    def __init__(self, *flags: str):
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine_min", "serve", "--port", str(self.port), "--device",
             "cpu", "--kv-cache-bytes", "48MiB", "--max-model-len", "512", *flags],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal
        self.lines: list[str] = []
        self.stream: list[str] = []
        threading.Thread(target=self._read_stderr, daemon=True).start()
        deadline = time.monotonic() + 90
        while not any("serving " in line for line in self.lines):
            assert self.proc.poll() is None, "\n".join(self.lines)
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            self.lines.append(raw.decode(errors="replace").rstrip())

    def start_stream(self, num_events: int = 3, include_usage: bool = False) -> None:
        """Stream a completion that runs far longer than the test; wait for its first events."""
        req = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
               "stream": True}
        if include_usage:
            req["stream_options"] = {"include_usage": True}
        body = json.dumps(req).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})

        def client() -> None:
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    for line in resp:
                        if line.strip():
                            self.stream.append(line.decode().strip())
            except Exception as exc:  # the stream cut: recorded for the assertions
                self.stream.append(f"client error: {exc!r}")
        threading.Thread(target=client, daemon=True).start()
        deadline = time.monotonic() + 30
        while len(self.stream) < num_events:
            assert time.monotonic() < deadline, self.stream
            time.sleep(0.02)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def test_one_ctrl_c_aborts_a_stream_after_the_grace_period_and_ends_it_with_done():
    srv = _Served("--shutdown-timeout-s", "0.5")
    srv.start_stream()
    srv.proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    assert srv.wait(20) == 0
    assert time.monotonic() - t0 < 10   # 0.5 s grace, then one step and the engine thread stop
    time.sleep(0.2)
    log = "\n".join(srv.lines)
    assert "shutting down: waiting up to 0.5 s for 1 request in flight" in log
    assert "aborting 1 request still running after 0.5 s" in log
    assert "Traceback" not in log and "ERROR" not in log
    assert srv.stream[-1] == "data: [DONE]"
    final = json.loads(srv.stream[-3].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "abort"
    error = json.loads(srv.stream[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    # every event before the cut is a token of the stream
    for line in srv.stream[:-3]:
        assert json.loads(line.removeprefix("data: "))["choices"][0]["finish_reason"] is None


def test_second_ctrl_c_exits_at_once_without_abort_and_the_disk_tier_reopens(tmp_path):
    disk = tmp_path / "disk"
    srv = _Served("--kvstore-cpu-bytes", "32MiB", "--kvstore-disk-path", str(disk),
                  "--shutdown-timeout-s", "60")
    srv.start_stream()
    srv.proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    srv.proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    rc = srv.wait(10)
    assert time.monotonic() - t0 < 3
    assert rc == 130, rc   # not -6 (SIGABRT) nor 134
    time.sleep(0.2)
    log = "\n".join(srv.lines)
    assert "terminate called" not in log and "Traceback" not in log, log
    assert "SIGINT again: exiting now" in log
    from kvstore.tiers.disk import DiskTier
    tier = DiskTier(str(disk), 64 * 2**20)   # the lock died with the process; index rebuilt
    try:
        tier.check_integrity()
    finally:
        tier.close()


def test_drain_answers_new_requests_503_and_cuts_a_non_streamed_request_with_503():
    """In process: a non-streamed request in flight when the grace period ends gets 503
    ``server_shutting_down``; once draining, a new request and ``/health`` get 503 too."""
    import asyncio
    import urllib.error

    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine
    from engine_min.serve.run import drain
    from engine_min.serve.server import SERVING_KEY, ServerThread, create_app
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256))
    app = create_app(engine, "m")
    serving = app[SERVING_KEY]

    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
    with ServerThread(app) as srv:
        answers: list = []
        client = threading.Thread(target=lambda: answers.append(post(
            {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True})))
        client.start()
        deadline = time.monotonic() + 30
        while serving.num_inflight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        asyncio.run_coroutine_threadsafe(drain(serving, 0.1), srv._loop).result(30)
        client.join(30)
        status, body = answers[0]
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
        assert serving.num_inflight == 0
        status, body = post({"prompt": "hi", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(srv.url + "/health", timeout=10)
        assert health.value.code == 503


def test_a_stream_cut_by_shutdown_still_sends_its_usage_when_asked():
    srv = _Served("--shutdown-timeout-s", "0.3")
    srv.start_stream(num_events=4, include_usage=True)
    srv.proc.send_signal(signal.SIGINT)
    assert srv.wait(20) == 0
    time.sleep(0.2)
    assert srv.stream[-1] == "data: [DONE]"
    abort, usage, error = (json.loads(x.removeprefix("data: ")) for x in srv.stream[-4:-1])
    assert abort["choices"][0]["finish_reason"] == "abort"
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 4
    generated = len(srv.stream) - 4          # one token per event before the cut
    assert usage["usage"]["completion_tokens"] >= generated >= 4
    assert error["error"]["code"] == "server_shutting_down"

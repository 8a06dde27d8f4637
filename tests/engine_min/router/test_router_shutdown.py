"""Ctrl-C or SIGTERM on ``python -m engine_min route`` with a stream in flight: the router logs
that it is stopping (requests and streams in flight), ends the stream after
``--shutdown-timeout-s`` as an engine does at its shutdown (a chunk with finish_reason
"abort", an error event, ``[DONE]``) and exits 0, instead of aiohttp's default 60 s wait."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.engine_min.router.served import MODEL, ROOT, free_port, wait_health


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_ends_a_relayed_stream_after_the_shutdown_timeout(engines, sig):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_min", "route", "--engines",
         ",".join(e.url for e in engines), "--port", str(port), "--shutdown-timeout-s", "1",
         "--log-level", "info"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc, timeout_s=120)
        body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400,
                           "ignore_eos": True, "stream": True}).encode()
        events: list[bytes] = []
        first = threading.Event()

        def stream() -> None:
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    for line in r:
                        if line.startswith(b"data: "):
                            events.append(line)
                            first.set()
            except OSError:
                pass  # the router cut the connection
            first.set()
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first.wait(60) and events, "no event came through the router"
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(30)
        took = time.monotonic() - t0
        t.join(30)
        log = proc.stderr.read().decode()
        assert rc == 0, log[-2000:]
        assert took < 10, f"router took {took:.1f} s to exit (timeout 1 s)"
        assert "stopping: 1 request in flight (1 stream); waiting up to 1.0 s" in log, log
        assert "stopping: after 1.0 s, ending 1 stream still open and answering 0 requests " \
               "503 (server_shutting_down)" in log, log
        assert "Error handling request" not in log and "Traceback" not in log, log
        # ended before its 400 tokens: an abort chunk, the error event, [DONE]
        assert not any(b'"length"' in e for e in events) and len(events) < 400
        assert events[-1] == b"data: [DONE]\n", events[-3:]
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "abort"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        proc.stderr.close()


def test_a_port_in_use_is_refused_before_the_tokenizer_loads(monkeypatch, capsys):
    from engine_min.cli import main as cli_main
    from engine_min.router import cli as router_cli

    def no_load(*args, **kwargs):
        raise AssertionError("the tokenizer loaded before the port was checked")
    monkeypatch.setattr(router_cli, "load_while_waiting", no_load)
    import socket
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        t0 = time.monotonic()
        assert cli_main(["route", "--engines", "http://127.0.0.1:1", "--port", str(port)]) == 2
        assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Address already in use" in err

"""Ctrl-C on ``python -m engine_min route`` with a stream in flight: the router cuts the stream
after ``--shutdown-timeout-s`` and exits 0, instead of aiohttp's default 60 s wait."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from tests.engine_min.router.served import MODEL, ROOT, free_port, wait_health


def test_ctrl_c_cuts_a_relayed_stream_after_the_shutdown_timeout(engines):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_min", "route", "--engines",
         ",".join(e.url for e in engines), "--port", str(port), "--shutdown-timeout-s", "1",
         "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
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
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        took = time.monotonic() - t0
        t.join(30)
        assert rc == 0, proc.stderr.read().decode()[-2000:]
        assert took < 10, f"router took {took:.1f} s to exit (timeout 1 s)"
        # cut before its 400 tokens: no event says the stream ran to its length
        assert not any(b'"length"' in e for e in events) and len(events) < 400
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

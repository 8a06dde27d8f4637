"""The router's start: one engine given twice (the same URL, host names of one address, or two
URLs that reach one engine process) is refused with a one-line error; engines that do not
answer are reported within ``--startup-timeout-s``, without waiting for the tokenizer."""
from __future__ import annotations

import threading
import time

import pytest

from engine_min.cli import main as cli_main
from engine_min.router.engine_urls import (check_distinct_addresses, check_distinct_engines,
                                           parse_engine_urls)
from tests.engine_min.router.served import Relay, free_port


def test_one_engine_by_two_urls_is_refused():
    for text in ("http://127.0.0.1:18001,http://127.0.0.1:18001/",
                 "http://127.0.0.1,http://127.0.0.1:80", "HTTP://LocalHost:5,http://localhost:5",
                 "https://h.example:443,https://h.example"):
        with pytest.raises(ValueError, match="listed twice"):
            parse_engine_urls(text)
    urls = parse_engine_urls("http://127.0.0.1:18001,http://localhost:18001")
    with pytest.raises(ValueError) as err:
        check_distinct_addresses(urls)
    assert str(err.value) == ("--engines: http://127.0.0.1:18001 and http://localhost:18001 "
                              "are the same engine (both 127.0.0.1 port 18001)")
    # other ports, other schemes, names that do not resolve: not the same
    check_distinct_addresses(["http://127.0.0.1:18001", "http://localhost:18002",
                              "https://localhost:18001", "http://no-such-host.invalid:18001"])


def test_two_urls_of_one_engine_process_are_refused(engines, capsys):
    eng = engines[0]
    relay = Relay(eng.port)        # another address of the same engine process
    try:
        check_distinct_engines([e.url for e in engines])    # two processes' logs: distinct
        t0 = time.monotonic()
        assert cli_main(["route", "--engines", f"{eng.url},{relay.url}",
                         "--port", str(free_port()), "--startup-timeout-s", "30"]) == 2
        took = time.monotonic() - t0
        err = capsys.readouterr().err
        assert err.startswith(f"error: --engines: {eng.url} and {relay.url} are the same "
                              f"engine (the same KV events epoch "), err
        assert err.count("\n") == 1
        assert took < 30, took
    finally:
        relay.close()


def test_a_refused_engine_is_reported_within_the_startup_timeout(monkeypatch, capsys):
    """With the real tokenizer (it takes seconds to load) and with one that never finishes
    loading: the error comes at the timeout, not after the tokenizer."""
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    assert cli_main(["route", "--engines", dead, "--startup-timeout-s", "3"]) == 2
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert err.startswith(f"error: engine(s) not answering /health after 3 s: {dead} (")
    assert 3 <= took < 6, took

    import engine_min.tokenizer
    release = threading.Event()

    def slow_load(model, reader=None):
        release.wait(60)
        raise OSError("released")
    monkeypatch.setattr(engine_min.tokenizer, "load_tokenizer", slow_load)
    try:
        t0 = time.monotonic()
        assert cli_main(["route", "--engines", dead, "--startup-timeout-s", "1"]) == 2
        took = time.monotonic() - t0
        assert "not answering /health after 1 s" in capsys.readouterr().err
        assert took < 4, took
    finally:
        release.set()


def test_a_malformed_engines_list_exits_at_once():
    """``--engines 127.0.0.1:18001`` (no scheme): exit 2 right after the one-line error, before
    torch is imported (its import and teardown took seconds, tens under load)."""
    import subprocess
    import sys

    from tests.engine_min.router.served import ROOT
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "engine_min", "route",
                           "--port", str(free_port()), "--engines", "127.0.0.1:18001"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    errors = [x for x in lines if not x.startswith("import time:")]
    assert errors == ["error: --engines: bad URL '127.0.0.1:18001' (expected http://host:port)"]
    imported = {x.rsplit("|", 1)[1].strip() for x in lines if x.startswith("import time:")}
    assert "aiohttp" in imported           # the parser's imports are there: the probe works
    assert "torch" not in imported and "engine_min.weights" not in imported
    assert took < 15, took

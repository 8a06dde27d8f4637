"""Small command-line faults: Ctrl-C during ``generate`` is one line and exit 130;
``serve --max-model-len`` above what the model or the KV pool allows is refused (exit 2, both
limits named) and the help states the real default; the router refuses non-positive numeric
flags and logs an engine taken out with host:port and the reason in words."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from engine_min.cli import build_parser, main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_sigint() -> None:
    """In the child: SIGINT as a terminal delivers it (a test run in a background job would
    hand the child an ignored SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_generate_is_one_line_and_exit_130():
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_min", "generate", "--prompt", "Once upon a time",
         "--max-tokens", "3000", "--device", "cpu"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, preexec_fn=_default_sigint)
    time.sleep(6)      # loading the model or generating: either is interrupted the same way
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.decode() == "interrupted\n"
    assert out == b""


def test_ctrl_c_while_the_router_waits_for_its_engines_is_one_line_and_exit_130():
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_min", "route", "--engines",
         f"http://127.0.0.1:{_free_port()}", "--startup-timeout-s", "60", "--log-level",
         "warning"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=_default_sigint)
    time.sleep(3)      # loading the tokenizer or waiting for the engine
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.decode() == "interrupted\n"


def test_ctrl_c_while_the_parser_imports_the_commands_is_one_line_and_exit_130(
        monkeypatch, capsys):
    """``build_parser`` imports the commands' modules (seconds on a loaded host): a Ctrl-C
    there ends as one during the command does, not with a traceback and death by SIGINT."""
    import engine_min.cli as cli

    def interrupted_import():
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "build_parser", interrupted_import)
    assert cli.main(["route", "--engines", "http://127.0.0.1:9"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_serve_refuses_max_model_len_above_the_models_context_or_the_pool(capsys):
    base = ["serve", "--port", "0", "--device", "cpu", "--kv-cache-bytes", "16MiB",
            "--log-level", "warning"]
    assert cli_main(base + ["--max-model-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert ("error: --max-model-len 100000 is more than this engine can serve: the model's "
            "context is 8192 tokens (largest allowed: 336)") in err
    assert cli_main(base + ["--max-model-len", "4000"]) == 2
    err = capsys.readouterr().err   # 16 MiB holds 22 blocks of 16 tokens, block 0 the null one
    assert ("the KV pool (15.5 MiB, --kv-cache-bytes) holds 336 tokens; raise "
            "--kv-cache-bytes or lower --max-model-len (largest allowed: 336)") in err


def test_serve_help_states_the_real_default_max_model_len():
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"]
                         .format_help().split())
    assert "the model's context or what the KV pool holds, whichever is smaller: 5808" \
        in help_text


@pytest.mark.parametrize("flag, value, why", [
    ("--startup-timeout-s", "-1", "must be a number of seconds > 0, got -1"),
    ("--startup-timeout-s", "0", "must be a number of seconds > 0, got 0"),
    ("--health-interval-s", "nan", "must be a number of seconds > 0, got nan"),
    ("--health-interval-s", "soon", "not a number of seconds > 0: 'soon'"),
    ("--kvstore-lookup-timeout-ms", "-5", "must be a number of ms > 0, got -5"),
    ("--min-hit-fraction", "1.5", "must be a fraction in [0, 1], got 1.5"),
    ("--max-load-gap", "-1", "must be an integer >= 0, got -1"),
    ("--port", "70000", "must be a port in 0..65535, got 70000"),
])
def test_router_refuses_bad_numeric_flags(flag, value, why, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["route", "--engines", "http://127.0.0.1:1", flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: {why}" in capsys.readouterr().err


def test_router_logs_an_engine_taken_out_with_host_port_and_reason(caplog):
    from engine_min.router.metrics import RouterMetrics
    from engine_min.router.reasons import describe_error
    from engine_min.router.subscriber import Engine
    port = _free_port()   # nothing listens there: the connection is refused

    async def refused() -> BaseException:
        async with aiohttp.ClientSession() as session:
            try:
                await session.get(f"http://127.0.0.1:{port}/health")
            except aiohttp.ClientError as exc:
                return exc
        raise AssertionError("the connection was not refused")
    reason = describe_error(asyncio.run(refused()))
    assert reason == f"cannot connect to 127.0.0.1:{port}: connection refused"
    assert describe_error(asyncio.TimeoutError()) == "timed out"
    assert describe_error(aiohttp.ServerDisconnectedError()) == \
        "the engine closed the connection"
    engine = Engine(f"http://127.0.0.1:{port}", 0, RouterMetrics())
    engine.healthy = True
    with caplog.at_level(logging.WARNING, logger="engine_min.router"):
        engine.mark_down(f"/health: {reason}")
    assert caplog.messages == [f"engine 127.0.0.1:{port} taken out: /health: {reason}"]
    assert "ConnectionKey" not in caplog.text


@pytest.mark.parametrize("argv, words", [
    (["--max-num-batched-tokens", "1"], "max_num_batched_tokens (1) must be at least the block "
     "size (16)"),
    (["--block-size", "32", "--max-num-batched-tokens", "16"],
     "max_num_batched_tokens (16) must be at least the block size (32)"),
    (["--kvstore-chunk-size", "100"], "--kvstore-chunk-size needs a store"),
    (["--kvstore-chunk-size", "0"], "--kvstore-chunk-size needs a store"),
    (["--kvstore-auth-token", "t0k"], "--kvstore-auth-token needs --kvstore-url"),
])
def test_serve_refuses_flags_that_would_do_nothing_or_crawl(argv, words, capsys, monkeypatch):
    monkeypatch.delenv("KVSTORE_AUTH_TOKEN", raising=False)
    base = ["serve", "--port", "0", "--device", "cpu", "--kv-cache-bytes", "16MiB",
            "--log-level", "warning"]
    assert cli_main(base + argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err

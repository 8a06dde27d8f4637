"""A real ``kvstore serve`` process for client tests: a free loopback port, and the daemon
started on it (tiny CPU tier of 4 MiB in 256-byte pages), returned once it listens."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int, sock: str | None, extra: tuple[str, ...] | list[str] = ()
          ) -> subprocess.Popen:
    """``kvstore serve`` on ``port`` (and the Unix socket ``sock`` when given) with ``extra``
    flags, once it prints that it listens.

    Raises:
        AssertionError: it did not start (its stderr's tail in the message).
    """
    args = [sys.executable, "-m", "kvstore", "serve", "--host", "127.0.0.1", "--port",
            str(port), "--cpu-bytes", "4MiB", "--page-bytes", "256", "--log-level", "warning",
            *(["--unix-socket", sock] if sock else []), *extra]
    with tempfile.TemporaryFile() as err:   # (a file: a pipe nobody reads could fill)
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = proc.stdout.readline().decode()
        if "listening on" not in line:
            proc.wait(30)
            err.seek(0)
            raise AssertionError(f"kvstore serve on port {port} did not start: {line!r}; "
                                 f"stderr: {err.read().decode(errors='replace')[-2000:]}")
    return proc


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    """Signal ``proc`` (SIGTERM) unless it has exited, and wait for it (30 s)."""
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(30)

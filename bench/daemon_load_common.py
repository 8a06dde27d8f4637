"""What every phase of ``bench.daemon_load`` shares: the real-model-sized chunk layout, a pool
of chunks, the ``kvstore serve`` process under test, and concurrent client rounds."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from kvstore.layout import KVLayout

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", chunk_size=256)
CHUNK_BYTES = LAYOUT.chunk_bytes  # 5,898,240


class Daemon:
    """``python -m kvstore serve`` on a free loopback port (stopped with SIGTERM), and on the
    Unix socket ``unix_socket`` too when given (``--unix-socket``: the same-host path)."""

    def __init__(self, cpu_bytes: str, log_path: Path, unix_socket: str | None = None):
        self.log = open(log_path, "ab")
        self.unix_socket = unix_socket
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--port", "0", "--cpu-bytes", cpu_bytes,
             "--policy", "lru", "--log-level", "warning", "--max-batch-keys", "256"]
            + (["--unix-socket", unix_socket] if unix_socket else []),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self.proc.stdout.readline().decode()
        if "listening on" not in line:
            raise RuntimeError(f"kvstore serve did not start; see {log_path}")
        self.url = line.strip().rsplit(" ", 1)[-1]
        self.ps = psutil.Process(self.proc.pid)

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        self.log.close()
        return rc


def chunk_pool(n: int) -> list[torch.Tensor]:
    """``n`` random fp16 chunks of ``LAYOUT.shape()`` ([30, 2, 256, 3, 64]), seeded."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(LAYOUT.shape(), generator=g).to(torch.float16) for _ in range(n)]


async def run_clients(num_clients: int, rounds: int, op) -> float:
    """Run ``op(client_idx, round)`` rounds on each client concurrently; returns seconds."""
    async def one(c: int) -> None:
        for r in range(rounds):
            await op(c, r)
    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in range(num_clients)))
    return time.perf_counter() - t0

"""The Redis baseline of ``bench.daemon_load``: ``redis-server`` on loopback and the same
chunks written and read with redis-py's asyncio client (MSET/MGET of a batch per round trip)."""
from __future__ import annotations

import socket
import subprocess
import time

import torch

from bench.daemon_load_common import CHUNK_BYTES, run_clients
from bench.servers import free_port


class Redis:
    """``redis-server`` on a free port without persistence, or None if it is not installed."""

    def __init__(self, workdir: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir, "--proto-max-bulk-len", "1gb",
             "--client-query-buffer-limit", "1gb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def bench_redis(port: int, clients: int, rounds: int, batch: int,
                      tensors: list[torch.Tensor]) -> tuple[float, float]:
    """(MSET GB/s, MGET GB/s) of ``clients`` concurrent clients doing ``rounds`` batches of
    ``batch`` chunk-sized values each, against the ``redis-server`` on ``port``."""
    import redis.asyncio as aredis
    vals = [t.view(torch.uint8).reshape(-1).numpy().tobytes() for t in tensors]
    r = aredis.Redis(host="127.0.0.1", port=port, max_connections=max(clients, 8))

    def names(ci, rr):
        i = (ci * rounds + rr) * batch
        return [f"k{clients}:{i + j}" for j in range(batch)]

    async def put(ci, rr):
        await r.mset({k: vals[j % len(vals)] for j, k in enumerate(names(ci, rr))})

    async def get(ci, rr):
        got = await r.mget(names(ci, rr))
        assert all(len(g) == CHUNK_BYTES for g in got)
    try:
        total = clients * rounds * batch * CHUNK_BYTES
        await run_clients(clients, rounds, put)  # warm-up, as for kvstore
        await run_clients(clients, rounds, get)
        await r.flushall()
        t_put = await run_clients(clients, rounds, put)
        t_get = await run_clients(clients, rounds, get)
        await r.flushall()
    finally:
        await r.aclose()
    return total / t_put / 1e9, total / t_get / 1e9

"""The Redis baseline of ``bench.daemon_load``: ``redis-server`` on loopback and the same
chunks written and read with redis-py's asyncio client (MSET/MGET of a batch per round trip)."""
from __future__ import annotations

import torch

from bench.daemon_load_common import CHUNK_BYTES, run_clients
from bench.redis_servers import RedisServer


class Redis(RedisServer):
    """``redis-server`` on a free port without persistence, started on construction, with a
    1 GiB query buffer (a batch of MSET values arrives in one command).

    Raises:
        RedisNotInstalled: no ``redis-server`` on ``PATH``.
        RuntimeError: it did not start (the message has its log tail).
    """

    def __init__(self, workdir: str):
        super().__init__(workdir, extra_args=("--client-query-buffer-limit", "1gb"))
        self.start()


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

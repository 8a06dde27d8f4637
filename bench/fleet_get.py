"""Get throughput of the remote tier against redis-py's own, on the same values: ``bench.fleet``'s
``remote_get_gbps`` and ``redis_raw_get_gbps``.

Both read the same keys (a document's chunks, as host 1 wrote them) from the same masters:

* ``RemoteTier.get(keys, layout)``: what a daemon does on a remote hit (per-node pipelines
  sent in parallel, then every value's header, key, layout and checksum checked);
* raw: one ``GET`` pipeline per node on a plain ``redis.Redis`` of that node, the nodes in
  parallel threads, values taken as received (no checks): the floor of any Redis client here.

Throughput is value bytes (header included, the same count for both) over the call's wall
time, in GB/s (1e9 bytes). The two alternate (which goes first too), so a busy host skews
them alike; a first call of each (connections opened) is not counted.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import redis

from kvstore.keys import ChunkKey, Namespace
from kvstore.tiers.remote import RemoteTier


class RawGetter:
    """Pipelined ``GET`` of raw keys, one pipeline per master, masters in parallel.

    Args:
        tier: the remote tier whose routing (``tier.nodes.node_of``) names each key's master.
    """

    def __init__(self, tier: RemoteTier) -> None:
        self._tier = tier
        self._clients: dict[str, redis.Redis] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="fleet-raw-get")

    def _client(self, node: str) -> redis.Redis:
        c = self._clients.get(node)
        if c is None:
            host, port = node.rsplit(":", 1)
            ep = self._tier.endpoint
            c = self._clients[node] = redis.Redis(host=host, port=int(port), username=ep.username
                                                  or None, password=ep.password, ssl=ep.tls)
        return c

    @staticmethod
    def _pipe(client: redis.Redis, rkeys: list[bytes]) -> list:
        pipe = client.pipeline(transaction=False)
        for rk in rkeys:
            pipe.get(rk)
        return pipe.execute()

    def get(self, rkeys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``rkeys`` (None where absent), in order."""
        groups: dict[str, list[int]] = {}
        for i, rk in enumerate(rkeys):
            groups.setdefault(self._tier.nodes.node_of(rk), []).append(i)
        futs = {node: self._pool.submit(self._pipe, self._client(node), [rkeys[i] for i in idx])
                for node, idx in groups.items()}
        out: list = [None] * len(rkeys)
        for node, idx in groups.items():
            for i, v in zip(idx, futs[node].result()):
                out[i] = v
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self._clients.values():
            c.close()


def _timed(fn, *args):
    """(``fn(*args)``, its wall time in seconds)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def measure_get_throughput(url: str, ns: Namespace, docs: Sequence[Sequence[int]],
                           reps: int = 5, key_prefix: str = "kvstore") -> dict:
    """Median GB/s of ``RemoteTier.get`` and of raw pipelined GETs over the full chunks of each
    document in ``docs`` (token ids; their chunks must be in Redis under ``key_prefix``).

    Returns:
        ``{"remote_get_gbps", "redis_raw_get_gbps", "remote_get_vs_raw", "bytes_per_get",
        "chunks_per_get", "chunk_value_bytes", "remote_get_runs_s", "raw_get_runs_s"}``.

    Raises:
        RuntimeError: a chunk was missing or failed a check (the figures would mean nothing).
    """
    tier = RemoteTier(url, key_prefix=key_prefix, timeout_s=5.0)
    raw = RawGetter(tier)
    tier_s, raw_s, nbytes = [], [], []
    try:
        for d, doc in enumerate(docs):
            keys: list[ChunkKey] = ns.chunk_keys(doc)
            rkeys = [tier.redis_key(k) for k in keys]
            if d == 0:  # warm-up, not counted: both open their connections to every master
                raw.get(rkeys)
                tier.get(keys, ns.layout)
            for rep in range(reps):
                if rep % 2 == 0:
                    values, t_raw = _timed(raw.get, rkeys)
                    got, t_tier = _timed(tier.get, keys, ns.layout)
                else:
                    got, t_tier = _timed(tier.get, keys, ns.layout)
                    values, t_raw = _timed(raw.get, rkeys)
                raw_s.append(t_raw)
                tier_s.append(t_tier)
                if any(v is None for v in values) or any(g is None for g in got):
                    raise RuntimeError(f"{sum(g is None for g in got)} of {len(keys)} chunks "
                                       f"missing or invalid in Redis")
                nbytes.append(sum(len(v) for v in values))
    finally:
        raw.close()
        tier.close()
    b = statistics.median(nbytes)
    t_tier, t_raw = statistics.median(tier_s), statistics.median(raw_s)
    return {"remote_get_gbps": b / t_tier / 1e9, "redis_raw_get_gbps": b / t_raw / 1e9,
            "remote_get_vs_raw": t_raw / t_tier, "bytes_per_get": int(b),
            "chunks_per_get": len(ns.chunk_keys(docs[0])),
            "chunk_value_bytes": int(b // max(1, len(ns.chunk_keys(docs[0])))),
            "remote_get_runs_s": tier_s, "raw_get_runs_s": raw_s}

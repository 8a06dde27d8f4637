"""The soak phase of ``bench.daemon_load``: many clients mixing lookup/get/put over a key
universe 10x the daemon's CPU tier; errors, latency, server RSS and /metrics consistency."""
from __future__ import annotations

import asyncio
import random
import sys
import time

import torch

from bench.daemon_load_common import CHUNK_BYTES, LAYOUT, Daemon
from kvstore.daemon.client import AsyncKVStoreClient
from kvstore.keys import Namespace


def _metric_sum(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                total += s.value
    return total


async def soak(url: str, daemon: Daemon, capacity: int, seconds: float, clients: int,
               tensors: list[torch.Tensor]) -> dict:
    """16 clients: pick a prompt (4 chained chunks) from a universe 10x the CPU capacity,
    lookup it, get the hit prefix, put the missing tail."""
    ns = Namespace("bench-soak", LAYOUT)
    prompt_chunks = 4
    num_prompts = max(1, 10 * capacity // CHUNK_BYTES // prompt_chunks)
    c = AsyncKVStoreClient(url, timeout_s=60, pool_size=clients)
    lat: list[float] = []
    counts = {"errors": 0, "lookups": 0, "get_chunks": 0, "get_hits": 0, "puts": 0}
    stop_at = time.monotonic() + seconds
    rss_peak = [daemon.rss()]

    def keys_of(p: int):
        return ns.chunk_keys(list(range(p * 100_000, p * 100_000 + prompt_chunks * 256)))

    async def one(ci: int) -> None:
        r = random.Random(ci)
        while time.monotonic() < stop_at:
            # half the picks uniform over the 10x universe (misses, puts, evictions), half
            # Pareto-skewed (hot shared prefixes that hit)
            p = r.randrange(num_prompts) if r.random() < 0.5 else \
                int(r.paretovariate(1.2)) % num_prompts
            keys = keys_of(p)
            try:
                t0 = time.perf_counter()
                res = await c.lookup_keys(ns, keys)
                counts["lookups"] += 1
                lat.append(time.perf_counter() - t0)
                n = res.num_hit_chunks
                if n:
                    t0 = time.perf_counter()
                    got = await c.get_chunks(ns, keys[:n])
                    lat.append(time.perf_counter() - t0)
                    counts["get_chunks"] += n
                    counts["get_hits"] += sum(g is not None for g in got)
                if n < prompt_chunks:
                    t0 = time.perf_counter()
                    await c.put_chunks(ns, keys[n:], [tensors[(p + i) % len(tensors)]
                                                      for i in range(n, prompt_chunks)])
                    lat.append(time.perf_counter() - t0)
                    counts["puts"] += 1
            except Exception as e:  # noqa: BLE001 - counted and reported
                counts["errors"] += 1
                print(f"soak error: {e!r}", file=sys.stderr)

    async def sample_rss() -> None:
        while time.monotonic() < stop_at:
            rss_peak[0] = max(rss_peak[0], daemon.rss())
            await asyncio.sleep(0.2)
    try:
        await asyncio.gather(sample_rss(), *(one(i) for i in range(clients)))
        text = await c.metrics_text()
        server = (await c.stats())["server"]
    finally:
        await c.close()
    lat.sort()
    lookups = _metric_sum(text, "kvstore_lookups_total")
    hits = _metric_sum(text, "kvstore_hits_total")
    misses = _metric_sum(text, "kvstore_misses_total")
    consistent = (lookups == counts["lookups"] and hits == counts["get_hits"]
                  and hits + misses == counts["get_chunks"])
    return {"soak_s": seconds, "soak_clients": clients, "soak_errors": counts["errors"],
            "soak_ops": len(lat), "soak_p50_s": lat[len(lat) // 2] if lat else None,
            "soak_p99_s": lat[int(len(lat) * 0.99)] if lat else None,
            "soak_lookups": counts["lookups"], "soak_get_chunks": counts["get_chunks"],
            "soak_puts": counts["puts"],
            "soak_metrics_lookups": lookups, "soak_metrics_hits": hits,
            "soak_metrics_misses": misses, "soak_metrics_consistent": consistent,
            "soak_rss_peak_bytes": rss_peak[0], "soak_universe_prompts": num_prompts,
            "soak_max_inflight_bytes": server.get("max_inflight_bytes"),
            "soak_inflight_bytes_peak": server.get("inflight_bytes_peak")}

"""Load test of ``kvstore serve`` on loopback, against Redis and memcpy, plus a soak.

    python -m bench.daemon_load [--quick] [--soak-s 60] [--json PATH] [--shm-only]

Chunks are real-model-sized: SmolLM2-135M, 30 layers x 2 x 256 tokens x 3 KV heads x 64 dims
fp16 = 5,898,240 bytes. Phases:

1. memcpy: one thread's numpy copy of the same chunks as the same-host phase's get and put
   (``bench.daemon_load_shm``: from and to memory as large as theirs), GB/s, measured in that
   phase (6), alternating with it; two threads' and a cache-resident copy's figures too.
2. kvstore: batched put and get (``--batch`` chunks per round trip) with 1 and 8 concurrent
   clients (asyncio tasks sharing one pooled ``AsyncKVStoreClient``), GB/s of payload.
3. Redis (``redis-server`` started here on a free port, no persistence): the same values with
   redis-py's asyncio client, MSET/MGET of ``--batch`` values per round trip, 1 and 8 clients.
   Phases 2 and 3 alternate, 3 repetitions (2 with ``--quick``): GB/s figures are medians and
   each ratio is the median of the per-repetition ratios.
4. lookup32: round trip of a batched lookup of a 32-chunk prompt (median and p99 of 300).
5. soak: 16 clients mixing lookup/get/put over a key universe 10x the CPU tier's capacity;
   errors, p99 latency, server RSS vs capacity, and /metrics consistency (the store's lookup,
   hit and miss counters equal the clients' own counts). RSS is measured as the peak (sampled
   every 0.2 s) minus the daemon's RSS at idle just after start, over ``--cpu-bytes``: the
   CPU arena is faulted in as it fills (up to 1.0x), plus payload buffers in flight (at most
   the server's ``--max-inflight-bytes``, auto = cpu-bytes / 8 but >= 64 MiB, recorded as
   ``soak_max_inflight_bytes``) plus up to 2 MiB of socket read-ahead per connection.
6. same host (``bench.daemon_load_shm``): get and put over the daemon's Unix socket with its
   arena mapped read-only (``shm_get_gbps``, ``shm_put_gbps``, ``_8c`` for 8 clients) against
   memcpy of the same chunks in the same run, and a 32-chunk lookup (``unix_lookup32_ms``).
   The HTTP figures above stay HTTP (the daemon's socket is not used by them).
   ``--shm-only`` runs this phase alone (memcpy alternating with it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.arg_checks import float_above, int_at_least
from bench.daemon_load_common import CHUNK_BYTES, LAYOUT, Daemon, chunk_pool, run_clients
from bench.daemon_load_redis import Redis, bench_redis
from bench.daemon_load_shm import shm_phase
from bench.daemon_load_soak import soak
from kvstore.daemon.client import AsyncKVStoreClient, KVStoreClient
from kvstore.keys import Namespace
from bench.outputs import output_file


async def bench_kvstore(url: str, clients: int, rounds: int, batch: int,
                        tensors: list[torch.Tensor], tag: str) -> tuple[float, float]:
    """(put GB/s, get GB/s) of ``clients`` concurrent clients doing ``rounds`` batches each."""
    ns = Namespace(f"bench-{tag}-{clients}", LAYOUT)
    keys = ns.chunk_keys(list(range(clients * rounds * batch * LAYOUT.chunk_size)))
    c = AsyncKVStoreClient(url, timeout_s=120, pool_size=max(clients, 8))

    def batch_of(ci: int, r: int):
        i = (ci * rounds + r) * batch
        return keys[i:i + batch], [tensors[(i + j) % len(tensors)] for j in range(batch)]

    async def put(ci, r):
        ks, kvs = batch_of(ci, r)
        assert await c.put_chunks(ns, ks, kvs) == batch

    async def get(ci, r):
        ks, _ = batch_of(ci, r)
        got = await c.get_chunks(ns, ks)
        assert all(g is not None for g in got)
    try:
        total = clients * rounds * batch * CHUNK_BYTES
        await run_clients(clients, rounds, put)  # warm-up: first touch of the tier's pages
        await run_clients(clients, rounds, get)
        await c.clear(ns)
        t_put = await run_clients(clients, rounds, put)
        t_get = await run_clients(clients, rounds, get)
        await c.clear(ns)
    finally:
        await c.close()
    return total / t_put / 1e9, total / t_get / 1e9


def bench_lookup32(url: str, tensors: list[torch.Tensor], reps: int) -> dict:
    ns = Namespace("bench-lookup", LAYOUT)
    keys = ns.chunk_keys(list(range(32 * LAYOUT.chunk_size)))
    with KVStoreClient(url, timeout_s=60, same_host=False) as c:  # HTTP (the socket: phase 6)
        for i in range(0, 32, 8):
            c.put_chunks(ns, keys[i:i + 8], [tensors[j % len(tensors)] for j in range(8)])
        assert c.lookup_keys(ns, keys).num_hit_chunks == 32
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            c.lookup_keys(ns, keys)
            times.append(time.perf_counter() - t0)
        c.clear(ns)
    times.sort()
    return {"lookup32_ms": 1e3 * times[len(times) // 2],
            "lookup32_p99_ms": 1e3 * times[int(len(times) * 0.99)]}


async def _throughput(args, out: dict, daemon: Daemon, redis, tensors) -> None:
    """kvstore and Redis measured alternately, ``args.reps`` times per client count: figures
    are medians, and each ratio is the median of the per-repetition ratios (a noisy spell
    hits both sides of a pair instead of one whole side)."""
    runs: dict = {}
    for rep in range(args.reps):
        for clients in (1, 8):
            rounds = max(1, args.rounds // clients * 2)
            kv = await bench_kvstore(daemon.url, clients, rounds, args.batch, tensors,
                                     f"tp{rep}")
            runs.setdefault(("kvstore", clients), []).append(kv)
            line = f"rep {rep}  {clients} client(s): kvstore put {kv[0]:.2f} get {kv[1]:.2f} GB/s"
            if redis is not None:
                rd = await bench_redis(redis.port, clients, rounds, args.batch, tensors)
                runs.setdefault(("redis", clients), []).append(rd)
                line += f" | redis put {rd[0]:.2f} get {rd[1]:.2f} GB/s"
            print(line)
    for clients in (1, 8):
        kv = runs[("kvstore", clients)]
        out[f"put_gbps_{clients}c"] = statistics.median(p for p, _ in kv)
        out[f"get_gbps_{clients}c"] = statistics.median(g for _, g in kv)
        if redis is None:
            continue
        rd = runs[("redis", clients)]
        out[f"redis_put_gbps_{clients}c"] = statistics.median(p for p, _ in rd)
        out[f"redis_get_gbps_{clients}c"] = statistics.median(g for _, g in rd)
        for j, op in enumerate(("put", "get")):
            out[f"{op}_vs_redis_{clients}c"] = statistics.median(
                a[j] / b[j] for a, b in zip(kv, rd))
    out["throughput_reps"] = args.reps


async def _main_async(args, out: dict, workdir: str) -> None:
    tensors = chunk_pool(8)
    redis = None
    if args.shm_only:
        pass
    elif shutil.which("redis-server") is None:
        print("redis-server not installed (apt-get install -y redis-server): "
              "Redis figures skipped")
        out["redis_skipped"] = "redis-server not installed"
    else:
        redis = Redis(workdir)
    daemon = Daemon("2GiB", Path(workdir) / "daemon.log", str(Path(workdir) / "kvstore.sock"))
    if args.shm_only:
        try:
            shm_phase(daemon.unix_socket, args, tensors, out)
        finally:
            out["daemon_exit_code"] = daemon.stop()
        return
    try:
        await _throughput(args, out, daemon, redis, tensors)
        out.update(bench_lookup32(daemon.url, tensors, 300 if not args.quick else 100))
        print(f"lookup of a 32-chunk prompt: median {out['lookup32_ms']:.3f} ms, "
              f"p99 {out['lookup32_p99_ms']:.3f} ms")
        shm_phase(daemon.unix_socket, args, tensors, out)
    finally:
        out["daemon_exit_code"] = daemon.stop()
        if redis is not None:
            redis.stop()
    cap = args.soak_cpu_bytes
    daemon = Daemon(str(cap), Path(workdir) / "soak.log")
    try:
        base = daemon.rss()
        res = await soak(daemon.url, daemon, cap, args.soak_s, 16, tensors)
        res["soak_rss_baseline_bytes"] = base
        res["soak_cpu_capacity_bytes"] = cap
        res["soak_rss_growth_over_capacity"] = (res["soak_rss_peak_bytes"] - base) / cap
        out.update(res)
        print(f"soak {args.soak_s:.0f} s x 16 clients: {res['soak_ops']} ops, "
              f"{res['soak_puts']} puts, errors {res['soak_errors']}, p50 {res['soak_p50_s'] * 1e3:.1f} ms, "
              f"p99 {res['soak_p99_s'] * 1e3:.1f} ms, RSS growth "
              f"{res['soak_rss_growth_over_capacity']:.2f}x of the {cap >> 20} MiB capacity, "
              f"metrics consistent: {res['soak_metrics_consistent']}")
    finally:
        out["soak_daemon_exit_code"] = daemon.stop()


_DURATION = ("Duration on the 2-core machine: --quick 42 s wall (nice 19, load average 2.4-5.0\n"
             "from other work, 2026-12-02); the default run over 3 min (stopped at 180 s in its\n"
             "same-host phase, before its 60 s soak).")


def build_parser() -> argparse.ArgumentParser:
    """The command line (numeric flags checked as it is parsed: ``bench.arg_checks``)."""
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter everything (CI smoke run)")
    ap.add_argument("--json", type=output_file, help="write the figures to this JSON file")
    ap.add_argument("--soak-s", type=float_above(0), default=None, help="soak seconds (default 60; "
                                                               "10 with --quick)")
    ap.add_argument("--batch", type=int_at_least(1), default=4,
                    help="chunks per get/put round trip")
    ap.add_argument("--shm-only", action="store_true", help="only the same-host phase (6) "
                    "and its memcpy baseline")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.rounds = 6 if args.quick else 24
    args.reps = 2 if args.quick else 3
    args.soak_s = args.soak_s if args.soak_s is not None else (10.0 if args.quick else 60.0)
    args.soak_cpu_bytes = (128 << 20) if args.quick else (512 << 20)
    torch.set_num_threads(1)
    out: dict = {"chunk_bytes": CHUNK_BYTES, "batch": args.batch, "quick": args.quick}
    workdir = tempfile.mkdtemp(prefix="kvstore-daemon-load-")
    try:
        asyncio.run(_main_async(args, out, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.shm_only:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True))
            print(f"wrote {args.json}")
        return 0
    out["get_gbps"], out["put_gbps"] = out["get_gbps_1c"], out["put_gbps_1c"]
    out["redis_get_gbps"] = out.get("redis_get_gbps_1c")
    out["redis_put_gbps"] = out.get("redis_put_gbps_1c")
    for c in (1, 8):
        print(f"median of {args.reps}, {c} client(s): kvstore put {out[f'put_gbps_{c}c']:.2f} "
              f"get {out[f'get_gbps_{c}c']:.2f} GB/s" + (
                  f" | redis put {out[f'redis_put_gbps_{c}c']:.2f} "
                  f"get {out[f'redis_get_gbps_{c}c']:.2f} GB/s" if out["redis_get_gbps"] else ""))
    if out["redis_get_gbps"]:
        print("ratio vs redis (median of per-repetition ratios): " + ", ".join(
            f"{op} {c}c {out[f'{op}_vs_redis_{c}c']:.2f}x" for op in ("get", "put")
            for c in (1, 8)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True))
        print(f"wrote {args.json}")
    return 0 if out["soak_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

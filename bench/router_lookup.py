"""Where the router's store lookup time goes, with the daemon busy taking the engines' saves.

``python -m bench.router_lookup [--puts-per-s 4] [--lookups 300] [--burn 0] [--json F]``

Starts one ``kvstore serve`` daemon reached over HTTP only (as ``bench.multi_round_qa
--store-path http`` starts it), ``--savers`` processes that put real-sized chunks to it
(SmolLM2-135M's KV layout: 30 layers x 2 x 256 tokens x 3 heads x 64, fp16 = 5.9 MB a chunk;
together ``--puts-per-s`` chunks a second, as two engines save a chat's new chunks), optionally
``--burn`` processes that spin (the engines' compute on the same cores), and asks the daemon
``POST /v1/lookup`` for a ``--prompt-tokens`` prompt whose chunks it holds, one lookup every
``--interval-ms``, as the router does: ``engine_min.router.store_lookup.StoreLookup`` with the
keys and body from ``connectors.prompt_keys``. Per lookup it times (ms, median / p90 / mean):

    keys_body    chunk keys (sha256 over the prompt) and the JSON body (``lookup_bodies``),
                 of a list of ids for ``aiohttp`` (the router's input before), of the
                 prompt's uint32 id array for ``stream`` (``PreparedPrompt.id_array``)
    round_trip   request sent until the answer is in (``aiohttp``: its status line and
                 headers; ``stream``: the whole answer, its small body included)
    read_parse   the rest of the answer read (``aiohttp``) and its JSON parsed
    total        ``StoreLookup.hit_tokens`` as the router awaits it (``keys_body`` not in it)
    client_cpu   the router process's CPU time in ``total`` (``time.thread_time``): what the
                 client costs whatever the host's load

for each client ``--clients`` names (``aiohttp``: a pooled ``aiohttp`` session, the router's
client before it kept a lookup connection of its own; ``stream``: ``StoreLookup``'s kept-alive
lookup connection, ``engine_min.router.lookup_conn``), in turns so both see the same load.
``daemon_ms`` is the daemon's own mean ``/v1/lookup`` handling time (its
``kvstore_server_request_duration_seconds`` sum / count over the run): ``round_trip - daemon_ms`` is the
two processes' event loops and the socket. The load average at start and end is reported.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import numpy as np

LAYOUT = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", chunk_size=256)


def _namespace():
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    return Namespace("bench/router-lookup", KVLayout(**LAYOUT))


def _saver(url: str, rate: float, seed: int) -> None:
    """Put one new chunk every ``1 / rate`` s (a new chat's chain) until killed."""
    import torch
    from kvstore.daemon.client import KVStoreClient
    ns, rng = _namespace(), random.Random(seed)
    client = KVStoreClient(url, same_host=False)
    kv = torch.randn(ns.layout.shape(), dtype=torch.float32).to(torch.float16)
    next_t = time.monotonic()
    while True:
        toks = [rng.randrange(49152) for _ in range(ns.layout.chunk_size * 2)]
        for key in ns.chunk_keys(toks):
            next_t += 1.0 / rate
            time.sleep(max(0.0, next_t - time.monotonic()))
            try:
                client.put_chunks(ns, [key], [kv], timeout_s=60)
            except OSError as exc:   # StoreUnavailable included: a busy host; go on
                print(f"saver {seed}: {exc}", file=sys.stderr)


def _spawn_daemon(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvstore", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--cpu-bytes", "2GiB"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return p
        except OSError:
            if p.poll() is not None:
                raise RuntimeError(f"kvstore serve exited {p.returncode}") from None
            time.sleep(0.1)
    p.kill()
    raise RuntimeError("kvstore serve did not answer /healthz within 120 s")


def _daemon_lookup_mean_ms(url: str) -> tuple[float, int]:
    """(sum seconds, count) of the daemon's /v1/lookup handling histogram."""
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    s = c = 0.0
    for line in text.splitlines():
        if 'route="/v1/lookup"' in line:
            if line.startswith("kvstore_server_request_duration_seconds_sum"):
                s = float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvstore_server_request_duration_seconds_count"):
                c = float(line.rsplit(" ", 1)[1])
    return s, int(c)


def _stats(xs: list[float]) -> dict:
    a = np.asarray(xs) * 1e3
    return {"p50": round(float(np.median(a)), 3), "p90": round(float(np.percentile(a, 90)), 3),
            "mean": round(float(a.mean()), 3), "max": round(float(a.max()), 3)}


async def _aiohttp_one(session, store, body: bytes) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    async with session.post(store.url + "/v1/lookup", data=body, headers=store.headers) as r:
        t1 = time.perf_counter()
        answer = await r.json(content_type=None)
    t2 = time.perf_counter()
    return int(answer["num_hit_chunks"]) * int(answer["chunk_size"]), t1 - t0, t2 - t1


async def _measure(url: str, args) -> dict:
    import aiohttp
    from connectors.prompt_keys import parse_namespace
    from engine_min.router.metrics import RouterMetrics
    from engine_min.router.store_lookup import StoreLookup
    ns = parse_namespace(_namespace().to_dict())
    toks = [random.randrange(49152) for _ in range(args.prompt_tokens)]
    from kvstore.daemon.client import KVStoreClient
    import torch
    held = ns.chunk_keys(toks)
    arr = np.asarray(toks, dtype=np.uint32)
    kv = torch.zeros(ns.layout.shape(), dtype=torch.float16)
    await asyncio.to_thread(lambda: KVStoreClient(url, same_host=False).put_chunks(
        ns, held, [kv] * len(held), timeout_s=300))
    metrics = RouterMetrics()
    store = StoreLookup(url, timeout_s=1.0)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=30))
    out = {c: {"keys_body": [], "round_trip": [], "read_parse": [], "total": [],
               "client_cpu": []}
           for c in args.clients}
    expect = len(held) * ns.layout.chunk_size
    try:
        for i in range(args.lookups * len(args.clients)):
            client = args.clients[i % len(args.clients)]
            await asyncio.sleep(args.interval_ms / 1e3 * random.uniform(0.5, 1.5))
            t0 = time.perf_counter()
            # the router before: a list of ids; now: the prompt's uint32 array (``id_array``)
            bodies = store.lookup_bodies([ns], toks if client == "aiohttp" else arr)
            t1 = time.perf_counter()
            rec = out[client]
            rec["keys_body"].append(t1 - t0)
            c0 = time.thread_time()
            if client == "aiohttp":
                hit, rt, rp = await _aiohttp_one(session, store, bodies[ns.ns_id])
                rec["round_trip"].append(rt)
                rec["read_parse"].append(rp)
                rec["total"].append(time.perf_counter() - t1)
            else:
                t1 = time.perf_counter()
                hits = await store.hit_tokens(session, bodies, metrics)
                rec["total"].append(time.perf_counter() - t1)
                hit = hits.get(ns.ns_id)
                timing = store.last_timing
                if timing is not None:
                    rec["round_trip"].append(timing[0])
                    rec["read_parse"].append(timing[1])
            rec["client_cpu"].append(time.thread_time() - c0)
            if hit != expect:
                raise RuntimeError(f"{client}: store hit {hit}, expected {expect}")
    finally:
        await session.close()
        store.close()
    return {c: {k: _stats(v) for k, v in rec.items() if v} for c, rec in out.items()}


_DURATION = ("Duration on the 2-core machine: the default run 20 s wall (nice 5, load average\n"
             "0.6-1.5, 2026-12-02).")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.router_lookup", description=__doc__,
                                 epilog=_DURATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--puts-per-s", type=float, default=4.0,
                    help="chunks a second the savers put together (0: an idle daemon)")
    ap.add_argument("--savers", type=int, default=2, help="saving processes (engines)")
    ap.add_argument("--burn", type=int, default=0, help="processes that spin (engine compute)")
    ap.add_argument("--lookups", type=int, default=300, help="lookups per client")
    ap.add_argument("--interval-ms", type=float, default=20.0,
                    help="mean time between lookups (uniform 0.5x-1.5x)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--clients", default="aiohttp,stream",
                    help="comma-separated: aiohttp, stream")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--_saver", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._saver:
        _saver(args._saver[0], float(args._saver[1]), int(args._saver[2]))
        return {}
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    bad = set(args.clients) - {"aiohttp", "stream"}
    if bad or not args.clients:
        ap.error(f"--clients: unknown {sorted(bad)}; choose from aiohttp, stream")
    if args.puts_per_s < 0 or args.savers < 1 or args.lookups < 1 or args.prompt_tokens < 256:
        ap.error("--puts-per-s >= 0, --savers >= 1, --lookups >= 1, --prompt-tokens >= 256")
    from bench.servers import free_port
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load0 = os.getloadavg()
    procs = [_spawn_daemon(port)]
    try:
        if args.puts_per_s > 0:
            for i in range(args.savers):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "bench.router_lookup", "--_saver", url,
                     str(args.puts_per_s / args.savers), str(i)]))
        for _ in range(args.burn):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        time.sleep(2.0 if args.puts_per_s > 0 else 0.0)   # savers' imports and first puts
        s0, c0 = _daemon_lookup_mean_ms(url)
        figures = asyncio.run(_measure(url, args))
        s1, c1 = _daemon_lookup_mean_ms(url)
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()
    out = {"clients": figures,
           "daemon_ms": round((s1 - s0) / max(1, c1 - c0) * 1e3, 3),
           "load_average": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
           "params": {k: v for k, v in vars(args).items() if not k.startswith("_")}}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

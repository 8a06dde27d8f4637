"""What a KV store costs when nothing is reusable: ``python -m bench.miss_cost --json F``.

Cold requests (unique random prompts: nothing any store could hold; lengths fixed by
``--prompt-tokens`` or drawn from an Azure trace with ``--trace``) go through three
``engine_min serve`` servers started side by side with the default flags (tail pieces on):

    no_store    the engine alone (its own prefix cache on: a unique prompt never hits it)
    inprocess   --kvstore-cpu-bytes (the connector over an in-process CPU tier)
    daemon      --kvstore-url of a ``kvstore serve`` started here

Servers come from ``bench.servers`` (configurations ``engine-cache``, ``kvstore-cpu``,
``kvstore-remote``). The measurement is a series of pairs: in pair ``i`` each configuration
gets ``--requests-per-pair`` cold requests, one at a time, in an order rotated by ``i`` (so
a busy moment of the shared host lands on each configuration alike), with ``--gap-s`` between
requests (the saves of one request finish before the next starts: each TTFT is its own
critical path, lookup + prefill + the gather for the save). A configuration's figure in a pair
is the median TTFT of its requests there; ``no_store_ttft_s``, ``inprocess_ttft_s`` and
``daemon_ttft_s`` are the medians over the pairs, ``inprocess_overhead`` and
``daemon_overhead`` the medians over the pairs of ``ttft / no_store - 1`` (target: within
0.05). ``load_avg`` (1-minute) is recorded at the start and the end: figures from a busy
2-core host are not comparable.

``--quick``: one pair, one short request per configuration (a smoke test, not a figure).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import numpy as np

from bench.arg_checks import byte_size, float_above, float_at_least, int_at_least
from bench.client import StreamingClient, first_model
from bench.servers import ServerGroup, ServerOptions, install_cleanup_handlers
from bench.workloads import Request, random_tokens
from bench.outputs import output_dir, output_file

#: Result name -> ``bench.servers`` configuration.
CONFIGS = {"no_store": "engine-cache", "inprocess": "kvstore-cpu", "daemon": "kvstore-remote"}


def prompt_lengths(args: argparse.Namespace, n: int) -> list[int]:
    """``n`` prompt lengths (tokens): ``--prompt-tokens`` each, or the ``--trace`` rows'
    context lengths times ``--length-scale`` (cycled), capped at ``--max-prompt-tokens``."""
    if not args.trace:
        return [args.prompt_tokens] * n
    from bench.traces import load_azure
    from bench.trace_replay import TRACE_DIR, TRACES
    path = str(TRACE_DIR / TRACES[args.trace]) if args.trace in TRACES else args.trace
    rows = load_azure(path, None)
    lens = [min(args.max_prompt_tokens, max(1, round(r.context_tokens * args.length_scale)))
            for r in rows]
    return [lens[i % len(lens)] for i in range(n)]


def cold_requests(args: argparse.Namespace) -> list[Request]:
    """One unique-prompt request per (pair, configuration, repeat), in send order."""
    n = args.pairs * len(CONFIGS) * args.requests_per_pair
    lens = prompt_lengths(args, n)
    return [Request(f"cold{i}", 0.0, random_tokens(np.random.default_rng([args.seed, 41, i]),
                                                    lens[i]), args.max_tokens, f"cold{i}", i)
            for i in range(n)]


async def _measure(urls: dict[str, str], reqs: list[Request], args: argparse.Namespace) -> list:
    """Run the pairs; returns one ``{config: [ttft_s, ...]}`` per pair."""
    names = list(CONFIGS)
    async with aiohttp.ClientSession() as session:
        clients = {}
        for name, url in urls.items():
            clients[name] = StreamingClient(session, url, await first_model(session, url))
        for name, c in clients.items():      # warm-up (first-call allocations), not measured
            for i in range(args.warmup):
                w = Request(f"warm-{name}-{i}", 0.0, random_tokens(
                    np.random.default_rng([args.seed, 43, names.index(name), i]),
                    min(64, args.prompt_tokens)), 2, "warm", i)
                await c.send(w, time.perf_counter())
            await asyncio.sleep(args.gap_s)
        it = iter(reqs)
        pairs = []
        for p in range(args.pairs):
            order = names[p % len(names):] + names[:p % len(names)]
            got: dict[str, list[float]] = {n: [] for n in names}
            for name in order:
                for _ in range(args.requests_per_pair):
                    res = await clients[name].send(next(it), time.perf_counter())
                    if not res.ok:
                        raise RuntimeError(f"{name}: request failed: {res.error}")
                    if res.num_cached_tokens:
                        raise RuntimeError(f"{name}: a cold request reused "
                                           f"{res.num_cached_tokens} tokens")
                    got[name].append(res.ttft_s)
                    await asyncio.sleep(args.gap_s)
            pairs.append({"order": order, **got})
    return pairs


def summarize(pairs: list[dict]) -> dict:
    """Medians over the pairs (each pair: the median TTFT of each configuration's requests)."""
    per = {n: [statistics.median(p[n]) for p in pairs] for n in CONFIGS}
    out = {f"{n}_ttft_s": statistics.median(v) for n, v in per.items()}
    for n in ("inprocess", "daemon"):
        out[f"{n}_overhead"] = statistics.median(
            [a / b - 1 for a, b in zip(per[n], per["no_store"])])
    out["pair_ttft_s"] = per
    return out


_DURATION = ("Duration on the 2-core machine: --quick 33 s wall (nice 19, load average 2.4-5.0\n"
             "from other work, 2026-12-02); the default run (7 pairs x 3 requests of 1,024 tokens\n"
             "per configuration) was not timed.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 prog="python -m bench.miss_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int_at_least(1), default=7, help="rotated rounds (default 7)")
    ap.add_argument("--requests-per-pair", type=int_at_least(1), default=3,
                    help="cold requests per configuration per pair (default 3)")
    ap.add_argument("--prompt-tokens", type=int_at_least(1), default=1024,
                    help="prompt length (default "
                         "1024; a 256-token chunk size stores 4 chunks of it)")
    ap.add_argument("--trace", default=None, help="take prompt lengths from an Azure trace "
                    "(azure-conv, azure-code or a CSV path) instead")
    ap.add_argument("--length-scale", type=float_above(0), default=0.125,
                    help="--trace lengths factor")
    ap.add_argument("--max-prompt-tokens", type=int_at_least(1), default=2048)
    ap.add_argument("--max-tokens", type=int_at_least(1), default=2,
                    help="tokens generated per request")
    ap.add_argument("--gap-s", type=float_at_least(0), default=0.5, help="pause after each request")
    ap.add_argument("--warmup", type=int_at_least(0), default=2,
                    help="unmeasured requests per server")
    ap.add_argument("--kv-cache-bytes", type=byte_size, default="256MiB",
                    help="each engine's KV pool")
    ap.add_argument("--kvstore-cpu-bytes", type=byte_size, default="2GiB")
    ap.add_argument("--threads", type=int_at_least(1), default=None,
                    help="torch threads per engine (default: all cores; one runs at a time)")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="extra engine flag (repeatable), e.g. --engine-arg=--kvstore-tail-"
                    "chunk-size=0 (applies to every server)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 1 pair, 1 request of 64 tokens, no warm-up")
    ap.add_argument("--log-dir", default=None, type=output_dir)
    ap.add_argument("--json", default=None, type=output_file, help="write the figures here")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.pairs, args.requests_per_pair, args.prompt_tokens = 1, 1, 64
        args.warmup, args.gap_s, args.trace = 0, 0.1, None
    if args.pairs < 1 or args.requests_per_pair < 1 or args.prompt_tokens < 2:
        raise SystemExit("--pairs and --requests-per-pair must be >= 1, --prompt-tokens >= 2")
    install_cleanup_handlers()
    load_start = os.getloadavg()[0]
    opts = ServerOptions(kv_cache_bytes=args.kv_cache_bytes,
                         kvstore_cpu_bytes=args.kvstore_cpu_bytes,
                         threads=args.threads or os.cpu_count() or 1,
                         engine_args=tuple(args.engine_arg), log_dir=args.log_dir)
    reqs = cold_requests(args)
    with contextlib.ExitStack() as stack:
        groups = {name: ServerGroup(cfg, opts) for name, cfg in CONFIGS.items()}
        for g in groups.values():
            stack.callback(g.stop)
        with ThreadPoolExecutor(len(groups)) as pool:   # the servers load side by side
            for f in [pool.submit(g.__enter__) for g in groups.values()]:
                f.result()
        urls = {name: g.engine_urls[0] for name, g in groups.items()}
        pairs = asyncio.run(_measure(urls, reqs, args))
    res = {"prompt_tokens": args.prompt_tokens if not args.trace else
           sorted(len(r.prompt) for r in reqs), "trace": args.trace,
           "requests_per_pair": args.requests_per_pair, "max_tokens": args.max_tokens,
           "gap_s": args.gap_s, "engine_args": args.engine_arg, **summarize(pairs),
           "pairs": pairs, "load_avg": [load_start, os.getloadavg()[0]]}
    print(json.dumps({k: v for k, v in res.items() if k not in ("pairs", "pair_ttft_s")},
                     indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()

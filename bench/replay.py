"""Replay one workload against several configurations, same requests, in one run.

For each configuration: start its processes (``bench.servers``), send one short warm-up
request per engine (model load, first-call allocations), scrape ``/metrics``, replay every
request with the streaming client (``bench.client``) honouring arrival times, ``after``
dependencies and a bound on requests in flight, scrape again, stop the processes. With
``--base-url`` the same replay drives already-running OpenAI-compatible servers instead.

Routing with several engines (``shared``): request k of a session goes to engine
``(session_number + k) % num_engines``, so concurrent sessions spread round-robin and each
session moves to the other engine at every request (what makes cross-engine hits visible).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp
import numpy as np
from tqdm import tqdm

from bench import metrics_scrape, report
from bench.arg_checks import byte_size, chunk_size_or_zero, float_above, int_at_least
from bench.client import RequestResult, StreamingClient, first_model
from bench.servers import CONFIG_NAMES, ServerGroup, ServerOptions, engine_help
from bench.workloads import Request, random_tokens
from bench.outputs import output_dir, output_file


@dataclass
class ConfigRun:
    """What one configuration produced: client results in request order, wall time (s),
    metric summary and raw counter increases per process, notes."""

    name: str
    results: list[RequestResult]
    wall_s: float
    metrics: dict = field(default_factory=dict)
    raw_metrics: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)


def routes(requests: Sequence[Request], num_engines: int) -> list[int]:
    """Engine index of each request (see the module docstring)."""
    session_no: dict[str, int] = {}
    seen: dict[str, int] = {}
    out = []
    for r in requests:
        s = session_no.setdefault(r.session, len(session_no))
        k = seen.get(r.session, 0)
        seen[r.session] = k + 1
        out.append((s + k) % num_engines)
    return out


async def drive(requests: Sequence[Request], urls: Sequence[str], *, model: str | None = None,
                endpoint: str = "completions", max_inflight: int | None = None,
                timeout_s: float = 600.0, progress: tqdm | None = None) -> list[RequestResult]:
    """Send ``requests`` to ``urls`` and return their results in request order.

    Each request waits for its ``arrival_s`` (relative to the call), for the request named in
    its ``after`` to finish, and for a free slot when ``max_inflight`` is set.

    Raises:
        ValueError: ``after`` names an unknown or later request, or ``urls`` is empty.
    """
    if not urls:
        raise ValueError("no server URL to send to")
    order = {r.request_id: i for i, r in enumerate(requests)}
    for i, r in enumerate(requests):
        if r.after is not None and order.get(r.after, i) >= i:
            raise ValueError(f"{r.request_id}: 'after' {r.after!r} is not an earlier request")
    done = {r.request_id: asyncio.Event() for r in requests}
    sem = asyncio.Semaphore(max_inflight) if max_inflight else None
    engine_of = routes(requests, len(urls))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        name = model or await first_model(session, urls[0])
        clients = [StreamingClient(session, u, name, endpoint, timeout_s) for u in urls]
        t0 = time.perf_counter()

        async def one(i: int, req: Request) -> RequestResult:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if req.after is not None:
                await done[req.after].wait()
            async with (sem or contextlib.nullcontext()):
                res = await clients[engine_of[i]].send(req, t0)
            done[req.request_id].set()
            if progress is not None:
                progress.update(1)
            return res

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


def warmup_requests(n: int, tokens: int = 32) -> list[Request]:
    """``n`` short requests with prompts no workload shares (seeded, distinct)."""
    return [Request(f"warmup{i}", 0.0, random_tokens(np.random.default_rng([7777, i]), tokens),
                    2, f"warmup{i}", 0) for i in range(n)]


def run_on_urls(name: str, requests: Sequence[Request], urls: Sequence[str],
                metric_urls: dict[str, str], args: argparse.Namespace,
                max_inflight: int | None) -> ConfigRun:
    """Warm up, scrape, replay, scrape: one configuration on running servers."""
    warm = warmup_requests(len(urls))
    asyncio.run(drive(warm, urls, model=args.model, endpoint="completions",
                      timeout_s=args.timeout_s))
    before = {role: metrics_scrape.scrape(u) for role, u in metric_urls.items()}
    with tqdm(total=len(requests), desc=name, unit="req", disable=args.no_progress) as bar:
        results = asyncio.run(drive(requests, urls, model=args.model, endpoint=args.endpoint,
                                    max_inflight=max_inflight, timeout_s=args.timeout_s,
                                    progress=bar))
    after = {role: metrics_scrape.scrape(u) for role, u in metric_urls.items()}
    deltas = {role: metrics_scrape.delta(before[role], after[role]) for role in after}
    ends = [r.send_s + r.e2e_s for r in results if r.e2e_s is not None]
    starts = [r.send_s for r in results]
    wall = (max(ends) - min(starts)) if ends else 0.0
    return ConfigRun(name, results, wall, metrics_scrape.summarize(deltas), deltas)


def server_options(args: argparse.Namespace) -> ServerOptions:
    """``ServerOptions`` from the common flags."""
    return ServerOptions(kv_cache_bytes=args.kv_cache_bytes,
                         kvstore_cpu_bytes=args.kvstore_cpu_bytes,
                         tiny_cpu_bytes=args.tiny_cpu_bytes, disk_bytes=args.disk_bytes,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         threads=args.threads, engine_args=tuple(args.engine_arg),
                         daemon_args=tuple(args.daemon_arg), log_dir=args.log_dir,
                         kvstore_chunk_size=args.kvstore_chunk_size)


def run_configs(requests: Sequence[Request], args: argparse.Namespace,
                max_inflight: int | None = None) -> dict[str, ConfigRun]:
    """Every configuration of ``args.configs`` (or the ``--base-url`` servers), one after the
    other, on the same requests. A configuration whose servers fail to start is recorded with
    its error and the run goes on."""
    if args.base_url:
        urls = [u.strip().rstrip("/") for u in args.base_url.split(",") if u.strip()]
        run = run_on_urls(args.name, requests, urls,
                          {f"engine{i}": u for i, u in enumerate(urls)}, args, max_inflight)
        return {args.name: run}
    names = parse_configs(args.configs)
    opts = server_options(args)
    has_flag = "--no-prefix-caching" in engine_help() if "recompute" in names else True
    runs: dict[str, ConfigRun] = {}
    for name in names:
        try:
            with ServerGroup(name, opts, no_prefix_caching_flag=has_flag) as group:
                run = run_on_urls(name, requests, group.engine_urls, group.metric_urls, args,
                                  max_inflight)
                run.notes.extend(group.notes)
                run.commands = group.commands()
        except RuntimeError as e:
            print(f"[{name}] failed: {e}")
            run = ConfigRun(name, [], 0.0, notes=[f"failed: {e}"[:2000]])
        else:
            print(report.run_line(name, run.results), flush=True)
        runs[name] = run
    return runs


def parse_configs(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``; ``"all"`` -> every configuration.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    names = list(CONFIG_NAMES) if text.strip() == "all" else [
        n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIG_NAMES]
    if bad or not names:
        raise ValueError(f"unknown configuration(s) {bad}; known: {', '.join(CONFIG_NAMES)}")
    return names


def add_common_args(p: argparse.ArgumentParser, configs: str, json_path: str) -> None:
    """Flags shared by every replay entry point."""
    g = p.add_argument_group("run")
    g.add_argument("--configs", default=configs, help=f"comma list or 'all' of "
                   f"{', '.join(CONFIG_NAMES)} (default: %(default)s)")
    g.add_argument("--json", default=json_path, type=output_file,
                   help="result JSON path (default: %(default)s)")
    g.add_argument("--plots-dir", default=None, type=output_dir,
                   help="PNG folder (default: next to --json)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--base-url", default=None, help="drive running OpenAI-compatible "
                   "server(s) instead of starting configurations (comma list: round-robin)")
    g.add_argument("--name", default="external", help="configuration name for --base-url")
    g.add_argument("--model", default=None, help="model name to send (default: first of "
                   "/v1/models)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--timeout-s", type=float_above(0), default=600.0, help="per-request limit")
    s = p.add_argument_group("servers started by the benchmark")
    s.add_argument("--kv-cache-bytes", type=byte_size, default="64MiB",
                   help="engine KV pool, every config")
    s.add_argument("--kvstore-cpu-bytes", type=byte_size, default="2GiB")
    s.add_argument("--tiny-cpu-bytes", type=byte_size, default="32MiB",
                   help="CPU tier of kvstore-disk")
    s.add_argument("--disk-bytes", type=byte_size, default="4GiB")
    s.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=None)
    s.add_argument("--kvstore-chunk-size", type=chunk_size_or_zero, default=64,
                   help="store chunk size (tokens) of the engines with a store; 0 = the "
                        "server's default (256)")
    s.add_argument("--threads", type=int_at_least(1), default=None, help="torch threads per engine")
    s.add_argument("--engine-arg", action="append", default=[], help="extra engine flag "
                   "(repeatable; use --engine-arg=--flag)")
    s.add_argument("--daemon-arg", action="append", default=[])
    s.add_argument("--log-dir", default=None, type=output_dir, help="keep process logs here")


def finish(bench: str, runs: dict[str, ConfigRun], requests: Sequence[Request], params: dict,
           args: argparse.Namespace, group_by: str = "index") -> dict:
    """Build, print and write the report (JSON and plots); returns the report dict."""
    rep = report.build_report(bench, runs, requests, params, vars(args))
    print(report.format_table(rep))
    report.write_json(rep, args.json)
    if not args.no_plots:
        paths = report.plot_all(rep, args.plots_dir or report.default_plot_dir(args.json),
                                bench, group_by=group_by)
        print("plots: " + ", ".join(str(p) for p in paths))
    print(f"json: {args.json}")
    return rep

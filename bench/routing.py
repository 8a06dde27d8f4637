"""Routing comparison: the multi-round workload through one router in front of N engines.

``python -m bench.multi_round_qa --engines 2 --router round-robin,cache-aware --json PATH``
runs, for each router policy and each store setting, a fresh group of processes
(``bench.servers.ServerGroup``): N engines (``engine-cache``; or ``kvstore-remote``, every
engine connected to one shared ``kvstore serve`` daemon: the ``+store`` setting), one router
(``python -m engine_min route --policy P``) in front of them, and replays the same requests
through the router's URL. Per run it reports (seconds, tokens):

    ttft_p50_s, ttft_p95_s   client-side TTFT percentiles over the completed requests
    engine_hit_rate          sum over engines of engine_prefix_cache_hits_total /
                             engine_prefix_cache_queries_total (increases over the replay):
                             the engines' own caches only, store hits not counted
    requests_per_engine      requests each engine served (engine_request_success_total
                             increase without finished_reason="abort", in --engines order;
                             the router's router_requests_total{engine} where an engine
                             lacks it)
    router_overhead_ms       router_overhead_seconds sum / count over the replay, in ms

(computed by ``bench.routing_figures``) and, beyond the four the report is keyed on:
``store`` (bool), ``store_hit_rate`` (store hit tokens / engine queries),
``router_overhead_p50_ms`` (linear interpolation in the histogram's buckets),
``routed_by_reason`` (router_requests_total summed per ``reason``),
``predicted_hit_tokens`` / ``reported_cached_tokens`` (the router's index vs what engines
reported; the latter includes store hits), ``num_requests``, ``num_failed``, ``errors``,
``wall_s``, ``preemptions``, ``commands``, ``requests`` (per request: id, send time, TTFT,
E2E, prompt and cached tokens). The top level adds ``router_overhead_ms`` over every run,
the workload's parameters, ``targets`` (the issue's speed targets,
``bench.routing_figures.targets``) and ``bench_wall_s``.

Workload timing (``session_requests``): users run their rounds back to back (round r+1 is sent
when round r has finished) and at most ``active_users`` users are in a chat at once: user u
starts when user u - active_users has finished its last round. The number of requests in
flight is then ``active_users`` whatever the host's speed, so the comparison does not depend
on how fast the engines happen to be. With an odd ``active_users`` a router that alternates
engines per request sends each user's consecutive rounds to different engines; each engine
then cycles through every active user's history, which a pool holding fewer users than that
loses between visits, while a router that keeps a user on the engine holding its history
needs only about ``active_users / N`` histories per engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
from tqdm import tqdm

from bench import metrics_scrape, report
from bench.client import RequestResult
from bench.replay import drive, server_options, warmup_requests
from bench.routing_figures import labelled, routed_figures, targets
from bench.servers import ServerGroup, ServerOptions
from bench.workloads import Request, random_tokens

POLICIES = ("round-robin", "cache-aware")


def session_requests(requests: Sequence[Request], active_users: int) -> list[Request]:
    """``requests`` of a multi-round workload (``MultiRoundQA.requests()``) re-timed so that at
    most ``active_users`` sessions are active at once (see the module docstring).

    Returns the requests in session-major order (every round of the first session, then the
    next...), each round r > 0 ``after`` round r - 1 of its session (as given), and round 0 of
    the k-th session (k >= active_users) ``after`` the last round of session k - active_users.
    Arrival times are kept as given for round 0 and set to round 0's for later rounds (those
    wait for their ``after``).

    Raises:
        ValueError: ``active_users`` < 1.
    """
    if active_users < 1:
        raise ValueError(f"active_users must be >= 1, got {active_users}")
    sessions: dict[str, list[Request]] = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    ordered = [sorted(rounds, key=lambda r: r.index) for rounds in sessions.values()]
    out: list[Request] = []
    for k, rounds in enumerate(ordered):
        start = rounds[0].arrival_s
        first_after = ordered[k - active_users][-1].request_id if k >= active_users else None
        for i, r in enumerate(rounds):
            out.append(replace(r, arrival_s=start,
                               after=first_after if i == 0 else rounds[i - 1].request_id))
    return out


def wait_router_ready(router_url: str, engine_urls: Sequence[str], timeout_s: float = 60.0
                      ) -> bool:
    """Wait until the router's ``router_engine_healthy`` gauge is 1 for every engine (its
    subscriptions are up). Returns False at the timeout or when the router does not export
    that gauge (its ``/health`` already passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = metrics_scrape.scrape(router_url)
        healthy = labelled(samples, "router_engine_healthy", "engine")
        if not healthy:
            return False
        if len(healthy) >= len(engine_urls) and all(v >= 1 for v in healthy.values()):
            return True
        time.sleep(0.25)
    return False


@dataclass
class RoutedRun:
    """One routed configuration's raw outcome."""

    key: str
    figures: dict
    results: list[RequestResult] = field(default_factory=list)
    raw_metrics: dict = field(default_factory=dict)


def routing_server_options(args: argparse.Namespace) -> ServerOptions:
    """The servers' options of a routing run: ``server_options``, and with ``--store-path
    http`` a daemon that offers no same-host socket, so the engines reach it over HTTP only
    (as engines on other hosts would)."""
    opts = server_options(args)
    if getattr(args, "store_path", "socket") == "http":
        opts = replace(opts, daemon_unix_socket=False)
    return opts


def run_routed(key: str, policy: str, store: bool, requests: Sequence[Request],
               args: argparse.Namespace) -> RoutedRun:
    """Start engines + router (+ daemon with ``store``), warm up, replay, collect figures.

    The warm-up sends one short distinct request straight to each engine and one through the
    router before the counters are read, so model loading and first calls are not measured.

    Raises:
        RuntimeError: a process failed to start (message with its log's tail).
    """
    opts = routing_server_options(args)
    config = "kvstore-remote" if store else "engine-cache"
    with ServerGroup(config, opts, num_engines=args.engines, router_policy=policy,
                     router_args=tuple(args.router_arg), tag=key) as group:
        engine_urls, router_url = group.engine_urls, group.router_url
        asyncio.run(drive(warmup_requests(len(engine_urls)), engine_urls, model=args.model,
                          timeout_s=args.timeout_s))
        ready = wait_router_ready(router_url, engine_urls)
        warm = [Request("router-warmup", 0.0, random_tokens(np.random.default_rng([7778]), 32),
                        2, "router-warmup", 0)]
        asyncio.run(drive(warm, [router_url], model=args.model, timeout_s=args.timeout_s))
        roles = group.metric_urls
        before = {role: metrics_scrape.scrape(u) for role, u in roles.items()}
        with tqdm(total=len(requests), desc=key, unit="req", disable=args.no_progress) as bar:
            results = asyncio.run(drive(requests, [router_url], model=args.model,
                                        endpoint=args.endpoint, timeout_s=args.timeout_s,
                                        progress=bar))
        after = {role: metrics_scrape.scrape(u) for role, u in roles.items()}
        deltas = {role: metrics_scrape.delta(before[role], after[role]) for role in after}
        ends = [r.send_s + r.e2e_s for r in results if r.e2e_s is not None]
        wall = (max(ends) - min(r.send_s for r in results)) if ends else 0.0
        fig = routed_figures(results, deltas, engine_urls, store, wall)
        fig["router_ready"] = ready
        fig["commands"] = group.commands()
    return RoutedRun(key, fig, results, deltas)


def parse_policies(text: str) -> list[str]:
    """``"round-robin,cache-aware"`` -> the list.

    Raises:
        ValueError: an unknown or repeated policy, or none (the message lists the known ones).
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"--router takes a comma list of distinct policies of "
                         f"{', '.join(POLICIES)}; got {text!r}")
    return names


STORE_SETTINGS = {"both": (False, True), "without": (False,), "with": (True,)}


def routing_settings(policies: Sequence[str], store: str, repeat: int) -> list[list[tuple]]:
    """The ``(policy, store)`` runs of each repeat: every policy without and/or with the store
    (``store``: ``both`` | ``without`` | ``with``), in that order in even repeats and reversed
    in odd ones, so that a drift of the host's load over the bench does not favour the
    configurations run first.

    Raises:
        ValueError: an unknown ``store`` or ``repeat`` < 1.
    """
    if store not in STORE_SETTINGS:
        raise ValueError(f"store must be one of {', '.join(STORE_SETTINGS)}, got {store!r}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    one = [(p, s) for p in policies for s in STORE_SETTINGS[store]]
    return [one if k % 2 == 0 else one[::-1] for k in range(repeat)]


def paired_ratios(repeats: Sequence[dict]) -> dict:
    """Per repeat, each ``targets`` ratio (round-robin / cache-aware TTFT p50, without and with
    the store) computed inside that repeat, and their median: ``{NAME: {"per_repeat": [...],
    "median": float | None}}`` (a repeat missing either entry gives ``None`` and is left out of
    the median)."""
    out = {}
    for name in ("ttft_p50_speedup", "ttft_p50_speedup_store"):
        vals = [targets(r, None)[name]["value"] for r in repeats]
        known = [v for v in vals if v is not None]
        out[name] = {"per_repeat": vals,
                     "median": float(np.median(known)) if known else None}
    return out


def run_routing(requests: Sequence[Request], args: argparse.Namespace, params: dict) -> dict:
    """Every policy of ``args.router`` without and/or with the store (``args.store``; keys
    ``NAME`` and ``NAME+store``) on the same requests, ``args.repeat`` times (order reversed
    every other repeat, ``routing_settings``); returns the report ``{"routers": {key:
    figures}, "router_overhead_ms": float | None, **params}`` (``routers``: the first
    repeat's) plus, with ``repeat`` > 1, ``repeats`` (each repeat's ``{key: figures}``) and
    ``paired`` (``paired_ratios``), and writes it to ``args.json``. A configuration whose
    processes fail to start is recorded with ``"error"`` and the others still run."""
    t0 = time.perf_counter()
    repeats: list[dict[str, dict]] = []
    total_s, total_n = 0.0, 0
    plan = routing_settings(parse_policies(args.router), getattr(args, "store", "both"),
                            getattr(args, "repeat", 1))
    for k, settings in enumerate(plan):
        routers: dict[str, dict] = {}
        for policy, store in settings:
            key = policy + ("+store" if store else "")
            tag = key if len(plan) == 1 else f"{key}#{k + 1}"
            try:
                run = run_routed(tag, policy, store, requests, args)
                routers[key] = run.figures
                print(report.run_line(tag, run.results), flush=True)
                total_s += run.figures["router_overhead_sum_s"]
                total_n += run.figures["router_overhead_count"]
            except RuntimeError as e:
                print(f"[{tag}] failed: {e}")
                routers[key] = {"store": store, "error": str(e)[:2000]}
        repeats.append(routers)
    overhead = 1000.0 * total_s / total_n if total_n else None
    rep = {"routers": repeats[0], "router_overhead_ms": overhead,
           **params, "targets": targets(repeats[0], overhead),
           "bench_wall_s": time.perf_counter() - t0}
    if len(repeats) > 1:
        rep["repeats"] = repeats
        rep["paired"] = paired_ratios(repeats)
    print(format_table(rep))
    path = args.json
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=2, default=str)
    print(f"json: {path}")
    return rep


def _fmt(v, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_table(rep: dict) -> str:
    """One line per routed configuration: TTFT p50/p95 (s), engine and store hit rates,
    requests per engine, router overhead (ms), failures."""
    lines = [f"{'router':<20} {'ttft_p50':>9} {'ttft_p95':>9} {'eng_hit':>8} {'store_hit':>9} "
             f"{'per_engine':>12} {'ovh_ms':>7} {'failed':>6}"]
    rows = [(k, f) for k, f in rep["routers"].items()] if "repeats" not in rep else [
        (f"{k}#{i + 1}", f) for i, r in enumerate(rep["repeats"]) for k, f in r.items()]
    for key, f in rows:
        if "error" in f:
            lines.append(f"{key:<20} failed: {f['error'][:60]}")
            continue
        lines.append(f"{key:<20} {_fmt(f['ttft_p50_s']):>9} {_fmt(f['ttft_p95_s']):>9} "
                     f"{_fmt(f['engine_hit_rate']):>8} {_fmt(f['store_hit_rate']):>9} "
                     f"{str(f['requests_per_engine']):>12} "
                     f"{_fmt(f['router_overhead_ms'], digits=2):>7} {f['num_failed']:>6}")
    lines.append(f"router overhead (all runs): {_fmt(rep['router_overhead_ms'], digits=3)} ms"
                 f"/request")
    for k, t in rep.get("targets", {}).items():
        lines.append(f"target {k}: {_fmt(t['value'], digits=2)} (met: {t['met']})")
    for k, p in rep.get("paired", {}).items():
        per = ", ".join(_fmt(v, digits=2) for v in p["per_repeat"])
        lines.append(f"paired {k}: {per}; median {_fmt(p['median'], digits=2)}")
    return "\n".join(lines)

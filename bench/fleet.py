"""Two hosts sharing KV through Redis: ``python -m bench.fleet [--quick] [--json]``.

Long-document Q&A over a fleet of two "hosts" on this machine (``bench.fleet_procs``): each host
is a ``kvstore serve --remote-url CLUSTER`` daemon (small CPU tier, no disk) with one
``engine_min serve --kvstore-url`` on it, both daemons on one 3-master Redis Cluster; a third
engine without a store gives the recompute baseline. Engines run with their own prefix cache
off, so reuse comes from the store only. Per document (token ids, ``doc_tokens`` long, a
multiple of the chunk size so the whole document is in full chunks):

1. ``recompute``: engine0 (no store) answers question 1 about the document: full prefill;
   its greedy output is the reference;
2. host 1 reads the document (engine1, question 0); the bench waits until daemon1 has written
   the document's chunks to Redis;
3. ``remote hit``: host 2 (engine2) answers question 1: daemon2 has none of the document, so
   the whole document is loaded from Redis (checked: daemon2's remote hits grew by exactly the
   document's chunks and its CPU tier served none);
4. ``local hit``: host 2 answers question 2: now from daemon2's CPU tier (checked likewise).

TTFTs are the client's (send -> first streamed token), medians over the documents. Greedy
outputs of the remote hits must equal the reference (``outputs_identical``: the same token
ids, which the engines return with ``return_token_ids``, and the same streamed text). Then the
remote tier's get throughput is measured on the same chunks (``bench.fleet_get``).
Targets: ``remote_vs_recompute`` >= 10 (recompute TTFT / remote-hit TTFT), ``remote_vs_local``
<= 1.5 (remote-hit TTFT / local-hit TTFT), ``remote_get_vs_raw`` >= 0.8, for the full sizes:
``--quick`` prints the ratios without verdicts (its targets' ``met`` is null in the JSON).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp
import numpy as np

from bench.arg_checks import byte_size, chunk_size, int_at_least
from bench.client import RequestResult, StreamingClient, first_model
from bench.fleet_get import measure_get_throughput
from bench.fleet_procs import FleetGroup, FleetOptions
from bench.metrics_scrape import delta, scrape
from bench.servers import install_cleanup_handlers
from bench.workloads import Request, random_tokens
from kvstore.keys import Namespace
from bench.outputs import output_dir, output_file

TARGETS = {"remote_vs_recompute": (">=", 10.0), "remote_vs_local": ("<=", 1.5),
           "remote_get_vs_raw": (">=", 0.8)}


@dataclass(frozen=True)
class FleetWorkload:
    """Documents and questions (token ids, seeded). Sizes in tokens."""

    num_docs: int = 3
    doc_tokens: int = 2048
    question_tokens: int = 24
    answer_tokens: int = 8
    seed: int = 0

    def doc(self, i: int) -> tuple[int, ...]:
        return random_tokens(np.random.default_rng([self.seed, 1, i]), self.doc_tokens)

    def question(self, i: int, j: int) -> tuple[int, ...]:
        return random_tokens(np.random.default_rng([self.seed, 2, i, j]), self.question_tokens)

    def request(self, i: int, j: int) -> Request:
        return Request(f"d{i}-q{j}", 0.0, self.doc(i) + self.question(i, j), self.answer_tokens,
                       f"d{i}", j)


class Asker:
    """Sends one request at a time to the fleet's engines (one event loop, one session)."""

    def __init__(self, fleet: FleetGroup) -> None:
        self.fleet = fleet
        self.loop = asyncio.new_event_loop()
        self.session = self.loop.run_until_complete(self._session())
        self.model = self.loop.run_until_complete(first_model(self.session,
                                                              fleet.url("engine0")))

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    def ask(self, role: str, req: Request) -> RequestResult:
        """Send ``req`` to engine ``role`` and stream the answer.

        Raises:
            RuntimeError: the request failed (the server's error in the message).
        """
        client = StreamingClient(self.session, self.fleet.url(role), self.model,
                                 return_token_ids=True)
        res = self.loop.run_until_complete(client.send(req, time.perf_counter()))
        if not res.ok:
            raise RuntimeError(f"{role} {req.request_id}: {res.error}")
        if res.token_ids is None:
            raise RuntimeError(f"{role} {req.request_id}: the answer carries no token ids "
                               f"(return_token_ids)")
        return res

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()


def _hits(before: dict, after: dict) -> dict:
    """Chunks served per tier between two daemon stats, and the remote tier's own count."""
    b, a = before["hits_by_tier"], after["hits_by_tier"]
    out = {t: a.get(t, 0) - b.get(t, 0) for t in set(a) | set(b)}
    return {"cpu": out.get("cpu", 0), "remote": out.get("remote", 0),
            "remote_tier_hits": after["remote"]["hits"] - before["remote"]["hits"]}


def _daemon_seconds(before: dict, after: dict) -> dict:
    """Where a daemon's time went between two ``/metrics`` scrapes (seconds): per route
    (``kvstore_server_request_duration_seconds``) and in Redis gets
    (``kvstore_remote_latency_seconds{op="get"}``: all nodes' pipelines, then the checks)."""
    d = delta(before, after)
    out = {"redis_get_s": d.get('kvstore_remote_latency_seconds_sum{op="get"}', 0.0)}
    for key, v in d.items():
        if key.startswith("kvstore_server_request_duration_seconds_sum{"):
            route = key.split('route="', 1)[1].split('"', 1)[0]
            if route.startswith("/v1/") and route != "/v1/stats":  # (not the bench's own)
                out["route:" + route] = v
    return out


def run_document(fleet: FleetGroup, asker: Asker, wl: FleetWorkload, i: int,
                 num_chunks: int) -> dict:
    """Steps 1-4 of the module docstring for document ``i``; the figures and checks of it."""
    ref = asker.ask("engine0", wl.request(i, 1))
    st1 = fleet.daemon_stats("daemon1")
    read = asker.ask("engine1", wl.request(i, 0))
    fleet.wait_remote_writes("daemon1", st1, num_chunks)
    st2, m2 = fleet.daemon_stats("daemon2"), scrape(fleet.url("daemon2"))
    remote = asker.ask("engine2", wl.request(i, 1))
    st3, m3 = fleet.daemon_stats("daemon2"), scrape(fleet.url("daemon2"))
    local = asker.ask("engine2", wl.request(i, 2))
    st4, m4 = fleet.daemon_stats("daemon2"), scrape(fleet.url("daemon2"))
    return {"doc": i, "recompute_ttft_s": ref.ttft_s, "host1_read_ttft_s": read.ttft_s,
            "remote_hit_ttft_s": remote.ttft_s, "local_hit_ttft_s": local.ttft_s,
            "remote_hit_chunks": _hits(st2, st3), "local_hit_chunks": _hits(st3, st4),
            "remote_hit_daemon_s": _daemon_seconds(m2, m3),
            "local_hit_daemon_s": _daemon_seconds(m3, m4),
            "remote_hit_cached_tokens": remote.num_cached_tokens,
            "local_hit_cached_tokens": local.num_cached_tokens,
            "output_identical": remote.token_ids == ref.token_ids and remote.text == ref.text,
            "recompute_text": ref.text, "remote_hit_text": remote.text,
            "recompute_token_ids": ref.token_ids, "remote_hit_token_ids": remote.token_ids}


def _namespace(fleet: FleetGroup, chunk_size: int) -> Namespace:
    """The engines' namespace of ``chunk_size``-token chunks, as daemon1 reports it (their
    tail pieces live in a namespace of their own, of the block size)."""
    named = [Namespace.from_dict(n["namespace"])
             for n in fleet.daemon_stats("daemon1")["namespaces"] if n["namespace"]]
    named = [ns for ns in named if ns.layout.chunk_size == chunk_size]
    if len(named) != 1:
        raise RuntimeError(f"daemon1 holds {len(named)} named namespaces of {chunk_size}-token "
                           f"chunks, expected 1")
    return named[0]


def summarize(docs: list[dict], num_chunks: int) -> dict:
    """Medians, checks and ratios over the per-document figures."""
    med = {k: statistics.median(d[k] for d in docs)
           for k in ("recompute_ttft_s", "host1_read_ttft_s", "remote_hit_ttft_s",
                     "local_hit_ttft_s")}
    exact = all(d["remote_hit_chunks"] == {"cpu": 0, "remote": num_chunks,
                                           "remote_tier_hits": num_chunks}
                and d["local_hit_chunks"] == {"cpu": num_chunks, "remote": 0,
                                              "remote_tier_hits": 0} for d in docs)
    med["remote_hit_redis_get_s"] = statistics.median(d["remote_hit_daemon_s"]["redis_get_s"]
                                                      for d in docs)
    return {**med, "outputs_identical": all(d["output_identical"] for d in docs),
            "hits_counted_exactly": exact,
            "remote_vs_recompute": med["recompute_ttft_s"] / med["remote_hit_ttft_s"],
            "remote_vs_local": med["remote_hit_ttft_s"] / med["local_hit_ttft_s"]}


def run(wl: FleetWorkload, fo: FleetOptions, get_reps: int = 5) -> dict:
    """Start the fleet, run every document, measure get throughput, stop the fleet.

    Returns:
        The JSON object ``--json`` prints (see ``main``).
    """
    if wl.doc_tokens % fo.chunk_size:
        raise ValueError(f"doc_tokens ({wl.doc_tokens}) must be a multiple of chunk_size "
                         f"({fo.chunk_size}): the whole document is then in full chunks")
    num_chunks = wl.doc_tokens // fo.chunk_size
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    with FleetGroup(fleet=fo) as fleet:
        startup_s = time.perf_counter() - t0
        asker = Asker(fleet)
        try:
            warm = Request("warm", 0.0, random_tokens(np.random.default_rng([wl.seed, 3]), 16),
                           2, "warm", 0)
            for role in ("engine0", "engine1", "engine2"):
                asker.ask(role, warm)  # first-call allocations; too short to store a chunk
            docs = [run_document(fleet, asker, wl, i, num_chunks) for i in range(wl.num_docs)]
        finally:
            asker.close()
        ns = _namespace(fleet, fo.chunk_size)
        get = measure_get_throughput(fleet.cluster.url, ns, [wl.doc(i) for i in range(wl.num_docs)],
                                     reps=get_reps)
        commands = fleet.commands()
    load.append(os.getloadavg()[0])
    res = {**summarize(docs, num_chunks), **get}
    res["targets"] = {k: {"target": f"{op} {v}", "met": res[k] >= v if op == ">=" else res[k] <= v}
                      for k, (op, v) in TARGETS.items()}
    res["settings"] = {**asdict(wl), **asdict(fo), "chunks_per_doc": num_chunks,
                       "get_reps": get_reps, "threads": fo.threads or os.cpu_count()}
    res.update(documents=docs, startup_s=startup_s, elapsed_s=time.perf_counter() - t0,
               load_average=load, commands=commands)
    return res


def print_table(res: dict, file=sys.stdout) -> None:
    """The figures as a readable table (medians over the documents)."""
    s = res["settings"]
    print(f"fleet: {s['num_docs']} documents x {s['doc_tokens']} tokens ({s['chunks_per_doc']} "
          f"chunks of {s['chunk_size']}), 2 hosts, {s['masters']}-master Redis Cluster", file=file)
    rows = [("recompute TTFT (host 2, no reuse)", f"{res['recompute_ttft_s']:.3f} s"),
            ("host 1 read TTFT (cold store)", f"{res['host1_read_ttft_s']:.3f} s"),
            ("remote-hit TTFT (host 2, from Redis)", f"{res['remote_hit_ttft_s']:.3f} s"),
            ("local-hit TTFT (host 2, its CPU tier)", f"{res['local_hit_ttft_s']:.3f} s"),
            ("  of which daemon 2's Redis get", f"{res['remote_hit_redis_get_s']:.3f} s"),
            ("RemoteTier.get", f"{res['remote_get_gbps']:.2f} GB/s"),
            ("redis-py raw pipelined GET", f"{res['redis_raw_get_gbps']:.2f} GB/s"),
            ("outputs identical to recompute", str(res["outputs_identical"])),
            ("hits counted exactly", str(res["hits_counted_exactly"]))]
    for k, t in res["targets"].items():
        if t["met"] is None:  # --quick: the figure alone
            rows.append((k, f"{res[k]:.2f}"))
            continue
        missed = "" if t["met"] else "  MISSED"
        rows.append((f"{k} (target {t['target']})", f"{res[k]:.2f}{missed}"))
    width = max(len(r[0]) for r in rows)
    for name, val in rows:
        print(f"  {name:<{width}}  {val}", file=file)
    if res.get("targets_note"):
        print(f"  ({res['targets_note']})", file=file)


#: why ``--quick`` judges no target (``unjudged_targets``)
QUICK_TARGETS_NOTE = ("targets apply to the full run (3 documents x 2048 tokens in chunks of "
                      "256): --quick's small documents make recompute cheap, so its ratios "
                      "are not judged")


def unjudged_targets(res: dict) -> dict:
    """``res`` for a ``--quick`` run: each target's ``met`` set to None (not judged: the
    targets are for the full sizes) and ``targets_note`` saying so (in place; returns it)."""
    for t in res["targets"].values():
        t["met"] = None
    res["targets_note"] = QUICK_TARGETS_NOTE
    return res


_DURATION = ("Duration on the 2-core machine: --quick (2 documents of 512 tokens) 50 s wall, Redis\n"
             "Cluster start included (nice 19, load average 2.4-5.0 from other work, 2026-12-02);\n"
             "the default run (3 documents of 2,048 tokens) was not timed.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(epilog=_DURATION, prog="python -m bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke mode: 2 documents of 512 tokens in chunks of 64, 2 get reps")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (the table goes to stderr)")
    p.add_argument("--out", default=None, type=output_file,
                   help="also write the JSON object to this file")
    p.add_argument("--num-docs", type=int_at_least(1), default=None)
    p.add_argument("--doc-tokens", type=int_at_least(1), default=None)
    p.add_argument("--chunk-size", type=chunk_size, default=None)
    p.add_argument("--get-reps", type=int_at_least(1), default=None)
    p.add_argument("--threads", type=int_at_least(1), default=None, help="torch threads per engine")
    p.add_argument("--daemon-cpu-bytes", type=byte_size, default="512MiB")
    p.add_argument("--log-dir", default=None, type=output_dir)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    install_cleanup_handlers()
    quick = dict(num_docs=2, doc_tokens=512, chunk_size=64, get_reps=2)
    full = dict(num_docs=3, doc_tokens=2048, chunk_size=256, get_reps=5)
    d = quick if args.quick else full
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in d.items()}
    for k, v in pick.items():
        if v <= 0:
            raise SystemExit(f"--{k.replace('_', '-')} must be > 0, got {v}")
    wl = FleetWorkload(num_docs=pick["num_docs"], doc_tokens=pick["doc_tokens"])
    fo = FleetOptions(daemon_cpu_bytes=args.daemon_cpu_bytes, chunk_size=pick["chunk_size"],
                      threads=args.threads, log_dir=args.log_dir)
    res = run(wl, fo, get_reps=pick["get_reps"])
    res["settings"]["quick"] = args.quick
    if args.quick:
        unjudged_targets(res)
    print_table(res, sys.stderr if args.json else sys.stdout)  # (stdout: the JSON alone)
    if args.json:
        print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
    sys.exit(0)

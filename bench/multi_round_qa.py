"""Multi-round QA replay: ``python -m bench.multi_round_qa --configs a,b --json PATH``.

U users chat for R rounds; each round's prompt is the user's whole history plus a new question
(see ``bench.workloads.MultiRoundQA``). With the defaults the working set (5 users x ~1.2k
tokens of KV, ~290 MB in fp32) is four times the engines' 64 MiB KV pool (1440 tokens), so
``engine-cache`` loses each user's history between rounds while the store keeps it. Runs in a
few minutes on 2 cores.

Routing comparison: ``python -m bench.multi_round_qa --engines 2 --router
round-robin,cache-aware --json PATH`` (any ``--engines`` >= 2) starts, per router policy and
per store setting (none; ``+store``: one shared ``kvstore serve`` daemon behind every engine),
N engines and one ``python -m engine_min route`` in front of them, and replays the workload
through the router (see ``bench.routing`` for the figures and the JSON). Its defaults: 10 users
x 4 rounds, 64-token system prompt, 448-token context, 32-token questions, 8-token answers
(final prompt 664 tokens), at most 3 users in a chat at once (``--active-users``; a user starts
when an earlier one has finished), each engine's pool 64 MiB = 1440 tokens, about 2 users'
histories: a router that keeps each user on one engine needs 1.5 histories per engine, one that
alternates engines needs all 3 on each. The four runs take about 5 min on a quiet 2-core host
(threads per engine = cores / engines). ``--quick``: 4 users x 3 rounds of a 128-token context,
20 MiB pools (~2 users of 216 tokens), under 3 min.

``--quick`` without ``--engines``: 3 users x 2 rounds of a 256-token context with a 20 MiB pool
(448 tokens): a user's ~300-token history is evicted from the engine by the next two users', so
round 1 loads it from the store, as in the full run. Each run prints one line as it finishes
(requests, TTFT p50), also with ``--no-progress``; at the end every store configuration's
bytes loaded is checked (``store_use_lines``): the quick run exits 1 when one loaded nothing.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import asdict

from bench.arg_checks import float_above, int_at_least
from bench.replay import add_common_args, finish, run_configs
from bench.servers import install_cleanup_handlers
from bench.workloads import MultiRoundQA

#: Workload defaults per mode (flags left unset take these).
DEFAULTS = {
    "classic": dict(num_users=5, num_rounds=4, system_tokens=64, context_tokens=1024,
                    question_tokens=24, answer_tokens=8, qps=1.0, kv_cache_bytes="64MiB"),
    "classic-quick": dict(num_users=3, num_rounds=2, system_tokens=32, context_tokens=256,
                          question_tokens=16, answer_tokens=4, qps=1.0, kv_cache_bytes="20MiB"),
    "routing": dict(num_users=10, num_rounds=4, system_tokens=64, context_tokens=448,
                    question_tokens=32, answer_tokens=8, qps=1.0, active_users=3,
                    kv_cache_bytes="64MiB"),
    "routing-quick": dict(num_users=4, num_rounds=3, system_tokens=32, context_tokens=128,
                          question_tokens=16, answer_tokens=4, qps=1.0, active_users=3,
                          kv_cache_bytes="20MiB"),
}


_DURATION = ("Duration on the 2-core machine: --quick 47 s wall (nice 19, load average 2.4-5.0\n"
             "from other work, 2026-12-02); the default run (3 configurations) a few minutes, not\n"
             "timed; routing (--engines 2 --router round-robin,cache-aware, 40 requests a run)\n"
             "190-250 s a run at load average 3-8 and 20-30 s on a quiet host\n"
             "(docs/measurements.md).")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(epilog=_DURATION,
                                prog="python -m bench.multi_round_qa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload (defaults depend on the mode: see DEFAULTS)")
    w.add_argument("--num-users", type=int_at_least(1), default=None, help="5; routing 10")
    w.add_argument("--num-rounds", type=int_at_least(1), default=None, help="4")
    w.add_argument("--system-tokens", type=int_at_least(0), default=None,
                   help="shared system prompt (64)")
    w.add_argument("--context-tokens", type=int_at_least(0), default=None,
                   help="per-user context (1024; routing 448)")
    w.add_argument("--question-tokens", type=int_at_least(1), default=None, help="24; routing 32")
    w.add_argument("--answer-tokens", type=int_at_least(1), default=None, help="8")
    w.add_argument("--qps", type=float_above(0), default=None,
                   help="request arrival rate (1.0); with "
                        "--engines, the rate at which users start (bounded by --active-users)")
    w.add_argument("--max-inflight", type=int_at_least(0), default=1,
                   help="requests in flight at most "
                        "(0 = unbounded, open loop at --qps); 1 on 2 cores keeps queueing out of "
                        "TTFT (not used with --engines: --active-users bounds it)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-format", choices=("tokens", "text"), default="tokens")
    w.add_argument("--quick", action="store_true",
                   help="a small workload that still overflows the engine pool (3 users x 2 "
                        "rounds, 20 MiB pool; with --engines: 4 x 3), so the store is used: "
                        "without --engines it exits 1 when a store configuration loaded "
                        "nothing")
    r = p.add_argument_group("routing comparison (--engines >= 2)")
    r.add_argument("--engines", type=int_at_least(1), default=1,
                   help="engines behind one router; >= 2 "
                        "runs the routing comparison (default 1: the configurations above)")
    r.add_argument("--router", default="round-robin,cache-aware",
                   help="router policies to compare (default: %(default)s)")
    r.add_argument("--active-users", type=int_at_least(1), default=None,
                   help="users in a chat at once (routing 3; quick 3)")
    r.add_argument("--router-arg", action="append", default=[],
                   help="extra router flag (repeatable; use --router-arg=--flag)")
    r.add_argument("--store-path", choices=("socket", "http"), default="socket",
                   help="how the engines reach the shared daemon in the +store runs: its "
                        "same-host socket (default), or HTTP over TCP only, as engines on "
                        "other hosts would")
    r.add_argument("--store", choices=("both", "without", "with"), default="both",
                   help="run each policy without and with the shared daemon (default), or "
                        "only one of the two")
    r.add_argument("--repeat", type=int_at_least(1), default=1,
                   help="run the comparison this many times, in reversed order every other "
                        "time; the JSON adds each repeat and the ratios paired within it")
    add_common_args(p, configs="recompute,engine-cache,kvstore-cpu",
                    json_path="results/multi_round_qa.json")
    p.set_defaults(kv_cache_bytes=None)
    return p


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset with the mode's defaults (in place; returns ``args``).

    Raises:
        ValueError: ``--engines`` < 1, or ``--base-url`` together with ``--engines`` >= 2.
    """
    if args.engines < 1:
        raise ValueError(f"--engines must be >= 1, got {args.engines}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    routing = args.engines >= 2
    if routing and args.base_url:
        raise ValueError("--engines starts its own engines and router; --base-url drives "
                         "running servers (give the router's URL to --base-url without "
                         "--engines)")
    mode = ("routing" if routing else "classic") + ("-quick" if args.quick else "")
    for k, v in DEFAULTS[mode].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if routing and args.json == "results/multi_round_qa.json":
        args.json = "results/multi_round_qa_routing.json"
    return args


def workload_from_args(args: argparse.Namespace) -> MultiRoundQA:
    return MultiRoundQA(num_users=args.num_users, num_rounds=args.num_rounds,
                        system_tokens=args.system_tokens, context_tokens=args.context_tokens,
                        question_tokens=args.question_tokens, answer_tokens=args.answer_tokens,
                        qps=args.qps, seed=args.seed, prompt_format=args.prompt_format)


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        resolve_defaults(args)
        wl = workload_from_args(args)
        if args.engines >= 2:
            from bench.routing import parse_policies, session_requests
            parse_policies(args.router)
    except ValueError as e:
        parser.error(str(e))
    install_cleanup_handlers()
    requests = wl.requests()
    params = {"workload": "multi_round_qa", **asdict(wl),
              "working_set_tokens": wl.working_set_tokens, "num_requests": len(requests)}
    if args.engines >= 2:
        from bench.routing import run_routing
        requests = session_requests(requests, args.active_users)
        params.update(engines=args.engines, active_users=args.active_users,
                      kv_cache_bytes=args.kv_cache_bytes, store_path=args.store_path,
                      store=args.store, repeat=args.repeat,
                      final_prompt_tokens=max(len(r.prompt) for r in requests
                                              if isinstance(r.prompt, tuple)) if
                      args.prompt_format == "tokens" else None,
                      threads_per_engine=args.threads or max(1, (os.cpu_count() or 1)
                                                             // args.engines),
                      quick=args.quick)
        return run_routing(requests, args, params)
    params["max_inflight"] = args.max_inflight
    runs = run_configs(requests, args, max_inflight=args.max_inflight or None)
    rep = finish("multi_round_qa", runs, requests, params, args, group_by="index")
    lines, all_used = store_use_lines(runs)
    print("\n".join(lines))
    if args.quick and not all_used:
        raise SystemExit(1)
    return rep


#: configurations whose engines have a store behind them (``bench.servers.CONFIG_NAMES``)
STORE_CONFIGS = ("kvstore-cpu", "kvstore-disk", "kvstore-remote", "shared")


def store_use_lines(runs: dict) -> tuple[list[str], bool]:
    """Whether each store configuration of ``runs`` (name -> ``ConfigRun``) loaded anything
    from its store: one line per configuration (``store check [NAME]: bytes loaded N > 0:
    used`` or ``... not used``) and True when every one that ran loaded bytes (a failed run
    counts as not used; True when ``runs`` has no store configuration)."""
    lines, ok = [], True
    for name, run in runs.items():
        if name not in STORE_CONFIGS:
            continue
        loaded = int((run.metrics or {}).get("bytes_loaded") or 0)
        ok = ok and loaded > 0
        lines.append(f"store check [{name}]: bytes loaded {loaded:,} "
                     + ("> 0: the store was used" if loaded > 0 else
                        "(none): the store was NOT used (the workload fits the engine pool? "
                        "see --kv-cache-bytes)"))
    return lines, ok


if __name__ == "__main__":
    main()

"""Real-trace replay: ``python -m bench.trace_replay --trace mooncake|azure-conv|... --configs``.

Mooncake traces keep their prefix structure: each 512-token hash block becomes
``--tokens-per-block`` token ids (16 by default, so a 12k-token Kimi prompt replays as ~375 tokens), lengths
scale by the same factor, arrivals by ``--time-scale``; rows sharing a timestamp go as a burst
or spread over the ~3 s step (``--mode``). By default it replays every row of 12 sampled
conversations (rows sharing their first two hash ids; 22 rows, 7.7k tokens), so each
conversation's turns and their reuse stay whole while the hour shrinks to ~106 s. The report
puts the trace's own reuse (``ideal_hit_rate``: an infinite cache, rounded down to ``--align``
tokens) next to the measured hit rates. Azure traces give arrivals and lengths only (nothing is
shared).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.arg_checks import float_above, float_at_least, int_at_least
from bench.replay import add_common_args, finish, run_configs
from bench.servers import install_cleanup_handlers
from bench.trace_files import DEFAULT_TRACES_DIR, exit_if_missing
from bench.traces import AzureReplay, MooncakeReplay, ideal_hit_tokens, scaled_lengths

TRACE_DIR = DEFAULT_TRACES_DIR
TRACES = {"mooncake": "mooncake_conversation_trace.jsonl",
          "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
          "azure-conv": "azure_llm_2023_conv.csv", "azure-code": "azure_llm_2023_code.csv"}


_DURATION = ("Duration on the 2-core machine: each configuration replays the sampled trace over\n"
             "about 106 s (the trace's hour at --time-scale 0.03) after its server has started, so\n"
             "the default two configurations take about 4 min; not timed end to end.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(epilog=_DURATION,
                                prog="python -m bench.trace_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("trace")
    w.add_argument("--trace", default="mooncake", help=f"one of {', '.join(TRACES)} or a path")
    w.add_argument("--traces-dir", "--trace-dir", dest="trace_dir", default=str(TRACE_DIR),
                   help="folder of the trace files (default: the repository's sibling "
                        "shared/data/traces)")
    w.add_argument("--sessions", type=int_at_least(0), default=12,
                   help="Mooncake: replay every row of "
                        "this many conversations sampled with --seed (0 = all rows)")
    w.add_argument("--limit", type=int_at_least(1), default=100, help="at most the first N rows")
    w.add_argument("--tokens-per-block", type=int_at_least(1), default=16,
                   help="Mooncake: tokens per "
                        "512-token hash block (512 = as published)")
    w.add_argument("--length-scale", type=float_above(0), default=0.125,
                   help="Azure: length factor")
    w.add_argument("--time-scale", type=float_at_least(0), default=0.03,
                   help="multiplies inter-arrival "
                        "times (0.03 = the trace's hour in 106 s, about 40%% busy on 2 cores)")
    w.add_argument("--mode", choices=("burst", "spread"), default="spread",
                   help="Mooncake rows sharing a timestamp")
    w.add_argument("--max-output-tokens", type=int_at_least(1), default=8)
    w.add_argument("--max-input-tokens", type=int_at_least(1), default=2048,
                   help="cut longer prompts")
    w.add_argument("--align", type=int_at_least(1), default=64,
                   help="round the ideal hit down to this "
                        "(the store's chunk size)")
    w.add_argument("--seed", type=int, default=0)
    add_common_args(p, configs="engine-cache,kvstore-cpu", json_path="results/trace_replay.json")
    return p


def trace_path(args: argparse.Namespace) -> str:
    return str(Path(args.trace_dir) / TRACES[args.trace]) if args.trace in TRACES else args.trace


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    path = trace_path(args)
    exit_if_missing("python -m bench.trace_replay", path,
                    args.trace_dir if args.trace in TRACES else None)
    install_cleanup_handlers()
    params = {"workload": "trace_replay", "trace": path, "limit": args.limit,
              "time_scale": args.time_scale}
    if path.endswith(".jsonl"):
        wl = MooncakeReplay(path, tokens_per_block=args.tokens_per_block,
                            time_scale=args.time_scale, limit=args.limit, mode=args.mode,
                            max_output_tokens=args.max_output_tokens,
                            max_input_tokens=args.max_input_tokens,
                            sessions=args.sessions or None, seed=args.seed)
        recs = wl.records()
        cap = args.max_input_tokens
        ideal = ideal_hit_tokens(recs, args.tokens_per_block, args.align, cap)
        total = sum(min(sum(scaled_lengths(r, args.tokens_per_block)[0]), cap or 1 << 60)
                    for r in recs)
        params.update(tokens_per_block=args.tokens_per_block, mode=args.mode,
                      sessions=args.sessions, max_input_tokens=cap,
                      align=args.align, ideal_hit_rate=sum(ideal) / total,
                      ideal_hit_rate_block=sum(ideal_hit_tokens(recs, args.tokens_per_block,
                                                                1, cap)) / total)
    else:
        wl = AzureReplay(path, length_scale=args.length_scale, time_scale=args.time_scale,
                         limit=args.limit, max_output_tokens=args.max_output_tokens,
                         seed=args.seed)
        params.update(length_scale=args.length_scale)
    requests = wl.requests()
    params["num_requests"] = len(requests)
    params["prompt_tokens"] = sum(len(r.prompt) for r in requests)
    runs = run_configs(requests, args)
    rep = finish("trace_replay", runs, requests, params, args, group_by="time")
    if "ideal_hit_rate" in params:
        print(f"trace's own reuse: ideal hit rate {params['ideal_hit_rate']:.3f} at "
              f"{args.align}-token alignment ({params['ideal_hit_rate_block']:.3f} per block)")
    return rep


if __name__ == "__main__":
    main()

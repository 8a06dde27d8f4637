"""Multi-round QA replay: ``python -m bench.multi_round_qa --configs a,b --json PATH``.

U users chat for R rounds; each round's prompt is the user's whole history plus a new question
(see ``bench.workloads.MultiRoundQA``). With the defaults the working set (5 users x ~1.2k
tokens of KV, ~290 MB in fp32) is four times the engines' 64 MiB KV pool (1440 tokens), so
``engine-cache`` loses each user's history between rounds while the store keeps it. Runs in a
few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict

from bench.replay import add_common_args, finish, run_configs
from bench.servers import install_cleanup_handlers
from bench.workloads import MultiRoundQA


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.multi_round_qa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--num-users", type=int, default=5)
    w.add_argument("--num-rounds", type=int, default=4)
    w.add_argument("--system-tokens", type=int, default=64, help="shared system prompt")
    w.add_argument("--context-tokens", type=int, default=1024, help="per-user context")
    w.add_argument("--question-tokens", type=int, default=24)
    w.add_argument("--answer-tokens", type=int, default=8)
    w.add_argument("--qps", type=float, default=1.0, help="request arrival rate")
    w.add_argument("--max-inflight", type=int, default=1, help="requests in flight at most "
                   "(0 = unbounded, open loop at --qps); 1 on 2 cores keeps queueing out of "
                   "TTFT")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-format", choices=("tokens", "text"), default="tokens")
    add_common_args(p, configs="recompute,engine-cache,kvstore-cpu",
                    json_path="results/multi_round_qa.json")
    return p


def workload_from_args(args: argparse.Namespace) -> MultiRoundQA:
    return MultiRoundQA(num_users=args.num_users, num_rounds=args.num_rounds,
                        system_tokens=args.system_tokens, context_tokens=args.context_tokens,
                        question_tokens=args.question_tokens, answer_tokens=args.answer_tokens,
                        qps=args.qps, seed=args.seed, prompt_format=args.prompt_format)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    install_cleanup_handlers()
    wl = workload_from_args(args)
    requests = wl.requests()
    params = {"workload": "multi_round_qa", **asdict(wl),
              "working_set_tokens": wl.working_set_tokens, "num_requests": len(requests),
              "max_inflight": args.max_inflight}
    runs = run_configs(requests, args, max_inflight=args.max_inflight or None)
    return finish("multi_round_qa", runs, requests, params, args, group_by="index")


if __name__ == "__main__":
    main()

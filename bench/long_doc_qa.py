"""Long-document QA replay: ``python -m bench.long_doc_qa --configs a,b --json PATH``.

D documents of L tokens, Q questions each, asked interleaved or shuffled with a bounded number
of requests in flight (see ``bench.workloads.LongDocQA``). The first question of a document
is cold in every configuration; the figure that shows the store is TTFT on the later ones
(``ttft_p50_s_warm``) and the overall p50, which they dominate.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict

from bench.arg_checks import int_at_least
from bench.replay import add_common_args, finish, run_configs
from bench.servers import install_cleanup_handlers
from bench.workloads import LongDocQA


_DURATION = ("Duration on the 2-core machine: the default run (recompute and kvstore-cpu) 104 s\n"
             "wall (nice 19, load average 2.4-5.0 from other work, 2026-12-02).")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(epilog=_DURATION,
                                prog="python -m bench.long_doc_qa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--num-docs", type=int_at_least(1), default=2)
    w.add_argument("--doc-tokens", type=int_at_least(1), default=2048)
    w.add_argument("--questions-per-doc", type=int_at_least(1), default=4)
    w.add_argument("--question-tokens", type=int_at_least(1), default=24)
    w.add_argument("--answer-tokens", type=int_at_least(1), default=8)
    w.add_argument("--order", choices=("interleaved", "shuffled"), default="interleaved")
    w.add_argument("--max-inflight", type=int_at_least(0), default=1,
                   help="requests in flight at most")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-format", choices=("tokens", "text"), default="tokens")
    add_common_args(p, configs="recompute,kvstore-cpu", json_path="results/long_doc_qa.json")
    # 96 MiB = 2176 tokens: one 2k-token document fits (the engine caps prompts at its pool),
    # two do not, so later questions need the store once the other document ran.
    p.set_defaults(kv_cache_bytes="96MiB")
    return p


def workload_from_args(args: argparse.Namespace) -> LongDocQA:
    return LongDocQA(num_docs=args.num_docs, doc_tokens=args.doc_tokens,
                     questions_per_doc=args.questions_per_doc,
                     question_tokens=args.question_tokens, answer_tokens=args.answer_tokens,
                     order=args.order, max_inflight=args.max_inflight, seed=args.seed,
                     prompt_format=args.prompt_format)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    install_cleanup_handlers()
    wl = workload_from_args(args)
    requests = wl.requests()
    params = {"workload": "long_doc_qa", **asdict(wl), "num_requests": len(requests)}
    runs = run_configs(requests, args, max_inflight=wl.max_inflight)
    return finish("long_doc_qa", runs, requests, params, args, group_by="index")


if __name__ == "__main__":
    main()

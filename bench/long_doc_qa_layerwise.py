"""Long-document hit TTFT, whole loads vs layer-wise loads: ``python -m bench.long_doc_qa_layerwise``.

One engine (its own prefix cache off: reuse comes only from the store), one ~4,000-token
document in one in-process CPU tier, two connectors over that one store: ``whole``
(``layerwise_load=False``: every layer written before the forward pass) and ``layerwise``
(``layerwise_load=True``: layer ``i`` written while layers ``< i`` compute; layer ``i``'s
attention waits only for it). Each round asks a question of the document (a hit: the document
is loaded, only the question prefilled) through both, back to back, in alternating order, so a
busy host skews both alike; every prompt was run once before, so each hit loads the same
tokens, and saves are waited for between hits. The outputs are checked against the engine
without a store.

Reported (seconds): per mode the median hit TTFT over the rounds and the runs; the median of
the per-round ratio ``layerwise / whole`` (below 1: layer-wise is faster); the engine's wait
for loads per hit (``kvstore_load_seconds_sum`` / hits: whole loads wait for the whole copy,
layer-wise ones only where the copy runs behind the forward pass); the 1-minute load average
at start and end (figures of a busy 2-core host are not comparable across runs).
"""
from __future__ import annotations

import argparse
import os
import statistics

if __name__ == "__main__":  # run as a script: before torch loads OpenMP
    from engine_min.omp import set_omp_wait_policy
    set_omp_wait_policy()
import torch  # noqa: E402

from bench.long_doc_qa_ttft import _ttft  # noqa: E402
from bench.report import emit_json  # noqa: E402
from kvstore.defaults import DEFAULT_CHUNK_SIZE  # noqa: E402
from bench.arg_checks import chunk_size, int_at_least  # noqa: E402
from bench.outputs import output_file  # noqa: E402

MODES = ("whole", "layerwise")


_DURATION = ("Duration on the 2-core machine: --rounds 2 64 s wall (nice 19, load average 2.4-5.0\n"
             "from other work, 2026-12-02); the default --rounds 6 adds 4 more hits per mode: not\n"
             "timed.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(epilog=_DURATION, prog="python -m bench.long_doc_qa_layerwise",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int_at_least(1), default=4000)
    ap.add_argument("--question-tokens", type=int_at_least(1), default=24)
    ap.add_argument("--rounds", type=int_at_least(2), default=6,
                    help="hits per mode (>= 2, default 6)")
    ap.add_argument("--chunk-size", type=chunk_size, default=DEFAULT_CHUNK_SIZE)
    ap.add_argument("--device", default="auto", help="engine device (default auto)")
    ap.add_argument("--threads", type=int_at_least(1), default=None,
                    help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, type=output_file, help="write the figures here")
    return ap


def run_rounds(engine, conns: dict, doc: list[int], questions: list[list[int]],
               want: list[list[int]], rounds: int) -> dict:
    """Each of ``rounds`` rounds: question ``k % len(questions)`` through both connectors,
    alternating which goes first. Returns ``{mode: [TTFT seconds]}`` and ``"same"``: whether
    every output equals ``want``'s."""
    ttft = {m: [] for m in MODES}
    same = True
    for k in range(rounds):
        q = k % len(questions)
        for mode in (MODES if k % 2 == 0 else MODES[::-1]):
            engine.set_connector(conns[mode])
            t, out = _ttft(engine, doc + questions[q])
            ttft[mode].append(t)
            same &= out.output_token_ids == want[q]
            conns[mode].wait_for_save(120)     # no save runs during the next hit
            engine.set_connector(None)
    return {**ttft, "same": same}


def main(argv: list[str] | None = None, echo: bool = True) -> dict:
    """Run the comparison (``argv``: the command line); the figures (see the module
    docstring), printed when ``echo`` and written to ``--json``."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    from connectors.engine_min import EngineMinConnector
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine
    from kvstore.config import StoreConfig
    from kvstore.store import ChunkStore

    n = args.doc_tokens + args.question_tokens + 8
    probe = EngineConfig(device=args.device)
    token_bytes = 30 * 2 * 3 * 64 * probe.torch_dtype.itemsize
    engine = LLMEngine(EngineConfig(device=args.device, kv_cache_bytes=(n + 64) * token_bytes,
                                    enable_prefix_caching=False,
                                    max_num_batched_tokens=max(512, n)))
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    doc = torch.randint(1000, vocab - 1000, (args.doc_tokens,), generator=g).tolist()
    questions = [torch.randint(1000, vocab - 1000, (args.question_tokens,), generator=g).tolist()
                 for _ in range(3)]
    _ttft(engine, questions[0])                 # warm-up (first-call allocations)
    want = [_ttft(engine, doc + q)[1].output_token_ids for q in questions[1:]]
    store = ChunkStore(StoreConfig(cpu_bytes=2 * n * token_bytes))
    conns = {m: EngineMinConnector(store, chunk_size=args.chunk_size, deadline_s=30.0,
                                   owns_store=False, layerwise_load=m == "layerwise")
             for m in MODES}
    engine.set_connector(conns["whole"])
    for q in questions:     # the document and each question's tail pieces into the store
        _ttft(engine, doc + q)
        conns["whole"].wait_for_save(120)
    engine.set_connector(None)
    before = {m: c.get_stats() for m, c in conns.items()}
    runs = run_rounds(engine, conns, doc, questions[1:], want, args.rounds)
    res = {"doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
           "chunk_size": args.chunk_size, "device": engine.config.device,
           "threads": torch.get_num_threads(), "rounds": args.rounds,
           "outputs_identical": bool(runs["same"])}
    for m, c in conns.items():
        st = c.get_stats()
        hits = st["kvstore_load_count"] - before[m]["kvstore_load_count"]
        waited = st["kvstore_load_seconds_sum"] - before[m]["kvstore_load_seconds_sum"]
        res[m] = {"ttft_hit_s": statistics.median(runs[m]), "ttft_hit_runs_s": runs[m],
                  "load_wait_s_per_hit": waited / max(1, hits),
                  "loaded_tokens": st["kvstore_loaded_tokens"]
                  - before[m]["kvstore_loaded_tokens"],
                  "fallbacks": st["kvstore_fallbacks"] - before[m]["kvstore_fallbacks"]}
        c.close()
    res["layerwise_over_whole"] = statistics.median(
        a / b for a, b in zip(runs["layerwise"], runs["whole"]))
    store.close()
    res["load_average"] = [load_start, os.getloadavg()[0]]
    return emit_json(res, args.json, echo=echo)


if __name__ == "__main__":
    main()

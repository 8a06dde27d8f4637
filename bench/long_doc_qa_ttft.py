"""In-process TTFT of long-document Q&A with the KV connector: ``python -m bench.long_doc_qa_ttft``.

One engine (its own prefix cache off, so reuse can only come from the store), one ~4,000-token
document, several questions, measured in one run (seconds, TTFT = first token - arrival):

* ``recompute``: each question without the connector (full prefill of document + question);
* ``cold``: the first question with the connector and an empty store (the overhead when
  nothing is reusable: lookup + saving; target within 5% of ``recompute``);
* ``hit``: the later questions with the document in the CPU tier (target >= 20x faster than
  ``recompute``);
* ``bound`` = prefill of the new suffix alone (the tokens not loaded: the question plus the
  document's partial last chunk, as a standalone prompt) + KV bytes loaded / memcpy bandwidth
  (target: ``hit`` within 1.5x of it). The memcpy bandwidth is measured here on a tensor the
  size of the loaded KV. What the bound leaves out is the suffix's attention over the loaded
  context, which the engine computes on a hit.

The server-level benchmark of the same workload is ``python -m bench.long_doc_qa``
(several configurations through the OpenAI server); this one isolates the connector.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import engine_min  # noqa: F401 - first: sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP
import torch


def _ttft(engine, prompt: list[int]) -> float:
    from engine_min.sampler import SamplingParams
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return out.first_token_time - out.arrival_time, out


def memcpy_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes per second of a CPU tensor copy of ``nbytes`` (best of ``reps``)."""
    src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * 4 / best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.long_doc_qa_ttft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=4000)
    ap.add_argument("--questions", type=int, default=3, help="questions after the first")
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from connectors.factory import create_connector
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine

    n = args.doc_tokens + args.question_tokens + 8
    mc_bytes_per_token = 30 * 2 * 3 * 64 * 4
    cfg = EngineConfig(kv_cache_bytes=(n + 64) * mc_bytes_per_token, enable_prefix_caching=False,
                       max_num_batched_tokens=max(512, n))
    engine = LLMEngine(cfg)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    doc = torch.randint(1000, vocab - 1000, (args.doc_tokens,), generator=g).tolist()
    questions = [torch.randint(1000, vocab - 1000, (args.question_tokens,), generator=g).tolist()
                 for _ in range(args.questions + 1)]
    _ttft(engine, questions[0])  # warm-up (first-call allocations)

    recompute, want = [], []
    for q in questions[1:]:
        t, out = _ttft(engine, doc + q)
        recompute.append(t)
        want.append(out.output_token_ids)

    conn = create_connector(cpu_bytes=f"{(n * mc_bytes_per_token * 2) >> 20}MiB",
                            chunk_size=args.chunk_size, deadline_s=5.0)
    engine.set_connector(conn)
    cold, _ = _ttft(engine, doc + questions[0])
    conn.wait_for_save(60)
    hit, same = [], True
    for q, w in zip(questions[1:], want):
        t, out = _ttft(engine, doc + q)
        hit.append(t)
        same &= out.output_token_ids == w
    st = engine.stats()
    loaded_tokens = st["kvstore_loaded_tokens"] / max(1, len(hit))
    kv_bytes = int(loaded_tokens * conn.layout.token_bytes)
    tail = len(doc) + args.question_tokens - int(loaded_tokens)   # prefilled on a hit
    engine.set_connector(None)
    suffix = [_ttft(engine, (doc + q)[-tail:])[0] for q in questions[1:]]
    bw = memcpy_bandwidth(kv_bytes)
    bound = statistics.median(suffix) + kv_bytes / bw
    res = {
        "doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
        "chunk_size": args.chunk_size, "threads": torch.get_num_threads(),
        "ttft_recompute_s": statistics.median(recompute), "ttft_cold_connector_s": cold,
        "ttft_hit_s": statistics.median(hit), "suffix_tokens": tail,
        "ttft_suffix_alone_s": statistics.median(suffix),
        "loaded_tokens_per_hit": loaded_tokens, "kv_bytes_per_hit": kv_bytes,
        "memcpy_GBps": bw / 1e9, "bound_s": bound,
        "speedup": statistics.median(recompute) / statistics.median(hit),
        "hit_over_bound": statistics.median(hit) / bound,
        "cold_overhead": cold / statistics.median(recompute) - 1,
        "outputs_identical": same,
        "load_seconds_max": st["kvstore_load_seconds_max"],
    }
    conn.close()
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()

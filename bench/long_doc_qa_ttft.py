"""In-process TTFT of long-document Q&A with the KV connector: ``python -m bench.long_doc_qa_ttft``.

One engine (its own prefix cache off, so reuse can only come from the store), one ~4,000-token
document, several questions, measured in one run (seconds, TTFT = first token - arrival):

* ``recompute``: each question without the connector (full prefill of document + question),
  plus the recompute half of every cold pair (a prompt of the same length: the same work);
  ``ttft_recompute_s`` is the median of all of them, spread over the run;
* ``cold``: a question with the connector and an empty store (the overhead when nothing is
  reusable: lookup + saving), each run paired with a recompute of the same prompt just before
  it; ``cold_overhead`` = median over the pairs of ``cold / recompute - 1`` (target within 5%);
* ``hit``: the later questions with the document in the CPU tier (target >= 20x faster than
  ``recompute``); ``loaded_tokens_per_hit`` tokens come from the store and ``suffix_tokens``
  (the question plus the document's tokens past the last stored chunk) are prefilled;
* two lower bounds for ``hit`` (target: ``hit`` within 1.5x), measured right after each hit
  (so a busy host skews them alike), both adding the KV copy cost
  ``kv_bytes_per_hit / memcpy`` (bandwidth measured here on a tensor the size of the loaded KV):

  - ``bound`` (``ttft_suffix_alone_s``): the suffix prefilled as a standalone prompt. It leaves
    out the suffix's attention over the loaded context, which any engine computes on a hit
    (~half the work for 184 tokens over 3,840), so it is not reachable;
  - ``bound_in_context`` (``ttft_suffix_in_context_s``): the same prompt when the engine's OWN
    prefix cache already holds exactly the loaded tokens (prefix caching on, that prefix made
    resident by a priming request of those tokens through the connector, then the connector
    detached; the engine's hit is checked): the new suffix prefilled given its context
    with zero load cost, i.e. what any engine must compute. ``hit / bound_in_context`` is the
    connector's whole overhead (lookup, load, scatter, bookkeeping) over that.

The first row is the connector with its default flags: tail pieces of one block
(``tail_chunk_size`` = the block size), so the document's tokens past its last full chunk are
stored too and a hit prefills only the question (``--tail-chunk-size N`` sets the size, 0 = full
chunks only). ``--full-chunks-only`` adds a second row (JSON key ``full_chunks_only``, same
fields) with ``tail_chunk_size=0``: what reuse of full chunks alone gives (a hit prefills the
document's last partial chunk too). The recompute figures are shared. (``--save-partial`` is
accepted for old command lines: tail pieces are the default now.)

``load_average`` (1-minute, at start and end) is recorded: figures on a busy 2-core host are
not comparable. The server-level benchmark of the same workload is ``python -m
bench.long_doc_qa`` (several configurations through the OpenAI server); this one isolates the
connector.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

if __name__ == "__main__":  # run as a script: before torch loads OpenMP
    from engine_min.omp import set_omp_wait_policy
    set_omp_wait_policy()
import torch  # noqa: E402

from bench.report import emit_json  # noqa: E402
from kvstore.defaults import DEFAULT_CHUNK_SIZE  # noqa: E402
from bench.arg_checks import chunk_size, int_at_least  # noqa: E402
from bench.outputs import output_file  # noqa: E402


def _ttft(engine, prompt: list[int]):
    """(TTFT seconds, RequestOutput) of one greedy 1-token request."""
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


def suffix_in_context(engine, conn, prompts: list[list[int]], num_cached: int):
    """TTFT of each prompt with exactly its first ``num_cached`` tokens (a multiple of the
    block size) in the engine's own prefix cache and no connector. The cache is primed per
    prompt by a request of its first ``num_cached + 1`` tokens through ``conn`` (its store
    holds them: a load, not a prefill), after ``engine.reset_prefix_cache()``.

    Returns:
        ([TTFT seconds], [output token ids]).

    Raises:
        RuntimeError: the engine's own hit was not ``num_cached`` tokens.
    """
    bm = engine.block_manager
    bm.enable_prefix_caching = True
    times, outs = [], []
    try:
        for p in prompts:
            engine.set_connector(None)
            engine.reset_prefix_cache()
            engine.set_connector(conn)
            _ttft(engine, p[:num_cached + 1])      # num_cached tokens' blocks now resident
            conn.wait_for_save(60)
            engine.set_connector(None)
            t, res = _ttft(engine, p)
            if res.num_cached_tokens != num_cached:
                raise RuntimeError(f"engine prefix hit {res.num_cached_tokens} tokens, "
                                   f"expected {num_cached}")
            times.append(t)
            outs.append(res.output_token_ids)
    finally:
        engine.set_connector(None)
        engine.reset_prefix_cache()
        bm.enable_prefix_caching = False
    return times, outs


def measure_row(engine, doc, questions, want, args, store_bytes, tail: int | None):
    """One connector configuration (``tail`` = tail piece size, 0 = full chunks only, None =
    the connector's default: the block size): cold
    pairs, hits, both bounds. ``want``: recompute outputs of ``questions[1:]``.

    Returns:
        (the row's figures, the recompute TTFTs of its cold pairs).
    """
    from connectors.factory import create_connector

    def connector():
        return create_connector(cpu_bytes=store_bytes, chunk_size=args.chunk_size,
                                deadline_s=5.0, tail_chunk_size=tail)

    # cold: each on an empty store, paired with a recompute of the same prompt just before
    cold, pairs, rec = [], [], []
    p = doc + questions[0]
    for i in range(args.cold_reps):
        engine.set_connector(None)
        t_rec, _ = _ttft(engine, p)
        c = connector()
        engine.set_connector(c)
        t_cold, _ = _ttft(engine, p)
        c.wait_for_save(60)
        if i < args.cold_reps - 1:
            engine.set_connector(None)
            c.close()
        cold.append(t_cold)
        rec.append(t_rec)
        pairs.append(t_cold / t_rec - 1)
    conn = c                       # its store holds what the cold run saved
    # per question, back to back (so a busy host skews them alike): the hit through the
    # connector, the suffix alone, the suffix with its context in the engine's own cache
    hit, alone, in_ctx, loaded, same, same_ctx = [], [], [], [], True, True
    for q, w in zip(questions[1:], want):
        p = doc + q
        engine.set_connector(conn)
        before = engine.stats()
        t, out = _ttft(engine, p)
        after = engine.stats()
        hit.append(t)
        loaded.append(after["kvstore_loaded_tokens"] - before["kvstore_loaded_tokens"])
        pieces = after["kvstore_loaded_tail_chunks"] - before["kvstore_loaded_tail_chunks"]
        same &= out.output_token_ids == w
        engine.set_connector(None)
        alone.append(_ttft(engine, p[loaded[-1]:])[0])
        t, outs = suffix_in_context(engine, conn, [p], loaded[-1])
        in_ctx += t
        same_ctx &= outs[0] == w
    st = conn.get_stats()
    if len(set(loaded)) != 1:
        raise RuntimeError(f"hits loaded different token counts: {loaded}")
    loaded_tokens = loaded[0]
    kv_bytes = int(loaded_tokens * conn.layout.token_bytes)
    tail_n = len(doc) + args.question_tokens - loaded_tokens   # prefilled on a hit
    bw = memcpy_bandwidth(kv_bytes)
    copy_s = kv_bytes / bw
    bound, bound_ctx = statistics.median(alone) + copy_s, statistics.median(in_ctx) + copy_s
    h = statistics.median(hit)
    res = {
        "tail_chunk_size": conn.tail_chunk_size,
        "ttft_cold_connector_s": statistics.median(cold), "ttft_cold_runs_s": cold,
        "ttft_hit_s": h, "ttft_hit_runs_s": hit, "suffix_tokens": tail_n,
        "ttft_suffix_alone_s": statistics.median(alone),
        "ttft_suffix_in_context_s": statistics.median(in_ctx),
        "loaded_tokens_per_hit": loaded_tokens, "kv_bytes_per_hit": kv_bytes,
        "memcpy_GBps": bw / 1e9, "kv_copy_s": copy_s,
        "bound_s": bound, "bound_in_context_s": bound_ctx,
        "hit_over_bound": h / bound, "hit_over_bound_in_context": h / bound_ctx,
        "cold_overhead": statistics.median(pairs), "cold_overhead_pairs": pairs,
        "outputs_identical": bool(same),
        "outputs_identical_in_context": bool(same_ctx),
        "load_seconds_max": st["kvstore_load_seconds_max"],
        "loaded_tail_chunks_per_hit": pieces,
    }
    conn.close()
    return res, rec


_DURATION = ("Duration on the 2-core machine: the default run (a 4,000-token document, 3 questions\n"
             "after the first, 3 cold pairs) 141 s wall (nice 19, load average 2.4-5.0 from other\n"
             "work, 2026-12-02).")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 prog="python -m bench.long_doc_qa_ttft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int_at_least(1), default=4000)
    ap.add_argument("--questions", type=int, default=3, help="questions after the first")
    ap.add_argument("--question-tokens", type=int_at_least(1), default=24)
    ap.add_argument("--chunk-size", type=chunk_size, default=DEFAULT_CHUNK_SIZE)
    ap.add_argument("--cold-reps", type=int, default=3,
                    help="cold runs (each paired with a recompute; default 3)")
    ap.add_argument("--full-chunks-only", action="store_true",
                    help="add the row without tail pieces (tail_chunk_size=0)")
    ap.add_argument("--save-partial", action="store_true",
                    help="no effect: tail pieces are on by default (kept for old command lines)")
    ap.add_argument("--tail-chunk-size", type=int, default=None,
                    help="tail piece size of the first row (default: the connector's, the "
                    "block size; 0 = off)")
    ap.add_argument("--threads", type=int_at_least(1), default=None,
                    help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, type=output_file, help="write the figures here")
    args = ap.parse_args(argv)
    if args.cold_reps < 1 or args.questions < 1:
        ap.error("--cold-reps and --questions must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]

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

    store_bytes = f"{(n * mc_bytes_per_token * 2) >> 20}MiB"
    rows = [measure_row(engine, doc, questions, want, args, store_bytes, args.tail_chunk_size)]
    if args.full_chunks_only:
        rows.append(measure_row(engine, doc, questions, want, args, store_bytes, 0))
    recompute += [t for _, rec in rows for t in rec]   # same prompt length: same work
    r = statistics.median(recompute)
    for row, _ in rows:
        row["speedup"] = r / row["ttft_hit_s"]
    res = {"doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens,
           "chunk_size": args.chunk_size, "threads": torch.get_num_threads(),
           "ttft_recompute_s": r, "ttft_recompute_runs_s": recompute, **rows[0][0]}
    if args.full_chunks_only:
        res["full_chunks_only"] = rows[1][0]
    res["load_average"] = [load_start, os.getloadavg()[0]]
    return emit_json(res, args.json)


if __name__ == "__main__":
    main()

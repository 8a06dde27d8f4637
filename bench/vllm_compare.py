"""Long-document Q&A and 2-round chats on the real vLLM engine (CPU): no connector, vLLM's own
prefix caching, vLLM's ExampleConnector, and our KVStoreConnector, plus engine_min as a
reference, in one run. Rows (``configs`` in the output): ``none``, ``vllm-prefix-cache``,
``example``; ``ours-cpu`` (in-process CPU tier, ``layerwise_load`` auto: whole loads before
the forward pass on CPU); ``ours-cpu-layerwise`` (the same with ``layerwise_load: true``);
``ours-cpu-chunk<N>`` with ``--fine-chunk-size N``; unless ``--no-daemon``, ``ours-daemon``
(a ``kvstore serve`` daemon) and ``ours-daemon-2nd-process`` (a second fresh engine process
on the warm daemon); with ``--engine-min``, engine_min's rows.

Every configuration runs in its own fresh process (vLLM keeps global state), with vLLM's own
prefix caching OFF so every reuse comes through the connector. Workload per document: question
1 (a miss: the document is new), question 1 again (a repeat-prompt hit, the case
ExampleConnector handles), question 2 (a shared-prefix hit: only our chunk store serves it).
TTFT is vLLM's own per-request figure (engine-core time from queued to first token, so it
includes the connector's lookup and load); ``computed_tokens_p50_*``: prompt tokens vLLM still
computed on a hit (our connector loads whole chunks, then the tail in vLLM-block-sized pieces;
``--fine-chunk-size 128`` adds a row with 128-token chunks); the 16-token greedy answer is compared token by token
with the no-connector answers. Chats (``--chats``, on documents of their own): round 1 a
document and a question, answered in ``--chat-answer-tokens`` tokens; round 2 = round 1's
prompt + that answer + a new question, whose TTFT shows reuse of round 1's prompt AND answer
(ours saves generated tokens' KV too; vLLM's prefix cache keeps decoded blocks as well).
``checks`` in the output: ours <= ExampleConnector's TTFT on repeat and shared questions, and
round-2 TTFT ratios against vLLM's prefix caching and against no reuse.

Run in the vLLM environment::

    .venv-vllm/bin/python -m bench.vllm_compare [--docs 3] [--doc-tokens 1500] [--json out.json]

Needs vLLM (tools/make_vllm_env.sh). Each configuration is one ``bench.vllm_engine`` child
process (``run_child``; the vLLM integration tests drive it too); ``--child SPEC_JSON`` runs
one here and prints one line ``RESULT <json>``. engine_min (``--engine-min``) loads the same
converted folder as vLLM under vLLM's model id, so on the daemon it shares vLLM's chunks.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.arg_checks import chunk_size, chunk_size_or_zero, float_above, int_at_least
from bench.vllm_engine import (MODEL_ID, VLLM_CPU_BLOCK, Daemon, child_main, make_document,
                               run_child)
from kvstore.defaults import DEFAULT_CHUNK_SIZE
from bench.outputs import output_file


# ------------------------------------------------------------------------------------------
# Workload
# ------------------------------------------------------------------------------------------
def make_workload(tokenizer, n_docs: int, doc_tokens: int) -> list[dict]:
    """Token-id prompts: per document, question 1, question 1 again, question 2.

    Returns a list of ``{"doc": i, "kind": "miss"|"repeat"|"shared", "tokens": [...]}``.
    """
    out = []
    for i in range(n_docs):
        n = 4
        while len(tokenizer.encode(make_document(i, n))) < doc_tokens:
            n += 4
        doc = make_document(i, n)
        t = ["Elm", "Oak", "Ash", "Fir", "Yew", "Bay", "Pine"][i % 7]
        q1 = f"{doc}\nQuestion: how many tons of grain does {t}3 export?\nAnswer:"
        q2 = f"{doc}\nQuestion: what is the name of the mayor of {t}5?\nAnswer:"
        a, b = tokenizer.encode(q1), tokenizer.encode(q2)
        out += [{"doc": i, "kind": "miss", "tokens": a}, {"doc": i, "kind": "repeat", "tokens": a},
                {"doc": i, "kind": "shared", "tokens": b}]
    return out


def make_chats(tokenizer, n_chats: int, doc_tokens: int) -> list[list[list[int]]]:
    """Two-round chats as token lists, on documents the Q&A workload does not use: round 1 a
    document and a question, round 2 another question (its prompt is round 1's prompt, the
    answer, then this turn)."""
    out = []
    for i in range(n_chats):
        d = 50 + i
        n = 4
        while len(tokenizer.encode(make_document(d, n))) < doc_tokens:
            n += 4
        t = ["Elm", "Oak", "Ash", "Fir", "Yew", "Bay", "Pine"][d % 7]
        first = f"{make_document(d, n)}\nQuestion: how many arches has the bridge of {t}4?\nAnswer:"
        second = f"\nQuestion: what is the name of the mayor of {t}5?\nAnswer:"
        out.append([tokenizer.encode(first), tokenizer.encode(second)])
    return out



# ------------------------------------------------------------------------------------------
# The comparison
# ------------------------------------------------------------------------------------------
def _engine_min_row(model_dir: str, workload: list[dict], max_tokens: int,
                    **store: Any) -> dict:
    """engine_min on the same prompts and the same weights folder as vLLM (its own prefix cache
    off). With ``store`` (``url=`` a daemon, or ``cpu_bytes=``) it runs with our connector at
    chunk 256, vLLM's model id and tail pieces of vLLM's block size: on the daemon that vLLM
    wrote to, engine_min loads vLLM's chunks (same namespace), which is cross-engine sharing."""
    from connectors.factory import create_connector
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine
    from engine_min.sampler import SamplingParams
    conn = create_connector(chunk_size=DEFAULT_CHUNK_SIZE, deadline_s=5.0, model_id=MODEL_ID,
                            tail_chunk_size=VLLM_CPU_BLOCK, **store) if store else None
    eng = LLMEngine(EngineConfig(model=model_dir, enable_prefix_caching=False), connector=conn)
    res = []
    try:
        for w in workload:
            t = time.perf_counter()
            first = eng.generate([w["tokens"]], SamplingParams(temperature=0.0, max_tokens=1))[0]
            ttft = time.perf_counter() - t
            if conn is not None:
                conn.wait_for_save(30)
            out = eng.generate([w["tokens"]],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]
            res.append({"ttft_s": ttft, "output_ids": list(out.output_token_ids),
                        "cached_tokens": first.num_cached_tokens})
    finally:
        if conn is not None:
            conn.close()
    return {"results": res}


def _engine_min_run(runs: dict, name: str, model_dir: str, workload: list[dict],
                    max_tokens: int, **store: Any) -> None:
    print(f"[vllm_compare] {name} ...", file=sys.stderr, flush=True)
    try:
        runs[name] = _engine_min_row(model_dir, workload, max_tokens, **store)
    except Exception as e:  # engine_min missing or broken: the vLLM rows still count
        runs[name] = {"skipped": f"engine_min unavailable: {e!r}"}


def _chat_row(chats: list[list[dict]], base: list[list[dict]]) -> dict:
    """Chat figures of one configuration: TTFT p50 of rounds 1 and 2, round 2's prompt tokens
    not computed (p50; vLLM's prefix cache + connector loads), outputs equal to ``base``."""
    row: dict = {}
    for k in (0, 1):
        ts = [c[k]["ttft_s"] for c in chats if len(c) > k and "ttft_s" in c[k]]
        row[f"ttft_p50_chat_round{k + 1}_s"] = round(statistics.median(ts), 4) if ts else None
    cached = [c[1]["num_cached_tokens"] for c in chats if len(c) > 1
              and c[1].get("num_cached_tokens") is not None]
    if cached:
        row["chat_round2_cached_tokens_p50"] = statistics.median(cached)
        row["chat_round2_prompt_tokens_p50"] = statistics.median(
            [len(c[1]["prompt_ids"]) for c in chats if len(c) > 1])
    same = [r["output_ids"] == b["output_ids"] for c, bc in zip(chats, base)
            for r, b in zip(c, bc)]
    row["chat_outputs_equal"] = f"{sum(same)}/{len(same)}"
    return row


def summarize(workload: list[dict], runs: dict[str, dict]) -> dict:
    """Per configuration: TTFT p50 per kind, output equality with ``none``, connector stats,
    and the chat figures (``_chat_row``)."""
    base = runs["none"].get("results", [])
    table = {}
    for name, run in runs.items():
        if "results" not in run:
            table[name] = {"skipped": run.get("skipped", "failed")}
            continue
        row: dict = {}
        for kind in ("miss", "repeat", "shared"):
            ts = [r["ttft_s"] for w, r in zip(workload, run["results"]) if w["kind"] == kind]
            row[f"ttft_p50_{kind}_s"] = round(statistics.median(ts), 4) if ts else None
        # prompt tokens vLLM computed per request (prompt minus tokens our connector loaded)
        prev = 0
        for w, r in zip(workload, run["results"]):
            lt = (r.get("connector") or {}).get("worker", {}).get("loaded_tokens")
            if lt is not None:
                r["computed_tokens"] = len(w["tokens"]) - (lt - prev)
                prev = lt
        for kind in ("repeat", "shared"):
            ct = [r["computed_tokens"] for w, r in zip(workload, run["results"])
                  if w["kind"] == kind and "computed_tokens" in r]
            if ct:
                row[f"computed_tokens_p50_{kind}"] = statistics.median(ct)
        same = [r["output_ids"] == b["output_ids"] for r, b in zip(run["results"], base)]
        row["outputs_equal"] = f"{sum(same)}/{len(same)}"
        if run.get("chats"):
            row.update(_chat_row(run["chats"], runs["none"].get("chats", [])))
        cached = [r["cached_tokens"] for r in run["results"] if "cached_tokens" in r]
        if cached:
            row["engine_min_loaded_tokens_first_call"] = sum(cached)
        conn = run.get("connector", {}).get("worker")
        if conn:
            row["loaded_tokens"] = conn.get("loaded_tokens")
            row["saved_chunks"] = conn.get("saved_chunks")
            row["saved_tail_chunks"] = conn.get("saved_tail_chunks")
            row["load_errors"] = conn.get("load_errors")
        table[name] = row
    return table


def _run_config(name: str, spec: dict, timeout_s: float) -> dict:
    """``run_child(spec)``; a configuration that fails or times out is ``{"skipped": why}``."""
    print(f"[vllm_compare] {name} ...", file=sys.stderr, flush=True)
    try:
        return run_child(spec, timeout_s=timeout_s)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        why = f"timed out after {timeout_s:.0f} s" if isinstance(e, subprocess.TimeoutExpired) \
            else str(e)[-300:]
        print(f"[vllm_compare] {name} skipped: {why}", file=sys.stderr, flush=True)
        return {"skipped": why}


def checks(table: dict) -> dict:
    """The claims the run tests: ours (in-process CPU tier) at most ExampleConnector's TTFT on
    repeat and shared-prefix questions; chat round 2: ours against vLLM's own prefix caching
    (the ratio of TTFTs, < 1: ours faster) and against no reuse."""
    ours, ex = table.get("ours-cpu", {}), table.get("example", {})
    vpc, none = table.get("vllm-prefix-cache", {}), table.get("none", {})
    out: dict = {}
    for kind in ("repeat", "shared"):
        k = f"ttft_p50_{kind}_s"
        if ours.get(k) is not None and ex.get(k) is not None:
            out[f"ours_le_example_{kind}"] = ours[k] <= ex[k]
    k = "ttft_p50_chat_round2_s"
    for name, other in (("vllm_prefix_cache", vpc), ("no_reuse", none)):
        if ours.get(k) and other.get(k):
            out[f"chat_round2_ttft_ours_over_{name}"] = round(ours[k] / other[k], 3)
    return out


_DURATION = ("Duration on the 2-core machine: 489 s for --docs 3 --doc-tokens 800 --max-tokens 4\n"
             "--chats 2 at load average 6-8 (docs/measurements.md, 2026-12-01); 235 s for\n"
             "--docs 1 --doc-tokens 800 --max-tokens 4 --chats 1 at load 1.2-2.8; the default\n"
             "documents (1500 tokens) take longer: not timed.")


def build_parser() -> argparse.ArgumentParser:
    """The command line (numeric flags checked as it is parsed: ``bench.arg_checks``)."""
    p = argparse.ArgumentParser(epilog=_DURATION,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="vLLM long-document Q&A: connectors compared")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--docs", type=int_at_least(1), default=3)
    p.add_argument("--doc-tokens", type=int_at_least(1), default=1500)
    p.add_argument("--max-tokens", type=int_at_least(1), default=16)
    p.add_argument("--chunk-size", type=chunk_size, default=DEFAULT_CHUNK_SIZE,
                   help="our connector's chunk size (256 = engine_min's, so both share chunks)")
    p.add_argument("--fine-chunk-size", type=chunk_size_or_zero, default=0,
                   help="also run our CPU tier with this chunk size (0: skip), e.g. 128 = vLLM "
                        "CPU's block size, the load granularity of ExampleConnector")
    p.add_argument("--engine-min", action="store_true",
                   help="also time engine_min: alone, with an in-process CPU store, and on the "
                        "daemon vLLM filled (cross-engine hits)")
    p.add_argument("--chats", type=int_at_least(0), default=3,
                   help="2-round chats (their own documents of --doc-tokens) after the Q&A")
    p.add_argument("--chat-answer-tokens", type=int_at_least(1), default=64,
                   help="round 1's answer length (tokens, EOS ignored); round 2's: --max-tokens")
    p.add_argument("--no-daemon", action="store_true",
                   help="leave out the kvstore serve rows (two more engine processes)")
    p.add_argument("--child-timeout-s", type=float_above(0), default=900,
                   help="per configuration; one that fails or runs longer is reported as "
                        "skipped and the others still count")
    p.add_argument("--json", type=output_file, help="write the full results here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.child:
        res = child_main(json.loads(a.child))
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    from bench.vllm_model import convert
    model_dir = str(convert())
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    workload = make_workload(tok, a.docs, a.doc_tokens)
    prompts = [w["tokens"] for w in workload]
    chats = make_chats(tok, a.chats, a.doc_tokens)
    common = {"model_dir": model_dir, "prompts": prompts, "max_tokens": a.max_tokens,
              "prefix_caching": False, "chunk_size": a.chunk_size, "chats": chats,
              "chat_max_tokens": [a.chat_answer_tokens, a.max_tokens]}
    runs: dict[str, dict] = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm-example-") as ex_dir:
        plan = [("none", {"connector": "none"}),
                ("vllm-prefix-cache", {"connector": "none", "prefix_caching": True}),
                ("example", {"connector": "example", "example_path": ex_dir}),
                ("ours-cpu", {"connector": "ours-cpu"}),
                ("ours-cpu-layerwise", {"connector": "ours-cpu",
                                        "extra": {"layerwise_load": True}})]
        if a.fine_chunk_size and a.fine_chunk_size != a.chunk_size:
            plan.append((f"ours-cpu-chunk{a.fine_chunk_size}",
                         {"connector": "ours-cpu", "chunk_size": a.fine_chunk_size}))
        for name, extra in plan:
            runs[name] = _run_config(name, {**common, **extra}, a.child_timeout_s)
        with contextlib.nullcontext(None) if a.no_daemon else Daemon("1GiB") as d:
            for name in () if d is None else ("ours-daemon", "ours-daemon-2nd-process"):
                runs[name] = _run_config(name, {**common, "connector": "ours-daemon",
                                                "url": d.url}, a.child_timeout_s)
            if d is not None and a.engine_min and a.chunk_size == DEFAULT_CHUNK_SIZE:
                _engine_min_run(runs, "engine_min + daemon vLLM filled", model_dir, workload,
                                a.max_tokens, url=d.url)
    if a.engine_min:
        _engine_min_run(runs, "engine_min (no store)", model_dir, workload, a.max_tokens)
        _engine_min_run(runs, "engine_min + cpu store", model_dir, workload, a.max_tokens,
                        cpu_bytes="1GiB")
    table = summarize(workload, runs)
    report = {"workload": {"docs": a.docs, "prompt_tokens": [len(x) for x in prompts],
                           "kinds": [w["kind"] for w in workload],
                           "chat_round1_prompt_tokens": [len(c[0]) for c in chats],
                           "chat_answer_tokens": a.chat_answer_tokens},
              "configs": table, "checks": checks(table),
              "wall_s": round(time.perf_counter() - t_all, 1),
              "notes": "vLLM prefix caching off except in 'vllm-prefix-cache'; TTFT = vLLM request "
                       "metrics (queued -> first token); outputs compared with the no-connector "
                       "run token by token; our connector loads whole chunks and then tail pieces "
                       "of vLLM's block size (128), so a hit recomputes what ExampleConnector "
                       "does: the tokens past the last whole block before the last prompt token; "
                       "chat round 2 = round 1's prompt + its answer + a new question"}
    print(json.dumps({"configs": table, "checks": report["checks"]}, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps({**report, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

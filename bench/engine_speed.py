"""engine_min speed against transformers on the same GGUF, same process, same threads.

    python -m bench.engine_speed [--json PATH] [--threads N] [--prompt-tokens 512] [--decode-tokens 32]

Prints and (with --json) writes: prefill_tok_s / hf_prefill_tok_s (one prompt of
--prompt-tokens tokens, best of --repeats), decode_tok_s_batch{1,8,32} (generated tokens per
second over decode-only steps, best of --repeats, every sequence ignoring EOS), hf_decode_tok_s (transformers
``generate`` single stream, greedy, prefill time subtracted), kv_pool_bytes (the allocated
pool) and kv_cache_bytes (the configured size), plus the ratios the issue sets targets for and
the 1-minute load average at start and end (the figures are only as quiet as the machine).
"""
from __future__ import annotations

import argparse
import json
import os
import time

if __name__ == "__main__":  # run as a script: before torch loads OpenMP
    from engine_min.omp import set_omp_wait_policy
    set_omp_wait_policy()
import torch  # noqa: E402

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams
from bench.arg_checks import int_at_least
from bench.outputs import output_file

TEXT = ("The history of the river town is long. Merchants came by boat, farmers by road, and "
        "every spring the market filled the square with voices, carts and the smell of bread. ")


def prompt_ids(engine: LLMEngine, n: int, salt: int = 0) -> list[int]:
    """``n`` token ids of natural text; ``salt`` changes the first token so prompts differ."""
    ids = engine.tokenizer.encode(TEXT * (n // 20 + 2))[:n]
    ids[0] = 100 + salt
    return ids


def engine_prefill(engine: LLMEngine, n: int, repeats: int) -> float:
    best = float("inf")
    for r in range(repeats):
        engine.add_request(prompt_ids(engine, n, r), SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        best = min(best, time.perf_counter() - t0)
    return n / best


def engine_decode(engine: LLMEngine, batch: int, n_tokens: int) -> float:
    sp = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    for b in range(batch):
        engine.add_request(prompt_ids(engine, 32, b), sp)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()                                  # prefills (and their first tokens)
    before, t0 = engine.num_generated_tokens, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (engine.num_generated_tokens - before) / (time.perf_counter() - t0)


def hf_speeds(engine: LLMEngine, n_prefill: int, n_decode: int, repeats: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM
    folder, name = os.path.split(engine.model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    best = float("inf")
    with torch.inference_mode():
        for r in range(repeats):
            ids = torch.tensor([prompt_ids(engine, n_prefill, r)])
            t0 = time.perf_counter()
            model(ids)
            best = min(best, time.perf_counter() - t0)
        ids = torch.tensor([prompt_ids(engine, 32)])
        kw = dict(do_sample=False, pad_token_id=engine.tokenizer.eos_token_id)

        def gen(n):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            return time.perf_counter() - t0
        gen(2)                                         # warm-up
        rate = max((n_decode - 1) / max(gen(n_decode) - gen(1), 1e-9) for _ in range(repeats))
    return n_prefill / best, rate


_DURATION = ("Duration on the 2-core machine: the default run 148 s wall (nice 19, load average\n"
             "2.4-5.0 from other work, 2026-12-02).")


def build_parser() -> argparse.ArgumentParser:
    """The command line (numeric flags checked as it is parsed: ``bench.arg_checks``)."""
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=output_file, help="write the figures here")
    ap.add_argument("--threads", type=int_at_least(1), default=None,
                    help="torch threads (default: torch's)")
    ap.add_argument("--prompt-tokens", type=int_at_least(1), default=512)
    ap.add_argument("--decode-tokens", type=int_at_least(1), default=32)
    ap.add_argument("--repeats", type=int_at_least(1), default=3)
    ap.add_argument("--kv-cache-bytes", type=int_at_least(1), default=256 * 1024 * 1024)
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(kv_cache_bytes=args.kv_cache_bytes, enable_prefix_caching=False,
                                    max_num_batched_tokens=max(512, args.prompt_tokens)))
    engine_decode(engine, 1, 4)                        # warm-up
    res = {"threads": torch.get_num_threads(), "load_avg_1m_start": os.getloadavg()[0],
           "prefill_tok_s": engine_prefill(engine, args.prompt_tokens, args.repeats)}
    for b in (1, 8, 32):  # best of --repeats: other processes on a small CPU only slow runs down
        res[f"decode_tok_s_batch{b}"] = max(engine_decode(engine, b, args.decode_tokens)
                                            for _ in range(args.repeats))
    res["hf_prefill_tok_s"], res["hf_decode_tok_s"] = hf_speeds(
        engine, args.prompt_tokens, args.decode_tokens, args.repeats)
    res["kv_pool_bytes"] = engine.kv_cache.numel() * engine.kv_cache.element_size()
    res["kv_cache_bytes"] = args.kv_cache_bytes
    res["load_avg_1m_end"] = os.getloadavg()[0]
    res["prefill_vs_hf"] = res["prefill_tok_s"] / res["hf_prefill_tok_s"]
    res["decode_batch8_vs_hf_single"] = res["decode_tok_s_batch8"] / res["hf_decode_tok_s"]
    for k, v in res.items():
        print(f"{k:28s} {v:,.2f}" if isinstance(v, float) else f"{k:28s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()

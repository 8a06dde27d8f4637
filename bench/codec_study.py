"""Study of lossy KV variants on the real model: ``python -m bench.codec_study [--seed S]``.

Each variant fake-quantizes the exact prefix KV in process (torch ops: quantize, then
dequantize back to fp32), so a variant costs one generation pass per prompt and no codec code
is needed. Prompts and the recompute reference are ``bench.codec``'s (``workload_prompts``,
greedy, ``--max-tokens`` 32): per prompt, recompute runs with no connector; a first request
with a connector saves the prompt's full chunks (chunk size 64) to a CPU tier; per variant,
those exact chunks are fake-quantized and put under the variant's own namespace (a
``cache_salt`` per variant), and a request loads them and generates. Greedy margins (top-1 minus
top-2 logit at every generated position) are recorded through the sampler, so a flip is
reported with the margin of recompute and of the variant at the first differing position.

The formats are ``bench.codec_fake``'s. Bytes (``bytes_ratio_vs_fp16``): per stored chunk ``[L, 2, T, H, D]`` the bytes a codec of the
variant would store, summed over the prompt set's distinct chunks, over 2 bytes per element.
Codes cost ``bits / 8`` bytes per element; each scale or zero point costs 2 bytes (fp16, and the
fake quantization uses the fp16-rounded value); a value kept exact costs 2 bytes (fp16) and an
outlier channel 2 bytes per element plus 1 byte of channel index. Headers are not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

if __name__ == "__main__":  # run as a script: before torch loads OpenMP
    from engine_min.omp import set_omp_wait_policy
    set_omp_wait_policy()
import torch  # noqa: E402

from bench.report import emit_json  # noqa: E402
from bench.arg_checks import chunk_size, int_at_least  # noqa: E402
from bench.outputs import output_file  # noqa: E402

from bench.codec_fake import VARIANTS, Variant, apply_variant, fake_quant, set_rotary  # noqa: E402


# ---------------------------------------------------------------- the real-model runs

class MarginRecorder:
    """Wraps ``engine.sampler.sample_rows``: appends each greedy row's top-1 minus top-2 logit
    to ``margins`` (one request at a time)."""

    def __init__(self, engine):
        self.margins: list[float] = []
        self.first_logits: torch.Tensor | None = None      # [vocab] of the first sampled row
        inner = engine.sampler.sample_rows

        def sample_rows(logits, params, generators):
            top = torch.topk(logits.float(), 2, dim=-1).values                 # [n, 2]
            if not self.margins:
                self.first_logits = logits[0].float().cpu().clone()
            self.margins.extend((top[:, 0] - top[:, 1]).tolist())
            return inner(logits, params, generators)
        engine.sampler.sample_rows = sample_rows

    def take(self) -> list[float]:
        out, self.margins = self.margins, []
        return out


def _gen(engine, rec: MarginRecorder, prompt, max_tokens: int):
    from engine_min.sampler import SamplingParams
    rec.take()
    out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return list(out.output_token_ids), rec.take()


def _connector(store, salt: str, chunk_size: int):
    from connectors.engine_min import EngineMinConnector
    return EngineMinConnector(store, chunk_size=chunk_size, deadline_s=60.0,
                              deadline_s_per_chunk=2.0, save_generated=False,
                              owns_store=False, tail_chunk_size=0, cache_salt=salt)


def run_set(engine, prompts, variants, args) -> dict:
    """Recompute reference, the exact chunks, then each variant; per-variant figures."""
    from kvstore.config import StoreConfig
    from kvstore.store import ChunkStore

    rec = MarginRecorder(engine)
    want = [_gen(engine, rec, p, args.max_tokens) for p in prompts]
    store = ChunkStore(StoreConfig(cpu_bytes="2GiB"))
    res: dict = {}
    try:
        conn = _connector(store, "exact", args.chunk_size)
        exact = []                                    # per prompt: list of (key, kv)
        for p in prompts:
            engine.set_connector(conn)
            _gen(engine, rec, p, 1)
            conn.wait_for_save(120)
            engine.set_connector(None)
            keys = conn.ns.chunk_keys(p)
            kvs = store.get_chunks(conn.ns, keys)
            assert all(kv is not None for kv in kvs), "exact chunks not saved"
            exact.append([kv.clone() for kv in kvs])
        conn.close()
        for var in variants:
            res[var.name] = run_variant(engine, rec, store, prompts, want, exact, var, args)
            print(var.name, json.dumps({k: v for k, v in res[var.name].items()
                                        if k != "per_prompt"}), flush=True)
    finally:
        engine.set_connector(None)
        store.close()
    return res


def run_variant(engine, rec, store, prompts, want, exact, var: Variant, args) -> dict:
    """One variant over the prompt set: agreement, exact prompts, flips with margins, bytes."""
    conn = _connector(store, var.name, args.chunk_size)
    seen: dict = {}
    agree, flips = [], []
    try:
        for i, (p, (w, wm), kvs) in enumerate(zip(prompts, want, exact)):
            engine.set_connector(conn)                  # binds the connector's namespace
            keys = conn.ns.chunk_keys(p)
            q = []
            for c, (key, kv) in enumerate(zip(keys, kvs)):
                qkv, nb = apply_variant(kv, var, c * args.chunk_size)
                seen[key] = (nb, kv.numel())
                q.append(qkv.to(kv.dtype))
            store.put_chunks(conn.ns, keys, q)
            before = engine.stats()["kvstore_loaded_tokens"]
            got, gm = _gen(engine, rec, p, args.max_tokens)
            loaded = engine.stats()["kvstore_loaded_tokens"] - before
            engine.set_connector(None)
            if loaded != len(keys) * args.chunk_size:   # a miss would measure recompute
                raise RuntimeError(f"{var.name} prompt {i}: loaded {loaded} tokens, "
                                   f"expected {len(keys) * args.chunk_size}")
            same = [a == b for a, b in zip(got, w)]
            agree.append(sum(same) / len(w))
            if not all(same):
                j = same.index(False)
                flips.append({"prompt": i, "position": j, "recompute_margin": wm[j],
                              "variant_margin": gm[j], "agreement": agree[-1]})
    finally:
        engine.set_connector(None)
        conn.close()
    nbytes = sum(b for b, _ in seen.values())
    elems = sum(n for _, n in seen.values())
    return {"bytes_ratio_vs_fp16": nbytes / (2 * elems), "token_agreement": statistics.mean(agree),
            "prompts_exact": sum(a == 1.0 for a in agree), "num_prompts": len(agree),
            "min_flip_margin": min((f["recompute_margin"] for f in flips), default=None),
            "flips": flips, "per_prompt": agree}


def layer_sensitivity(engine, prompts, args, bits: int = 4) -> list[dict]:
    """Per layer: the first generated token's logits when only that layer's K and V are
    fake-quantized at ``bits`` (K per channel over the chunk, V per token, symmetric), the rest
    exact; ``{layer, mean_abs_logit_change, max_abs_logit_change}`` averaged over ``prompts``."""
    from kvstore.config import StoreConfig
    from kvstore.store import ChunkStore

    rec = MarginRecorder(engine)
    store = ChunkStore(StoreConfig(cpu_bytes="2GiB"))
    rows = [dict(layer=i, mean_abs_logit_change=0.0, max_abs_logit_change=0.0)
            for i in range(engine.model_config.num_layers)]
    try:
        conn = _connector(store, "exact", args.chunk_size)
        for p in prompts:
            engine.set_connector(conn)
            _gen(engine, rec, p, 1)
            conn.wait_for_save(120)
            ref = rec.first_logits
            kvs = [kv.clone() for kv in store.get_chunks(conn.ns, conn.ns.chunk_keys(p))]
            engine.set_connector(None)
            for row in rows:
                lq = _connector(store, f"layer{row['layer']}", args.chunk_size)
                engine.set_connector(lq)
                q = []
                for kv in kvs:
                    kv = kv.clone()                                 # [L, 2, T, H, D]
                    kv[row["layer"], 0] = fake_quant(kv[row["layer"], 0], bits, 0, True)[0]
                    kv[row["layer"], 1] = fake_quant(kv[row["layer"], 1], bits, -1, True)[0]
                    q.append(kv)
                store.put_chunks(lq.ns, lq.ns.chunk_keys(p), q)
                _gen(engine, rec, p, 1)
                engine.set_connector(None)
                lq.close()
                d = (rec.first_logits - ref).abs()
                row["mean_abs_logit_change"] += float(d.mean()) / len(prompts)
                row["max_abs_logit_change"] += float(d.max()) / len(prompts)
        conn.close()
    finally:
        engine.set_connector(None)
        store.close()
    return rows


_DURATION = ("Duration on the 2-core machine: --quick (3 prompts of about 200 tokens) 170 s wall\n"
             "(nice 19, load average 2.4-5.0 from other work, 2026-12-02); the default run (20\n"
             "prompts of 600-1,048 tokens) was not timed: many times --quick's model work.")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 prog="python -m bench.codec_study", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="workload seed (bench.codec's sets)")
    ap.add_argument("--quick", action="store_true", help="3 short prompts")
    ap.add_argument("--max-tokens", type=int_at_least(1), default=32, help="(>= 1)")
    ap.add_argument("--chunk-size", type=chunk_size, default=64,
                    help="store chunk size, a multiple of the engine's block size 16")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    ap.add_argument("--json", default=None, type=output_file, help="write the figures here")
    ap.add_argument("--sensitivity", type=int_at_least(0), default=0, metavar="N",
                    help="instead: per-layer logit change (4-bit K and V in one layer) over "
                         "N prompts (every len/N-th of the set)")
    args = ap.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    from bench.codec import workload_prompts
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine

    prompts = workload_prompts(args.quick, args.seed)
    n = max(len(p) for p in prompts) + args.max_tokens + 16
    engine = LLMEngine(EngineConfig(kv_cache_bytes=(n + 64) * 30 * 2 * 3 * 64 * 4 * 2,
                                    enable_prefix_caching=False,
                                    max_num_batched_tokens=max(512, n)))
    variants = [VARIANTS[v] for v in args.variants.split(",")]
    set_rotary(engine.model_config)
    load = os.getloadavg()[0]
    if args.sensitivity:
        picked = prompts[::max(1, len(prompts) // args.sensitivity)][:args.sensitivity]
        rows = layer_sensitivity(engine, picked, args)
        for r in rows:
            print(json.dumps(r))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"seed": args.seed, "layers": rows,
                           "load_average": [load, os.getloadavg()[0]]}, f, indent=2)
        return {"layers": rows}
    res = {"seed": args.seed, "num_prompts": len(prompts),
           "variants": run_set(engine, prompts, variants, args),
           "load_average": [load, os.getloadavg()[0]]}
    return emit_json(res, args.json, echo=False)


if __name__ == "__main__":
    main()

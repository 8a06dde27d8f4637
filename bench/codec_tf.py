"""Teacher-forced error of lossy KV formats on the real model: ``python -m bench.codec_tf``.

A continuous measure beside ``bench.codec_study``'s token agreement (where one flip at a
near-tie in 20 prompts decides the figure). Per prompt of ``bench.codec``'s sets: recompute
generates ``--max-tokens`` greedy tokens ``w``; one prefill of ``prompt + w[:-1]`` gives the
reference logits at every generated position and the prompt's exact KV. Per variant
(``bench.codec_study.VARIANTS`` names, ``parse_spec``'s format specs, or ``L<i>K<b>`` /
``L<i>V<b>`` / ``L<i>K<b>V<b>``: only layer ``i``'s K and/or V fake-quantized at ``b`` bits,
everything else and the sequence's first 4 tokens exact), the prompt's
full chunks (chunk size 64) are fake-quantized chunk by chunk, written into a KV pool, and the
rest of ``prompt + w[:-1]`` is prefilled over them: logits at the same positions, so every
prompt contributes at every position even after a flip.

Per position, with the reference's top-1 and top-2 tokens ``a``, ``b`` and margin
``m = l[a] - l[b]``: ``dmargin = |Δl[a] - Δl[b]|`` (the change that decides a greedy flip),
``kl`` = KL(reference || variant) of the softmax, and a teacher-forced flip when the variant's
argmax is not ``a``. Figures: mean and 99th percentile of ``dmargin``, mean and max ``kl``,
flips, and ``near`` = positions with ``m < 0.02`` (the flip-prone ones).
"""
from __future__ import annotations

import argparse
import json
import os
import re

if __name__ == "__main__":  # run as a script: before torch loads OpenMP
    from engine_min.omp import set_omp_wait_policy
    set_omp_wait_policy()
import torch  # noqa: E402

from bench.arg_checks import int_at_least  # noqa: E402
from bench.codec_fake import (VARIANTS, Variant, _keys, apply_variant, fake_quant,  # noqa: E402
                             set_rotary)
from bench.outputs import output_file  # noqa: E402
from bench.report import emit_json  # noqa: E402

CHUNK = 64
SINKS = 4           # the one-layer variants keep a sequence's first tokens exact, as kivi does
_LAYER_SPEC = re.compile(r"^L(\d+)(?:K(\d+))?(?:V(\d+))?$")


def layer_only(kv: torch.Tensor, layer: int, k_bits: int | None, v_bits: int | None,
               sinks: int = 0) -> torch.Tensor:
    """``kv [L, 2, T, H, D]`` with only ``layer``'s K (``k_bits``, symmetric per channel over
    the chunk) and/or V (``v_bits``, symmetric per token and head) fake-quantized, its first
    ``sinks`` tokens left exact (as the codec keeps a sequence's sinks)."""
    out = kv.float().clone()
    s = min(sinks, kv.shape[2] - 1)
    if k_bits:
        out[layer, 0, s:] = _keys(out[layer, 0, s:], k_bits, kv.shape[2] - s, 0)[0]
    if v_bits:
        out[layer, 1, s:] = fake_quant(out[layer, 1, s:], v_bits, -1, True)[0]
    return out


def parse_spec(name: str) -> Variant | None:
    """A format spec ``k8[a]-v7[-s4][-g64][-r][-t1][-V8@0.1.29][-K7@3.4]`` (K bits, ``a``: a
    zero point per channel; V bits, symmetric per token and head; sink tokens kept fp16; K
    group; ``r``: keys quantized before RoPE; ``t``: tokens per layer and chunk kept fp16;
    per-layer V or K bits for the listed layers) as a ``Variant``; None if ``name`` is not
    one."""
    kb = vb = None
    asym, sinks, group, over, prerope, toks = False, 0, 64, {}, False, 0
    for tok in name.split("-"):
        if tok == "r":
            prerope = True
            continue
        m = re.fullmatch(r"([kvsgtKV])(\d+)(a?)(?:@([\d.]+))?", tok)
        if not m:
            return None
        c, n = m.group(1), int(m.group(2))
        if m.group(4):
            for layer in m.group(4).split("."):
                over.setdefault(int(layer), {})[c.lower()] = n
        elif c == "k":
            kb, asym = n, bool(m.group(3))
        elif c == "v":
            vb = n
        elif c == "s":
            sinks = n
        elif c == "g":
            group = n
        elif c == "t":
            toks = n
    if kb is None or vb is None:
        return None
    lb = {i: (o.get("k", kb), o.get("v", vb)) for i, o in over.items()}
    return Variant(name, k_bits=kb, k_asym=asym, k_group=group, v_bits=vb, v_symmetric=True,
                   sinks=sinks, layer_bits=lb, k_prerope=prerope, fp16_tokens=toks)


def quantizer(name: str):
    """``name`` -> f(chunk kv [L, 2, T, H, D], start position) -> (fp32 kv of the same shape,
    bytes the format stores; fp16's for ``exact`` and the one-layer variants).

    Raises:
        ValueError: an unknown name."""
    if name == "exact":
        return lambda kv, start: (kv.float(), kv.numel() * 2)
    if name in VARIANTS:
        return lambda kv, start: apply_variant(kv, VARIANTS[name], start)
    var = parse_spec(name)
    if var is not None:
        return lambda kv, start: apply_variant(kv, var, start)
    m = _LAYER_SPEC.match(name)
    if m and (m.group(2) or m.group(3)):
        layer, kb, vb = int(m.group(1)), m.group(2), m.group(3)
        return lambda kv, start: (layer_only(kv, layer, kb and int(kb), vb and int(vb),
                                             max(0, SINKS - start)), kv.numel() * 2)
    raise ValueError(f"unknown variant {name!r}")


class Forcer:
    """Prefills a token list over a given prefix KV in a private pool (block size 16) of the
    engine's model, returning the last positions' logits."""

    def __init__(self, engine, max_len: int):
        from engine_min.model import AttentionMetadata, PrefillSpan
        self.model, self.meta_t, self.span_t = engine.model, AttentionMetadata, PrefillSpan
        mc = engine.model_config
        self.bs = 16
        nb = max_len // self.bs + 2
        self.kv = torch.zeros(mc.num_layers, 2, nb, self.bs, mc.num_kv_heads, mc.head_dim)
        self.table = torch.arange(1, nb, dtype=torch.long)     # block 0 is the null block

    @torch.inference_mode()
    def run(self, ids: list[int], start: int, prefix: torch.Tensor | None, last: int
            ) -> torch.Tensor:
        """Prefill ``ids[start:]`` with ``prefix [L, 2, start, H, D]`` (None when start is 0)
        as the KV of ``ids[:start]``; returns ``[last, vocab]`` fp32 logits of the last
        ``last`` tokens."""
        L, _, nb, bs, H, D = self.kv.shape
        if start:
            nblk = start // bs
            self.kv[:, :, 1:1 + nblk] = prefix.reshape(L, 2, nblk, bs, H, D)
        pos = torch.arange(start, len(ids))
        slots = (pos // bs + 1) * bs + pos % bs
        n = len(ids) - start
        meta = self.meta_t(slot_mapping=slots,
                           prefills=[self.span_t(0, n, self.table, len(ids))])
        hidden = self.model(torch.tensor(ids[start:]), pos, self.kv, meta)
        return self.model.compute_logits(hidden[n - last:])


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Per-position figures of ``got`` vs ``ref`` (both ``[n, vocab]`` logits)."""
    top = ref.topk(2, dim=-1)
    a, b = top.indices[:, 0], top.indices[:, 1]
    d = got - ref
    idx = torch.arange(ref.shape[0])
    dm = (d[idx, a] - d[idx, b]).abs()
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"dmargin": dm, "kl": kl, "flip": got.argmax(-1) != a,
            "margin": top.values[:, 0] - top.values[:, 1]}


_DURATION = ("Duration on the 2-core machine: --quick (3 prompts of about 200 tokens) 37 s wall\n"
             "(nice 19, load average 2.4-5.0 from other work, 2026-12-02); the default run (20\n"
             "prompts of 600-1,048 tokens) was not timed: many times --quick's model work.")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 prog="python -m bench.codec_tf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int_at_least(0), default=0)
    ap.add_argument("--quick", action="store_true", help="3 short prompts")
    ap.add_argument("--prompts", type=int_at_least(1), default=0,
                    help="use only N prompts, every len/N-th (0 = all)")
    ap.add_argument("--max-tokens", type=int_at_least(2), default=32)
    ap.add_argument("--variants", default="exact,fp16,bf16,k8-v7sym-sink4")
    ap.add_argument("--json", default=None, type=output_file)
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    quants = {n: quantizer(n) for n in names}
    from bench.codec import workload_prompts
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine
    from engine_min.sampler import SamplingParams

    prompts = workload_prompts(args.quick, args.seed)
    if args.prompts:
        prompts = prompts[::max(1, len(prompts) // args.prompts)][:args.prompts]
    n = max(len(p) for p in prompts) + args.max_tokens + 16
    engine = LLMEngine(EngineConfig(kv_cache_bytes=(n + 64) * 30 * 2 * 3 * 64 * 4 * 2,
                                    enable_prefix_caching=False,
                                    max_num_batched_tokens=max(512, n)))
    forcer = Forcer(engine, n + 64)
    set_rotary(engine.model_config)
    load = os.getloadavg()[0]
    acc = {nm: [] for nm in names}
    nbytes = {nm: [0, 0] for nm in names}
    for i, p in enumerate(prompts):
        w = list(engine.generate([p], SamplingParams(max_tokens=args.max_tokens,
                                                     temperature=0.0))[0].output_token_ids)
        ids, last = p + w[:-1], len(w)
        ref = forcer.run(ids, 0, None, last)
        P = (len(p) // CHUNK) * CHUNK
        L, _, nb, bs, H, D = forcer.kv.shape
        exact = forcer.kv[:, :, 1:1 + P // bs].reshape(L, 2, P, H, D).clone()
        agree = float((ref.argmax(-1) == torch.tensor(w)).float().mean())
        for nm in names:
            qs = [quants[nm](exact[:, :, c:c + CHUNK], c) for c in range(0, P, CHUNK)]
            q = torch.cat([a for a, _ in qs], dim=2)
            nbytes[nm][0] += sum(b for _, b in qs)
            nbytes[nm][1] += 2 * exact.numel()
            acc[nm].append(compare(ref, forcer.run(ids, P, q, last)))
        print(f"prompt {i} prefix {P} ref-vs-generate agreement {agree:.3f}", flush=True)
    res = {"seed": args.seed, "num_prompts": len(prompts), "variants": {}}
    for nm in names:
        cat = {k: torch.cat([r[k] for r in acc[nm]]) for k in acc[nm][0]}
        near = cat["margin"] < 0.02
        res["variants"][nm] = {
            "bytes_ratio_vs_fp16": nbytes[nm][0] / nbytes[nm][1],
            "dmargin_mean": float(cat["dmargin"].mean()),
            "dmargin_rms": float(cat["dmargin"].pow(2).mean().sqrt()),
            "dmargin_p99": float(cat["dmargin"].quantile(0.99)),
            "dmargin_max": float(cat["dmargin"].max()),
            "kl_mean": float(cat["kl"].mean()), "kl_max": float(cat["kl"].max()),
            "tf_flips": int(cat["flip"].sum()), "positions": int(cat["flip"].numel()),
            "near_ties": int(near.sum()),
            "dmargin_mean_near": float(cat["dmargin"][near].mean()) if near.any() else None,
            "flips": [{"prompt": i, "position": j, "margin": float(r["margin"][j]),
                       "dmargin": float(r["dmargin"][j])}
                      for i, r in enumerate(acc[nm]) for j in r["flip"].nonzero().flatten().tolist()]}
        print(nm, json.dumps(res["variants"][nm]), flush=True)
    res["load_average"] = [load, os.getloadavg()[0]]
    return emit_json(res, args.json, echo=False)


if __name__ == "__main__":
    main()

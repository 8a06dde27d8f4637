"""The engine checks of ``python -m bench.gpu_check``, on the real model (SmolLM2-135M-Instruct).

* ``model_logits_check(device)``: the last-token logits of a few prompts computed on ``device``
  next to the CPU's (float32 there): in float32 they must agree within ``FP32_TOL`` and give the
  same greedy continuation (16 tokens); in the device's default dtype (float16 on CUDA) the
  largest difference is reported and the top token must agree on every prompt.
* ``long_doc_ttft_check(device, doc_tokens)``: TTFT of a long-document question when the
  document's KV comes from the store (the connector, a CPU tier) vs recomputing it, on
  ``device``; the answers must be the same tokens. ``speedup`` = median recompute TTFT /
  median hit TTFT.

Both need ``EngineConfig(device=...)``; ``engine_has_device()`` says whether this engine has it.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

#: largest |CUDA - CPU| of a float32 logit that counts as the same computation (reduction
#: order differs between the devices' matmuls)
FP32_TOL = 2e-2


def engine_has_device() -> bool:
    """Whether ``engine_min.config.EngineConfig`` takes a ``device``."""
    from engine_min.config import EngineConfig
    return "device" in {f.name for f in dataclasses.fields(EngineConfig)}


def _engine(model: str | None, device: str, dtype: str | None, kv_bytes: int,
            batch_tokens: int = 512, **kw):
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, kv_cache_bytes=kv_bytes,
                                  max_num_batched_tokens=batch_tokens, **kw))


def _prompts(engine) -> list[list[int]]:
    """A chat prompt and three of random token ids (lengths 37, 300, 700), fixed seed."""
    tok = engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content":
                                     "Name three uses of a paged KV cache in one sentence."}])
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    rand = [torch.randint(1000, vocab - 1000, (n,), generator=g).tolist() for n in (37, 300, 700)]
    return [tok.encode(chat)] + rand


def last_logits(engine, prompt: list[int]) -> torch.Tensor:
    """float32 ``[vocab]`` logits of ``prompt``'s last token, on the host (one greedy token is
    generated; the model runner's output is recorded on its way to the sampler)."""
    from engine_min.sampler import SamplingParams
    seen: list[torch.Tensor] = []
    run = engine.runner.execute

    def execute(sched_out):
        ordered, logits = run(sched_out)
        if logits.shape[0]:
            seen.append(logits[-1].float().cpu())          # [vocab]
        return ordered, logits

    engine.runner.execute = execute
    try:
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        del engine.runner.execute                          # the class's method again
    return seen[-1]


def _greedy(engine, prompt: list[int], n: int = 16) -> list[int]:
    from engine_min.sampler import SamplingParams
    out = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0,
                                                   ignore_eos=True))
    return list(out[0].output_token_ids)


def _compare(engine, prompts, want) -> dict:
    diffs, top = [], []
    for p, w in zip(prompts, want):
        got = last_logits(engine, p)
        diffs.append((got - w).abs().max().item())
        top.append(int(got.argmax()) == int(w.argmax()))
    return {"max_abs_diff": max(diffs), "per_prompt_max_abs_diff": diffs,
            "top1_agree": sum(top), "prompts": len(top)}


def model_logits_check(device: str, model: str | None = None) -> dict:
    """The real model's logits on ``device`` vs CPU float32 (see module docstring); ``model``:
    a model file or folder (None: the embedded SmolLM2-135M-Instruct GGUF)."""
    kv_bytes = 64 << 20
    cpu = _engine(model, "cpu", "float32", kv_bytes)
    prompts = _prompts(cpu)
    want = [last_logits(cpu, p) for p in prompts]
    want_greedy = _greedy(cpu, prompts[0])
    del cpu
    res: dict = {}
    dev32 = _engine(model, device, "float32", kv_bytes)
    res["float32"] = _compare(dev32, prompts, want)
    res["float32"]["greedy_same"] = _greedy(dev32, prompts[0]) == want_greedy
    from engine_min.config import EngineConfig
    default = EngineConfig(device=device).dtype           # the device's default dtype
    del dev32
    ok = res["float32"]["max_abs_diff"] <= FP32_TOL and res["float32"]["greedy_same"]
    if default != "float32":
        dev = _engine(model, device, default, kv_bytes)
        res[default] = _compare(dev, prompts, want)
        del dev
        ok &= res[default]["top1_agree"] == len(prompts)
    res["fp32_tol"] = FP32_TOL
    return {"ok": bool(ok), **res}


def _ttft(engine, prompt: list[int]):
    from bench.long_doc_qa_ttft import _ttft as ttft
    return ttft(engine, prompt)


def long_doc_ttft_check(device: str, doc_tokens: int = 4000, questions: int = 3,
                        question_tokens: int = 24, chunk_size: int = 256,
                        model: str | None = None) -> dict:
    """Long-document TTFT on a store hit vs recompute on ``device`` (module docstring).

    One engine in the device's default dtype, its own prefix cache off; the document and the
    questions are random token ids (fixed seed). Recompute: each question with no connector.
    Then one question through a connector with an empty store (saves the document), then the
    others through it (hits).
    """
    from connectors.factory import create_connector
    n = doc_tokens + question_tokens + 8
    engine = _engine(model, device, None, (n + 64) * 30 * 2 * 3 * 64 * 4, max(512, n),
                     enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    doc = torch.randint(1000, vocab - 1000, (doc_tokens,), generator=g).tolist()
    qs = [torch.randint(1000, vocab - 1000, (question_tokens,), generator=g).tolist()
          for _ in range(questions + 1)]
    _ttft(engine, qs[0])                                     # warm-up (allocations, kernels)
    recompute, want = [], []
    for q in qs[1:]:
        t, out = _ttft(engine, doc + q)
        recompute.append(t)
        want.append(out.output_token_ids)
    kv_bytes = n * engine.model_config.kv_block_bytes(1, engine.config.torch_dtype.itemsize)
    conn = create_connector(cpu_bytes=f"{(2 * kv_bytes >> 20) + 16}MiB", chunk_size=chunk_size,
                            deadline_s=5.0)
    try:
        engine.set_connector(conn)
        t_cold, _ = _ttft(engine, doc + qs[0])               # the document is saved
        conn.wait_for_save(60)
        hit, loaded, same = [], [], True
        for q, w in zip(qs[1:], want):
            before = engine.stats()["kvstore_loaded_tokens"]
            t, out = _ttft(engine, doc + q)
            hit.append(t)
            loaded.append(engine.stats()["kvstore_loaded_tokens"] - before)
            same &= out.output_token_ids == w
    finally:
        engine.set_connector(None)
        conn.close()
    r, h = statistics.median(recompute), statistics.median(hit)
    return {"ok": bool(same and min(loaded) > 0), "dtype": engine.config.dtype,
            "doc_tokens": doc_tokens, "ttft_recompute_s": r, "ttft_hit_s": h,
            "ttft_cold_connector_s": t_cold, "speedup": r / h, "loaded_tokens_per_hit": loaded,
            "outputs_identical": bool(same), "ttft_recompute_runs_s": recompute,
            "ttft_hit_runs_s": hit}

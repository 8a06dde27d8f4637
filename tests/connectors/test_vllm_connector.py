"""KVStoreConnector on the real vLLM engine (CPU build), end to end, in-process: loads, saves,
fallbacks, the chat's second round, the namespace. Two engines sharing a daemon:
``test_vllm_daemon.py``; shared fixtures: ``vllm_fixtures.py``.

Skipped unless vLLM imports in the running interpreter; run it in the vLLM environment::

    tools/make_vllm_env.sh && .venv-vllm/bin/python -m pytest -q tests/connectors/test_vllm_connector.py

Engine starts: one in-process engine (prefix caching on, in-process store) for every test
below, and one fresh engine process (the no-connector baseline). The tests share that engine:
they run in file order and check counter deltas, so keep them in one file and in order.
"""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (tools/make_vllm_env.sh)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch  # noqa: E402

from bench.vllm_engine import MODEL_ID, make_document  # noqa: E402
from tests.connectors.vllm_fixtures import (  # noqa: E402, F401 - fixtures used by name
    BLOCK, CHUNK, MAX_TOKENS, ROUND1_TOKENS, Failing, Missing, baseline, chat, hf_kv, model_dir,
    paged_gather_ref, prompts)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(model_dir):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    ktc = KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="connectors.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"model_id": MODEL_ID, "chunk_size": CHUNK,
                                   "cpu_bytes": "128MiB", "store_name": "pytest"})
    llm = LLM(model=model_dir, dtype="float32", distributed_executor_backend="uni",
              max_model_len=2048, enforce_eager=True, seed=0, kv_cache_memory_bytes=192 << 20,
              enable_prefix_caching=True, kv_transfer_config=ktc)
    worker = get_kv_transfer_group()
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    assert llm.llm_engine.vllm_config.cache_config.block_size == BLOCK
    yield {"llm": llm, "w": worker, "s": sched}
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    ensure_kv_transfer_shutdown()   # the worker, and vLLM's process-wide handle on it: a later
    # engine in this process (test_vllm_hung_daemon's) would otherwise get this worker back


def _gen(engine, tokens, max_tokens: int = MAX_TOKENS,
         ignore_eos: bool = False) -> tuple[list[int], dict, dict]:
    """Generate greedily; return output ids and the worker/scheduler counter deltas."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    w, s = engine["w"], engine["s"]
    w0, s0 = dict(w.counters), dict(s.counters)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    out = engine["llm"].generate([TokensPrompt(prompt_token_ids=list(tokens))], params,
                                 use_tqdm=False)[0]
    assert w.flush(30)
    dw = {k: w.counters[k] - w0[k] for k in w0}
    ds = {k: s.counters[k] - s0[k] for k in s0}
    return list(out.outputs[0].token_ids), dw, ds


def test_cold_run_saves_full_chunks_and_matches_baseline(engine, prompts, baseline):
    out, dw, ds = _gen(engine, prompts["P"])
    assert out == baseline["P"]
    assert dw["saved_chunks"] == len(prompts["P"]) // CHUNK == 4
    # the tail past the full chunks is kept in BLOCK-token pieces: [1024, 1152) of 1229 tokens
    assert dw["saved_tail_chunks"] == (len(prompts["P"]) - 4 * CHUNK) // BLOCK == 1
    assert dw["loaded_tokens"] == 0 and ds["external_tokens"] == 0
    assert dw["dropped_saves"] == 0 and dw["save_errors"] == 0


def test_stored_chunks_equal_reference_kv_token_by_token(engine, prompts, model_dir):
    w = engine["w"]
    p = prompts["P"][:4 * CHUNK + BLOCK]
    keys = w.namespaces.base.chunk_keys(p)
    tail_ns = w.namespaces.tail(w.namespaces.base)                    # BLOCK-token pieces past the chunks
    assert tail_ns.layout.chunk_size == BLOCK and tail_ns != w.namespaces.base
    chunks = w.store.get_chunks(w.namespaces.base, keys)
    chunks += w.store.get_chunks(tail_ns, tail_ns.chunk_keys(p)[4 * CHUNK // BLOCK:])
    assert len(chunks) == 5 and all(c is not None for c in chunks)
    kv = torch.cat(chunks, dim=2)                       # [L, 2, 1152, H, D]
    assert tuple(kv.shape) == (30, 2, 1152, 3, 64) and kv.dtype == torch.float32
    ref = hf_kv(model_dir, p)
    worst = 0.0
    for layer, (k, v) in enumerate(ref):               # k, v: [H, T, D]
        for which, r in ((0, k), (1, v)):
            got = kv[layer, which].permute(1, 0, 2)      # [H, T, D]
            err = (got - r).abs().amax(dim=(0, 2))       # per token
            worst = max(worst, float(err.max()))
            bad = (err > 2e-3).nonzero().view(-1)
            assert bad.numel() == 0, f"layer {layer} {'KV'[which]} tokens {bad[:8].tolist()} differ"
    assert worst < 2e-3


def test_paged_scatter_gather_round_trip_slot_by_slot(engine):
    w = engine["w"]
    paged = w.worker.ensure_layout()
    assert paged is not None and paged.block_size == BLOCK
    cache = next(iter(w.worker.kv_caches.values()))
    scratch = torch.zeros_like(cache)
    g = torch.Generator().manual_seed(0)
    n_slots = scratch.shape[0] * BLOCK
    slots = torch.randperm(n_slots, generator=g)[:300]  # scattered, not block-aligned
    kv = torch.randn((2, 300, 3, 64), generator=g)
    for plan in (paged.plan(slots), ("offsets", paged.offsets(slots))):
        scratch.zero_()
        paged.scatter(scratch, plan, kv)
        assert int((scratch != 0).sum()) == kv.numel()    # nothing else written
        assert torch.equal(paged.gather(scratch, plan), kv)
    # contiguous slots take the strided-copy path; it must agree with the offset table
    run = torch.arange(5 * BLOCK + 17, 5 * BLOCK + 17 + 300)
    scratch.zero_()
    paged.scatter(scratch, paged.plan(run), kv)
    assert torch.equal(paged_gather_ref(scratch, paged.offsets(run)), kv)


def test_vllm_prefix_hit_means_no_store_load(engine, prompts, baseline):
    out, dw, ds = _gen(engine, prompts["P"])
    assert out == baseline["P"]
    assert ds["local_tokens"] == (len(prompts["P"]) - 1) // BLOCK * BLOCK   # vLLM's own hit
    assert dw["loaded_tokens"] == 0 and ds["external_tokens"] == 0


def test_after_prefix_cache_reset_the_store_supplies_the_prefix(engine, prompts, baseline):
    assert engine["llm"].reset_prefix_cache()
    out, dw, ds = _gen(engine, prompts["P"])
    assert out == baseline["P"]
    assert ds["local_tokens"] == 0
    assert dw["loaded_tokens"] == ds["external_tokens"] == 4 * CHUNK + BLOCK  # + tail piece
    assert dw["loaded_chunks"] == 4 and dw["loaded_tail_chunks"] == 1
    assert dw["load_errors"] == 0
    assert dw["saved_chunks"] == 0 and dw["saved_tail_chunks"] == 0   # already stored


def test_only_tokens_beyond_vllm_hit_are_loaded(engine, prompts, baseline):
    assert engine["llm"].reset_prefix_cache()
    out, dw, ds = _gen(engine, prompts["Q"])            # shares P's first 600 tokens
    assert out == baseline["Q"]
    assert dw["loaded_tokens"] == 2 * CHUNK             # P's chunks 0 and 1 match Q
    out, dw, ds = _gen(engine, prompts["P"])
    assert out == baseline["P"]
    assert ds["local_tokens"] == 600 // BLOCK * BLOCK == 512   # vLLM has Q's common blocks
    assert dw["loaded_tokens"] == 4 * CHUNK - 512 + BLOCK     # only the rest comes from us
    assert dw["loaded_chunks"] == 2 and dw["loaded_tail_chunks"] == 1


def test_store_load_error_falls_back_to_recompute(engine, prompts, baseline):
    assert engine["llm"].reset_prefix_cache()
    w = engine["w"]
    real = w.store
    w.store = Failing(real, {"get_chunks"})
    try:
        out, dw, ds = _gen(engine, prompts["P"])
    finally:
        w.store = real
    assert out == baseline["P"]
    assert ds["external_tokens"] == 4 * CHUNK + BLOCK
    assert dw["load_errors"] == 1       # the full chunks; the tail piece after them is not read
    assert dw["loaded_tokens"] == 0


def test_lookup_deadline_means_prefill(engine, prompts, baseline):
    assert engine["llm"].reset_prefix_cache()
    s = engine["s"]
    real = s.store
    s.store = Failing(real, {"lookup_keys"})
    try:
        out, dw, ds = _gen(engine, prompts["P"])
    finally:
        s.store = real
    assert out == baseline["P"]
    assert ds["lookup_errors"] == 1 and ds["external_tokens"] == 0 and dw["loaded_tokens"] == 0


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_a_chunk_missing_at_load_time_is_recomputed_from_there(engine, prompts, baseline,
                                                                layerwise):
    """kv_load_failure_policy="recompute": chunk 2 of P is gone when the load reads it, so
    chunks 0-1 land, vLLM recomputes from token 512 on, and the answer is unchanged."""
    assert engine["llm"].reset_prefix_cache()
    w = engine["w"]
    real, default, w.worker.layerwise = w.store, w.worker.layerwise, layerwise
    w.store = Missing(real, w.namespaces.base, 2)
    try:
        out, dw, ds = _gen(engine, prompts["P"])
    finally:
        w.store, w.worker.layerwise = real, default
    assert out == baseline["P"]
    assert ds["external_tokens"] == 4 * CHUNK + BLOCK
    assert dw["loaded_tokens"] == 2 * CHUNK and dw["loaded_chunks"] == 2
    assert dw["loaded_tail_chunks"] == 0 and dw["load_errors"] == 1


def test_layerwise_and_whole_loads_give_the_no_store_answer(engine, prompts, baseline):
    """The same hit (P after a prefix-cache reset) loaded layer by layer (each attention layer
    waits for its own layer, in layer order) and whole (the default on CPU)."""
    w = engine["w"]
    assert w.options.layerwise_load is None and w.worker.layerwise is False  # auto, CPU caches
    waited: list[str] = []
    real_wait = w.worker.wait_layer

    def record(name):
        if w.worker._load is not None:
            waited.append(name)
        real_wait(name)

    w.worker.wait_layer = record
    try:
        for layerwise in (True, False):
            w.worker.layerwise = layerwise
            waited.clear()
            assert engine["llm"].reset_prefix_cache()
            out, dw, ds = _gen(engine, prompts["P"])
            assert out == baseline["P"], layerwise
            assert dw["loaded_tokens"] == 4 * CHUNK + BLOCK and dw["load_errors"] == 0
            # layer-wise: the load step's 30 attention layers each waited for their own layer
            assert waited == (w.worker.layer_names if layerwise else []), layerwise
    finally:
        w.worker.wait_layer = real_wait
        w.worker.layerwise = False


def test_chat_round_2_hits_round_1_prompt_and_answer(engine, chat, baseline):
    """Round 1 (U1, 1219..1279 tokens, answer of ROUND1_TOKENS = 190 tokens): the KV of every
    token but the last sampled one is computed, end = len(U1) + 189 in [1408, 1469).
    Prefill saves chunks 0-3 and piece [1024, 1152); decoding fills chunk 4 [1024, 1280) at
    token 1280 and piece [1280, 1408) at token 1408, each saved at that step. Round 2 (U1 +
    answer + U2), after vLLM's own prefix cache is reset, loads 5 chunks + 1 piece = 1408
    tokens: all of U1 and the answer's first 1408 - len(U1) tokens."""
    u1 = chat["U1"]
    out1, dw, ds = _gen(engine, u1, max_tokens=ROUND1_TOKENS, ignore_eos=True)
    assert out1 == baseline["chat"][0] and len(out1) == ROUND1_TOKENS
    assert ds["external_tokens"] == 0                         # a new document
    assert dw["saved_chunks"] == 5 and dw["saved_tail_chunks"] == 2
    assert dw["dropped_saves"] == 0 and dw["save_errors"] == 0
    assert engine["llm"].reset_prefix_cache()
    out2, dw, ds = _gen(engine, u1 + out1 + chat["U2"])
    assert out2 == baseline["chat"][1]
    assert ds["local_tokens"] == 0
    assert ds["external_tokens"] == dw["loaded_tokens"] == 5 * CHUNK + BLOCK == 1408
    assert dw["loaded_chunks"] == 5 and dw["loaded_tail_chunks"] == 1
    assert dw["load_errors"] == 0 and 1408 - len(u1) > 128   # answer tokens came from the store


def test_a_save_left_at_request_end_keeps_the_blocks_until_copied_out(engine, model_dir):
    """request_finished's delayed free: with the per-step saves held back (as when a unit's
    last token id is not known at its step, under async scheduling), every unit of a request
    is left when it finishes; vLLM keeps its blocks until the next step has copied them out
    and get_finished reported the request, then frees them."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    u = tok.encode(make_document(3, 16) + "\nQuestion: how many arches has Fir2?\nAnswer:")
    end = len(u) + MAX_TOKENS - 1            # KV computed: all but the last sampled token
    assert 2 * CHUNK <= end and end % CHUNK >= BLOCK, end   # 2 chunks + 1 piece
    s, w = engine["s"], engine["w"]
    sched = engine["llm"].llm_engine.engine_core.engine_core.scheduler
    real = s.scheduler._saves
    s.scheduler._saves = lambda req_id, state, done, blocks: (
        real(req_id, state, done, blocks) if state.request.is_finished() else [])
    try:
        w0 = dict(w.counters)
        _gen(engine, u, ignore_eos=True)
        assert len(sched.requests) == 1                      # finished, blocks kept
        assert w.counters["saved_chunks"] == w0["saved_chunks"]
        assert engine["llm"].reset_prefix_cache() is False   # blocks still held
        _gen(engine, list(range(2000, 2010)))               # one more step: copied, freed
        assert len(sched.requests) == 0
    finally:
        s.scheduler._saves = real
    assert w.flush(30)
    assert w.counters["saved_chunks"] - w0["saved_chunks"] == 2
    assert w.counters["saved_tail_chunks"] - w0["saved_tail_chunks"] == 1
    assert engine["llm"].reset_prefix_cache()


def test_namespace_names_what_vllm_loaded(engine, prompts, model_dir):
    """Scheduler and worker build one namespace from vLLM's config: the model id, the content
    fingerprint of the folder vLLM loaded, its dtype and RoPE, and the KV layout; keys follow
    it, so another weights file (engine_min's GGUF included) never shares these chunks."""
    from engine_min.identity import weights_fingerprint
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    w, s = engine["w"], engine["s"]
    ns = s.namespaces.base
    assert w.namespaces.base == ns
    assert (ns.model_id, ns.revision) == (MODEL_ID, "")
    assert ns.layout == KVLayout(30, 3, 64, "float32", CHUNK)
    assert ns.weights_fingerprint == weights_fingerprint(model_dir) != ""
    assert (ns.compute_dtype, ns.quantization, ns.kv_quantization, ns.adapter) == \
        ("float32", "", "", "")
    # RoPE in kvstore.keys.rope_identity's form, the one engine_min's connector writes too
    assert json.loads(ns.rope) == {"theta": 100000.0, "scaling": None}
    bare = Namespace(MODEL_ID, ns.layout)
    assert set(ns.chunk_keys(prompts["P"])).isdisjoint(bare.chunk_keys(prompts["P"]))

"""Layer-wise loads of EngineMinConnector on the real model (SmolLM2-135M, 30 layers, one engine
for the module): a hit's chunks are written into the pool layer after layer while the forward
pass runs, and layer ``i``'s attention waits for layer ``i`` only.

Engine: block size 4, its own prefix cache off (every reuse goes through the store). Store:
in-process CPU tier, chunks of 16 tokens, tail pieces of 4. The prompt: 150 tokens, so a hit
loads 148 of them (9 chunks + 1 piece: ``floor_4(149)``) and prefills 2.

Narrated scenarios:
- greedy tokens with layer-wise loads == whole loads == no store, with the same hit counts;
- the order: every piece's write of layer ``i`` is recorded before layer ``i`` writes or reads
  its KV cache, and the forward pass starts before the last layer is written (it overlaps);
- a write that fails in layer 5: the request still answers the no-store tokens (its 148 loaded
  tokens are run again), one fallback is counted, and no reader pin is left;
- a load slower than the step's deadline: stopped part-way, the same tokens, no pin left;
- a forward pass that raises mid-load: the request fails alone, the load still finishes and
  its pins go back;
- the flag: ``--kvstore-layerwise-load on|off|auto`` and its refusal without a store.
"""
from __future__ import annotations

import argparse
import time

import pytest
import torch

import connectors.engine_min_layers as layers_mod
import engine_min.model as model_mod
from connectors.engine_min import EngineMinConnector
from connectors.flags import StoreFlagError, add_store_args, connector_from_args
from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams
from kvstore.config import StoreConfig
from kvstore.store import ChunkStore

BS, C, F = 4, 16, 4
PROMPT_TOKENS, OUT_TOKENS = 150, 4
HIT = (PROMPT_TOKENS - 1) // F * F       # 148: 9 full chunks + 1 piece of 4
TEXT = ("The old harbor of the town was rebuilt in 1874 after a storm destroyed the piers. "
        "Fishermen sold their catch at the market next to the customs house every morning, "
        "and the lighthouse keeper wrote the weather into a ledger that is still kept in the "
        "archive. In winter the canal froze and children skated to the granary; in spring "
        "the council opened the bridge to carts again. ") * 3


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(block_size=BS, kv_cache_bytes=32 * 2**20,
                                 enable_prefix_caching=False))
    yield eng
    eng.set_connector(None)


@pytest.fixture(scope="module")
def prompt(engine):
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


@pytest.fixture(scope="module")
def baseline(engine, prompt):
    """Greedy tokens of the prompt without a store."""
    engine.set_connector(None)
    return run(engine, prompt)[0]


def run(engine, ids):
    """(output ids, num_cached_tokens) of one greedy request."""
    out = engine.generate([list(ids)], SamplingParams(max_tokens=OUT_TOKENS, temperature=0.0,
                                                      ignore_eos=True))[0]
    return out.output_token_ids, out.num_cached_tokens


def stored_connector(engine, prompt, layerwise, deadline_s=60.0):
    """A connector (layer-wise or not) whose store holds the prompt's chunks and pieces, saved
    by one run of the prompt through it."""
    store = ChunkStore(StoreConfig(cpu_bytes="64MiB"))
    conn = EngineMinConnector(store, chunk_size=C, tail_chunk_size=F, deadline_s=deadline_s,
                              deadline_s_per_chunk=0.0, layerwise_load=layerwise)
    engine.set_connector(conn)
    assert conn.layerwise_load is layerwise
    assert run(engine, prompt)[1] == 0
    assert conn.wait_for_save(60)
    return conn


def no_pins_left(store, timeout_s=5.0) -> bool:
    """Reader pins all released (the load worker may still be returning)."""
    end = time.monotonic() + timeout_s
    while store._pins.pinned_keys() and time.monotonic() < end:
        time.sleep(0.01)
    return store._pins.pinned_keys() == set()


def layer_of(kv: torch.Tensor, pool: torch.Tensor) -> int:
    """Index of the layer a view of ``pool`` (``pool[i]`` or ``pool[i:i+1]``) starts at."""
    return (kv.data_ptr() - pool.data_ptr()) // (pool[0].numel() * pool.element_size())


def test_layerwise_hit_answers_the_same_tokens_as_whole_loads_and_no_store(engine, prompt,
                                                                           baseline):
    counts = {}
    for layerwise in (False, True):
        conn = stored_connector(engine, prompt, layerwise)
        try:
            out, cached = run(engine, prompt)
            assert out == baseline, f"layerwise={layerwise}"
            st = conn.get_stats()
            counts[layerwise] = (cached, st["external_prefix_cache_hits"],
                                 st["kvstore_loaded_chunks"], st["kvstore_loaded_tail_chunks"],
                                 st["kvstore_fallbacks"])
            assert conn.store._pins.pinned_keys() == set()
            conn.store.check_integrity()
        finally:
            engine.set_connector(None)
            conn.close()
    assert counts[True] == counts[False] == (HIT, HIT, 9, 1, 0)


def test_each_layer_waits_for_its_load_and_the_forward_overlaps_it(engine, prompt, baseline,
                                                                   monkeypatch):
    conn = stored_connector(engine, prompt, True)
    pool, log = engine.kv_cache, []
    real_scatter, real_cache = layers_mod.ops.scatter_chunk, model_mod.ops.reshape_and_cache

    def slow_scatter(kv_cache, block_ids, src):      # one piece, one layer
        time.sleep(0.002)
        real_scatter(kv_cache, block_ids, src)
        log.append(("written", layer_of(kv_cache, pool)))

    def cache(key, value, kv_layer, slot_mapping):   # layer i's first touch of its KV
        log.append(("attn", layer_of(kv_layer, pool)))
        real_cache(key, value, kv_layer, slot_mapping)

    monkeypatch.setattr(layers_mod.ops, "scatter_chunk", slow_scatter)
    monkeypatch.setattr(model_mod.ops, "reshape_and_cache", cache)
    try:
        out, cached = run(engine, prompt)
    finally:
        engine.set_connector(None)
        conn.close()
    assert (out, cached) == (baseline, HIT)
    L = engine.model_config.num_layers
    step = log[:log.index(("attn", L - 1)) + 1]      # the hit's step (the decodes follow)
    for i in range(L):
        writes = [k for k, e in enumerate(step) if e == ("written", i)]
        assert len(writes) == 10, f"layer {i}: 9 chunks + 1 piece"   # every piece, once
        assert max(writes) < step.index(("attn", i)), f"layer {i} ran before its load"
    # layer-wise indeed: layer 0's attention ran before the last layer was written
    assert step.index(("attn", 0)) < step.index(("written", L - 1))


def test_a_write_failing_in_layer_5_recomputes_and_releases_every_pin(engine, prompt, baseline,
                                                                      monkeypatch, caplog):
    conn = stored_connector(engine, prompt, True)
    pool, real_scatter = engine.kv_cache, layers_mod.ops.scatter_chunk

    def failing(kv_cache, block_ids, src):
        if layer_of(kv_cache, pool) == 5:
            raise RuntimeError("copy engine on fire")
        real_scatter(kv_cache, block_ids, src)

    monkeypatch.setattr(layers_mod.ops, "scatter_chunk", failing)
    try:
        out, cached = run(engine, prompt)
        st = conn.get_stats()
    finally:
        engine.set_connector(None)
        conn.close()
    assert (out, cached) == (baseline, 0)      # the 148 tokens were run again
    assert (st["kvstore_load_fallbacks"], st["kvstore_load_failed_tokens"]) == (1, HIT)
    assert st["external_prefix_cache_hits"] == 0
    assert any("copy engine on fire" in r.message for r in caplog.records)
    assert no_pins_left(conn.store)
    conn.store.check_integrity()


def test_a_load_past_its_deadline_stops_part_way_and_recomputes(engine, prompt, baseline,
                                                                monkeypatch, caplog):
    conn = stored_connector(engine, prompt, True, deadline_s=0.3)
    real_scatter = layers_mod.ops.scatter_chunk

    def slow(kv_cache, block_ids, src):         # 30 layers x 10 pieces x 20 ms = 6 s
        time.sleep(0.02)
        real_scatter(kv_cache, block_ids, src)

    monkeypatch.setattr(layers_mod.ops, "scatter_chunk", slow)
    try:
        t0 = time.perf_counter()
        out, cached = run(engine, prompt)
        took = time.perf_counter() - t0
        st = conn.get_stats()
    finally:
        engine.set_connector(None)
        conn.close()
    assert (out, cached) == (baseline, 0)
    assert st["kvstore_load_fallbacks"] == 1 and st["kvstore_load_failed_tokens"] == HIT
    assert any("missed its deadline" in r.message for r in caplog.records)
    # the engine waited the deadline (0.3 s) and the layer being written, not the 6 s load
    assert st["kvstore_load_seconds_max"] < 2.0 and took < 6.0
    assert no_pins_left(conn.store)


def test_a_forward_raising_mid_load_fails_the_request_and_releases_the_pins(engine, prompt,
                                                                           baseline,
                                                                           monkeypatch):
    conn = stored_connector(engine, prompt, True)
    real_cache, pool = model_mod.ops.reshape_and_cache, engine.kv_cache
    real_scatter = layers_mod.ops.scatter_chunk
    pinned_at_fault = []

    def slow_scatter(kv_cache, block_ids, src):   # ~300 ms in all: in flight at layer 3
        time.sleep(0.001)
        real_scatter(kv_cache, block_ids, src)

    def fault(key, value, kv_layer, slot_mapping):
        if layer_of(kv_layer, pool) == 3 and key.shape[0] == PROMPT_TOKENS - HIT:
            pinned_at_fault.append(len(conn.store._pins.pinned_keys()))
            raise RuntimeError("kernel fault")
        real_cache(key, value, kv_layer, slot_mapping)

    monkeypatch.setattr(model_mod.ops, "reshape_and_cache", fault)
    monkeypatch.setattr(layers_mod.ops, "scatter_chunk", slow_scatter)
    try:
        out = engine.generate([list(prompt)], SamplingParams(max_tokens=OUT_TOKENS))[0]
        monkeypatch.setattr(model_mod.ops, "reshape_and_cache", real_cache)
        assert no_pins_left(conn.store)
        conn.store.check_integrity()
        again = run(engine, prompt)     # the engine and the store serve the next request
    finally:
        engine.set_connector(None)
        conn.close()
    assert out.finish_reason == "error" and "kernel fault" in out.error
    assert pinned_at_fault and pinned_at_fault[0] > 0   # the load held pages at the fault
    assert again == (baseline, HIT)


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_store_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("value, want", [("on", True), ("off", False), ("auto", False),
                                         (None, False)])
def test_the_flag_chooses_layerwise_loads_auto_is_whole_on_the_cpu(value, want):
    argv = ["--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "8"]
    conn = connector_from_args(parse(*argv, *(["--kvstore-layerwise-load", value]
                                              if value else [])))
    try:
        conn.register_kv_caches(torch.zeros(2, 2, 8, 4, 1, 8), 4)
        assert conn.layerwise_load is want
    finally:
        conn.close()


def test_the_flag_without_a_store_is_refused_and_bad_values_are_named():
    with pytest.raises(StoreFlagError, match="--kvstore-layerwise-load needs a store"):
        connector_from_args(parse("--kvstore-layerwise-load", "on"))
    assert connector_from_args(parse("--kvstore-layerwise-load", "auto")) is None
    store = ChunkStore(StoreConfig(cpu_bytes="1MiB"))
    with pytest.raises(ValueError, match="layerwise_load must be True, False or None"):
        EngineMinConnector(store, layerwise_load="yes")
    store.close()


@pytest.mark.gpu
def test_cuda_pool_auto_is_layerwise_and_a_hit_answers_as_whole_loads():
    """On CUDA (skipped elsewhere): ``auto`` resolves to layer-wise, whose copies run on a side
    stream with one event per layer; a hit answers the tokens of whole loads and of no store,
    with the same hit, and leaves no reader pin."""
    eng = LLMEngine(EngineConfig(device="cuda", dtype="float32", block_size=BS,
                                 kv_cache_bytes=32 * 2**20, enable_prefix_caching=False))
    ids = eng.tokenizer.encode(TEXT)[:PROMPT_TOKENS]
    want = run(eng, ids)[0]
    for layerwise, want_resolved in ((False, False), (None, True)):
        store = ChunkStore(StoreConfig(cpu_bytes="64MiB"))
        conn = EngineMinConnector(store, chunk_size=C, tail_chunk_size=F, deadline_s=60.0,
                                  layerwise_load=layerwise)
        eng.set_connector(conn)
        try:
            assert conn.layerwise_load is want_resolved
            assert run(eng, ids) == (want, 0)
            assert conn.wait_for_save(60)
            assert run(eng, ids) == (want, HIT), f"layerwise_load={layerwise}"
            assert no_pins_left(store) and conn.get_stats()["kvstore_fallbacks"] == 0
        finally:
            eng.set_connector(None)
            conn.close()

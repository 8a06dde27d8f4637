"""vLLM and engine_min share chunks through one ``kvstore serve`` daemon, tail pieces on, on the
real model (SmolLM2-135M-Instruct as the safetensors folder ``bench.vllm_model.convert`` writes,
loaded by both engines, so the two namespaces agree: model id, weights fingerprint, float32,
RoPE (``kvstore.keys.rope_identity``), KV layout, chunk size 256, one model id given to both, tail pieces of vLLM's CPU block
size 128, which engine_min is given with ``tail_chunk_size``).

engine_min stores a document question that vLLM then loads, and vLLM stores another that
engine_min then loads: hit counts are what the chunk and piece arithmetic says (4 chunks + 1
piece = 1152 tokens), and each engine's greedy output equals its own without a store.

Skipped unless vLLM imports (run it in the vLLM environment, as ``make test-vllm`` does).
"""
from __future__ import annotations

import json
import os
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (tools/make_vllm_env.sh)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from bench.vllm_engine import MODEL_ID, Daemon, run_child  # noqa: E402
from tests.connectors.vllm_fixtures import (  # noqa: E402, F401 - fixtures used by name
    BLOCK, CHUNK, MAX_TOKENS, baseline, chat, model_dir, prompts, sharing_prompts)

pytestmark = pytest.mark.slow
HIT = 4 * CHUNK + BLOCK   # 1152: 4 chunks of 256 + one piece of vLLM's CPU block size, 128


def test_vllm_and_engine_min_share_chunks_through_one_daemon(model_dir, baseline):
    from connectors.factory import create_connector
    from engine_min.config import EngineConfig
    from engine_min.engine import LLMEngine
    from engine_min.sampler import SamplingParams
    p, r = sharing_prompts(model_dir)   # two document questions, 4 chunks + 1 piece each
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    # vLLM's own answers without any store (the shared no-connector baseline process)
    vllm_own = baseline["sharing"]
    eng = LLMEngine(EngineConfig(model=model_dir, block_size=16, kv_cache_bytes=256 << 20,
                                 enable_prefix_caching=False))
    own = [o.output_token_ids for o in eng.generate([p, r], greedy)]
    with Daemon("512MiB") as d:
        # the model id vLLM's connector is given (bench.vllm_engine: MODEL_ID); engine_min
        # would name the folder by its name, vLLM by its served name
        conn = create_connector(url=d.url, chunk_size=CHUNK, tail_chunk_size=BLOCK,
                                deadline_s=60.0, model_id=MODEL_ID)
        eng.set_connector(conn)
        try:
            # engine_min computes p and stores it: 4 chunks + 1 piece of 128 tokens
            out = eng.generate([p], greedy)[0]
            assert (out.output_token_ids, out.num_cached_tokens) == (own[0], 0)
            assert conn.wait_for_save(60)
            # vLLM loads p from engine_min's chunks, then computes r and stores it
            res = run_child({"model_dir": model_dir, "connector": "ours-daemon", "url": d.url,
                             "warmup": False, "max_tokens": MAX_TOKENS, "prompts": [p, r],
                             "extra": {"chunk_size": CHUNK}})["results"]
            after_p, after_r = res[0]["connector"]["worker"], res[1]["connector"]["worker"]
            assert res[0]["output_ids"] == vllm_own[0]
            assert after_p["loaded_tokens"] == HIT and after_p["load_errors"] == 0
            assert after_p["saved_chunks"] == 0
            assert res[1]["output_ids"] == vllm_own[1]
            assert after_r["loaded_tokens"] == HIT              # r loaded nothing
            assert after_r["saved_chunks"] == 4 and after_r["saved_tail_chunks"] == 1
            # engine_min loads r from vLLM's chunks
            st0 = eng.stats()
            out = eng.generate([r], greedy)[0]
            assert (out.output_token_ids, out.num_cached_tokens) == (own[1], HIT)
            st = eng.stats()
            assert st["kvstore_loaded_chunks"] - st0["kvstore_loaded_chunks"] == 4
            assert st["kvstore_loaded_tail_chunks"] - st0["kvstore_loaded_tail_chunks"] == 1
            req = urllib.request.Request(d.url + "/v1/stats")
            with urllib.request.urlopen(req, timeout=10) as f:
                stats = json.loads(f.read())
        finally:
            eng.set_connector(None)
            conn.close()
    # one chunk namespace and one tail namespace, both engines' (same keys, same layout):
    # 4 chunks and 1 piece of each prompt
    held = {n["ns_id"]: n["num_chunks"] for n in stats["namespaces"]}
    assert held == {conn.ns.ns_id.hex(): 8, conn.tail_ns.ns_id.hex(): 2}

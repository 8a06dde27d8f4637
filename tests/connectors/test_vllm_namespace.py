"""vLLM's connector builds its chunk-key namespace from vLLM's config (no vLLM needed: the
config is stood in by plain objects): every ingredient that changes the KV of the same token ids
(weights fingerprint, revision, dtype, weight and KV-cache quantization, RoPE, chunk size, model
id) gives another namespace, and a request's cache salt and LoRA adapter are added to it."""
from __future__ import annotations

import dataclasses
import json
import types

import pytest

from connectors.vllm.identity import adapter_identity, request_namespace, vllm_namespace
from engine_min.identity import weights_fingerprint
from kvstore.layout import KVLayout

LAYOUT = KVLayout(30, 3, 64, "float32", 16)


def _vllm_config(model: str, **mc_kw):
    hf = types.SimpleNamespace(rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    mc = types.SimpleNamespace(model=model, served_model_name=["served/a", "b"], revision=None,
                               dtype="torch.float32", quantization=None, hf_text_config=hf)
    for k, v in mc_kw.items():
        setattr(mc, k, v)
    cache = types.SimpleNamespace(cache_dtype="auto", calculate_kv_scales=False,
                                  kv_cache_dtype_skip_layers=[])
    return types.SimpleNamespace(model_config=mc, cache_config=cache)


def test_vllm_namespace_takes_every_kv_ingredient_from_vllms_config(tmp_path):
    import torch
    from safetensors.torch import save_file
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(3)}, str(folder / "model.safetensors"))
    cfg = _vllm_config(str(folder))
    ns = vllm_namespace(cfg, LAYOUT, {})
    assert ns.model_id == "served/a" and ns.revision == ""
    assert ns.weights_fingerprint == weights_fingerprint(str(folder)) != ""
    assert ns.compute_dtype == "float32" and ns.quantization == "" and ns.kv_quantization == ""
    assert ns.rope == '{"scaling":null,"theta":100000.0}'    # engine_min's connector's form
    variants = {
        "revision": vllm_namespace(_vllm_config(str(folder), revision="abc"), LAYOUT, {}),
        "dtype": vllm_namespace(_vllm_config(str(folder), dtype="torch.bfloat16"), LAYOUT, {}),
        "quant": vllm_namespace(_vllm_config(str(folder), quantization="awq"), LAYOUT, {}),
        "rope": vllm_namespace(_vllm_config(str(folder), hf_text_config=types.SimpleNamespace(
            rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})), LAYOUT, {}),
        "chunk": vllm_namespace(cfg, dataclasses.replace(LAYOUT, chunk_size=32), {}),
        "model_id": vllm_namespace(cfg, LAYOUT, {"model_id": "x/y"}),
        "fp_off": vllm_namespace(cfg, LAYOUT, {"weights_fingerprint": "off"}),
    }
    fp8 = _vllm_config(str(folder))
    fp8.cache_config.cache_dtype = "fp8"
    variants["kv_quant"] = vllm_namespace(fp8, LAYOUT, {})
    assert variants["kv_quant"].kv_quantization == \
        '{"cache_dtype":"fp8","calculate_kv_scales":false}'
    assert variants["fp_off"].weights_fingerprint == ""
    assert variants["rope"].rope == \
        '{"scaling":{"factor":4.0,"rope_type":"linear"},"theta":10000.0}'
    assert len({ns.ns_id} | {v.ns_id for v in variants.values()}) == 1 + len(variants)
    # other weights in the same folder layout -> another namespace
    save_file({"w": torch.full((3,), 2.0)}, str(folder / "model.safetensors"))
    assert vllm_namespace(_vllm_config(str(folder)), LAYOUT, {}).ns_id != ns.ns_id
    # a hub id that is not a local path: no fingerprint (revision names the weights)
    assert vllm_namespace(_vllm_config("org/not-local"), LAYOUT, {}).weights_fingerprint == ""


def test_vllm_request_namespace_adds_salt_and_lora_adapter(tmp_path):
    import torch
    from safetensors.torch import save_file
    base = vllm_namespace(_vllm_config("org/not-local"), LAYOUT, {})
    adapter = tmp_path / "lora"
    adapter.mkdir()
    save_file({"lora_A": torch.ones(2, 2)}, str(adapter / "adapter_model.safetensors"))
    lora = types.SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path=str(adapter))
    other = types.SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path="/absent/path")
    assert request_namespace(base, "", None) == base
    with_lora = request_namespace(base, "", lora)
    assert with_lora.adapter == json.dumps({"weights": weights_fingerprint(str(adapter))},
                                           separators=(",", ":"))
    assert adapter_identity(other) == '{"name":"sql","path":"/absent/path"}'
    ids = {base.ns_id, with_lora.ns_id, request_namespace(base, "t", None).ns_id,
           request_namespace(base, "", other).ns_id}
    assert len(ids) == 4


def test_rope_is_named_alike_by_vllm_and_engine_min(tmp_path):
    """The same model's RoPE, read by vLLM (its HF config) and by engine_min (GGUF or HF
    folder), gives one namespace field: ``type`` is ``rope_type``, a default type is no
    scaling, ``rope_theta`` inside the scaling dict is dropped and numbers are floats."""
    import torch
    from safetensors.torch import save_file
    from connectors.engine_min import EngineMinConnector
    from kvstore.config import StoreConfig
    from kvstore.keys import rope_identity
    from kvstore.store import ChunkStore
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(3)}, str(folder / "model.safetensors"))
    llama3 = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1.0,
              "high_freq_factor": 4, "original_max_position_embeddings": 8192}
    cases = [  # (vLLM's hf_text_config, engine_min's (theta, scaling))
        (types.SimpleNamespace(rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
         (100000.0, None)),
        (types.SimpleNamespace(rope_theta=100000, rope_scaling={"type": "default"}),
         (100000.0, None)),
        (types.SimpleNamespace(rope_parameters={"rope_theta": 500000.0, **llama3}),
         (500000.0, {**llama3, "rope_theta": 500000.0})),
        (types.SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 4.0}),
         (10000.0, {"rope_type": "linear", "factor": 4})),
    ]
    seen = set()
    for hf, (theta, scaling) in cases:
        v = vllm_namespace(_vllm_config(str(folder), hf_text_config=hf), LAYOUT, {})
        conn = EngineMinConnector(ChunkStore(StoreConfig(cpu_bytes="8MiB")), chunk_size=32)
        conn.register_model({"rope": json.dumps({"theta": theta, "scaling": scaling})})
        conn.register_kv_caches(torch.zeros(30, 2, 2, 16, 3, 64), 16)
        e = conn.ns
        conn.close()
        assert v.rope == e.rope == json.dumps(rope_identity(theta, scaling), sort_keys=True,
                                               separators=(",", ":"))
        seen.add(v.rope)
    assert len(seen) == 3                       # default twice, llama3, linear
    assert any('"factor":8.0' in r for r in seen)
    with pytest.raises(TypeError, match="scaling"):
        rope_identity(1e4, "linear")

"""Different weights never share chunks: everything that changes the KV of the same token ids
is in the chunk-key namespace by default (weights fingerprint, KV dtype, RoPE, chunk size, model
id and revision), for engine_min's connector and vLLM's.

The failing input (issue: models share chunks): two engines on one ``kvstore serve`` daemon, one
on the shipped GGUF and one on a copy whose ``blk.0.attn_norm.weight`` is doubled (same
architecture and KV layout), a 70-token prompt, chunks of 16 tokens. The second engine used to
load the first one's chunks and answer differently; now it finds nothing and answers as its own
recompute does.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from connectors.engine_min import EngineMinConnector
from connectors.factory import create_connector
from engine_min.config import EngineConfig, ModelConfig
from engine_min.engine import LLMEngine
from engine_min.identity import (kv_identity, model_name, strip_quant_tag,
                                 weights_fingerprint)
from engine_min.sampler import SamplingParams
from engine_min.weights import default_model_path, open_gguf
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import create_app
from kvstore.daemon.run import ThreadedServer
from kvstore.store import ChunkStore

CHUNK, BS, PROMPT_LEN, MAX_TOKENS = 16, 16, 70, 12
LAYOUT = KVLayout(30, 3, 64, "float32", CHUNK)
SHIPPED_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


# ---- the modified model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"shipped": path, "doubled": copy with blk.0.attn_norm.weight x2, "renamed": an
    unchanged byte copy under another name}."""
    d = tmp_path_factory.mktemp("models")
    shipped = default_model_path()
    doubled = d / "SmolLM2-135M-Instruct-doubled-norm.Q4_1.gguf"
    renamed = d / "another-name.gguf"
    shutil.copyfile(shipped, doubled)
    shutil.copyfile(shipped, renamed)
    from gguf import GGUFReader
    writable = GGUFReader(str(doubled), "r+")   # tensors are writable views of the file
    (t,) = [t for t in writable.tensors if t.name == "blk.0.attn_norm.weight"]
    assert t.tensor_type.name == "F32" and t.data.shape == (576,)
    before = np.array(t.data)
    t.data[:] = before * 2
    writable.data.flush()
    del writable, t
    check = open_gguf(str(doubled))
    (t2,) = [t for t in check.tensors if t.name == "blk.0.attn_norm.weight"]
    assert np.array_equal(np.array(t2.data), before * 2)
    return {"shipped": shipped, "doubled": str(doubled), "renamed": str(renamed)}


def _prompt(engine: LLMEngine) -> list[int]:
    text = ("The harbor council met on a cold morning to discuss the bridge, the archive and "
            "the lantern festival. Every member brought a ledger, a compass and a long list of "
            "questions about the granary, the canal and the winter market. The first speaker, "
            "an old ferryman, said that the river had risen twice in one week and that the "
            "quarry road was closed. What should the council do first, and why?")
    ids = engine.tokenizer.encode(text)
    assert len(ids) >= PROMPT_LEN
    return ids[:PROMPT_LEN]


def _greedy(engine: LLMEngine, ids: list[int]) -> list[int]:
    out = engine.generate([list(ids)], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                      ignore_eos=True))[0]
    return out.output_token_ids


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, block_size=BS, kv_cache_bytes=48 << 20, **kw))


@pytest.fixture(scope="module")
def daemon():
    store = ChunkStore(StoreConfig(cpu_bytes="256MiB"))
    srv = ThreadedServer(create_app(store))
    yield srv
    srv.stop()
    store.close()


def _stats(srv) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"{srv.url}/v1/stats", timeout=30) as r:
        return json.loads(r.read())


def test_engines_on_different_weights_share_no_chunks_through_one_daemon(models, daemon):
    """The issue's input. Engine A (shipped GGUF) answers and saves its prompt's 4 chunks;
    engine B (blk.0.attn_norm.weight doubled) then asks the same daemon for the same 70 tokens:
    0 hit tokens, and its answer equals its own recompute. A asking again hits its 4 chunks
    (64 tokens), so the store does work; the daemon lists the two namespaces apart."""
    a = _engine(models["shipped"])
    ids = _prompt(a)
    a_recompute = _greedy(a, ids)
    ca = create_connector(url=daemon.url, chunk_size=CHUNK, deadline_s=60.0)
    a.set_connector(ca)
    a.reset_prefix_cache()
    assert _greedy(a, ids) == a_recompute
    assert ca.wait_for_save(60.0)
    a_saved = ca.get_stats()["kvstore_saved_chunks"]
    assert a_saved == (PROMPT_LEN + MAX_TOKENS - 1) // CHUNK == 5  # prompt + answer chunks

    b = _engine(models["doubled"])
    assert b.kv_identity["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct-doubled-norm"
    b_recompute = _greedy(b, ids)
    assert b_recompute != a_recompute     # the weights matter for this prompt
    cb = create_connector(url=daemon.url, chunk_size=CHUNK, deadline_s=60.0)
    b.set_connector(cb)
    b.reset_prefix_cache()
    assert _greedy(b, ids) == b_recompute
    sb = cb.get_stats()
    assert sb["external_prefix_cache_queries"] == PROMPT_LEN
    assert sb["external_prefix_cache_hits"] == 0 and sb["kvstore_loaded_chunks"] == 0
    assert cb.wait_for_save(60.0)

    a.reset_prefix_cache()                     # A's own chunks still serve A: 4 chunks
    assert _greedy(a, ids) == a_recompute
    assert ca.get_stats()["external_prefix_cache_hits"] == 4 * CHUNK

    assert ca.ns.model_id == SHIPPED_ID and ca.ns != cb.ns
    assert ca.ns.weights_fingerprint != cb.ns.weights_fingerprint
    assert dataclasses.replace(cb.ns, model_id=SHIPPED_ID,
                               weights_fingerprint=ca.ns.weights_fingerprint) == ca.ns
    held = {n["ns_id"]: n for n in _stats(daemon)["namespaces"]}
    assert set(held) == {ca.ns.ns_id.hex(), cb.ns.ns_id.hex()}
    assert held[ca.ns.ns_id.hex()]["num_chunks"] == 5
    assert held[cb.ns.ns_id.hex()]["num_chunks"] == 5
    assert held[cb.ns.ns_id.hex()]["namespace"] == cb.ns.to_dict()
    assert held[cb.ns.ns_id.hex()]["namespace"]["weights_fingerprint"] == \
        cb.ns.weights_fingerprint
    # the engine's /debug/stats source: the connector reports its namespace
    assert b.stats()["store_namespace"] == cb.ns.to_dict()
    for conn in (ca, cb):
        conn.close()


# ---- the fingerprint --------------------------------------------------------------------------
def test_fingerprint_is_stable_across_loads_and_follows_content_not_name(models):
    """Two loads of one file agree; a byte copy under another name agrees; one doubled norm
    tensor (576 of ~135M weights) changes it."""
    shipped = weights_fingerprint(models["shipped"], open_gguf(models["shipped"]))
    again = weights_fingerprint(models["shipped"], open_gguf(models["shipped"]))
    assert shipped == again and shipped.startswith("xxh3_128:") and len(shipped) == 9 + 32
    assert weights_fingerprint(models["renamed"]) == shipped
    assert weights_fingerprint(models["doubled"]) != shipped


def test_safetensors_folder_fingerprint(tmp_path):
    """A safetensors folder: same tensors -> same fingerprint whatever the file split order;
    one changed element -> another."""
    import torch
    from safetensors.torch import save_file
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    w = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3), "y": torch.ones(4)}
    save_file(w, str(a / "model.safetensors"))
    save_file({"y": w["y"]}, str(b / "model-00001.safetensors"))
    save_file({"x": w["x"]}, str(b / "model-00002.safetensors"))
    assert weights_fingerprint(str(a)) == weights_fingerprint(str(b))
    w["y"][2] = 2.0
    save_file(w, str(a / "model.safetensors"))
    assert weights_fingerprint(str(a)) != weights_fingerprint(str(b))


def test_model_name_from_metadata_and_paths(models, tmp_path):
    assert model_name(models["shipped"]) == (SHIPPED_ID, "")
    assert strip_quant_tag("Llama-3-8B-Instruct-Q4_K_M") == "Llama-3-8B-Instruct"
    assert strip_quant_tag("x.IQ4_XS") == "x" and strip_quant_tag("m-f16") == "m"
    assert strip_quant_tag("SmolLM2-135M") == "SmolLM2-135M"
    snap = tmp_path / "models--org--name" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert model_name(str(snap)) == ("org/name", "abc123")
    plain = tmp_path / "my-model"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"_name_or_path": "Org/Repo"}))
    assert model_name(str(plain)) == ("Org/Repo", "")


# ---- each ingredient changes the key -----------------------------------------------------------
BASE = Namespace("m", LAYOUT, weights_fingerprint="xxh3_128:" + "0" * 32,
                 compute_dtype="float32", rope={"theta": 100000.0, "scaling": None})


@pytest.mark.parametrize("change", [
    {"layout": dataclasses.replace(LAYOUT, dtype="bfloat16")},
    {"layout": dataclasses.replace(LAYOUT, chunk_size=32)},
    {"layout": dataclasses.replace(LAYOUT, num_kv_heads=1)},
    {"weights_fingerprint": "xxh3_128:" + "1" * 32},
    {"weights_fingerprint": ""},
    {"model_id": "other/model"},
    {"revision": "v2"},
    {"compute_dtype": "bfloat16"},
    {"rope": {"theta": 10000.0, "scaling": None}},
    {"rope": {"theta": 100000.0, "scaling": {"rope_type": "linear", "factor": 2.0}}},
    {"quantization": "awq"},
    {"kv_quantization": '{"cache_dtype":"fp8"}'},
    {"adapter": '{"weights":"xxh3_128:ab"}'},
    {"cache_salt": "tenant"},
], ids=lambda c: next(iter(c)))
def test_each_namespace_ingredient_changes_every_key(change):
    tokens = list(range(100, 100 + 2 * CHUNK))
    other = dataclasses.replace(BASE, **change)
    assert other.ns_id != BASE.ns_id
    assert not set(BASE.chunk_keys(tokens)) & set(other.chunk_keys(tokens))


def test_namespace_wire_form_round_trips_and_old_form_keeps_its_digest():
    assert Namespace.from_dict(json.loads(json.dumps(BASE.to_dict()))) == BASE
    assert BASE.rope == '{"scaling":null,"theta":100000.0}'
    plain = Namespace("HuggingFaceTB/SmolLM2-135M-Instruct", LAYOUT)
    assert set(plain.to_dict()) == {"model_id", "revision", "layout", "cache_salt", "hash_algo"}
    # the digest of a namespace without identity fields is the one it had before they existed
    import hashlib
    blob = json.dumps({"model_id": plain.model_id, "revision": "", "layout": LAYOUT.to_dict(),
                       "cache_salt": "", "hash_algo": "sha256"}, sort_keys=True,
                      separators=(",", ":")).encode()
    assert plain.digest == hashlib.sha256(b"kvstore-ns-v1" + blob).digest()
    with pytest.raises(TypeError, match="weights_fingerprint"):
        Namespace("m", LAYOUT, weights_fingerprint=123)
    # on the wire: a non-string identity field is a 400 naming it, never coerced
    from kvstore.daemon import protocol as P
    bad = {**BASE.to_dict(), "adapter": ["lora"]}
    with pytest.raises(P.ProtocolError, match="adapter") as err:
        P.parse_namespace(bad)
    assert err.value.status == 400
    assert P.parse_namespace({**BASE.to_dict(), "rope": {"theta": 100000.0, "scaling": None}}) \
        == BASE                                       # a dict rope is written canonically


# ---- engine_min: flags -> identity -> namespace --------------------------------------------
MC = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, rope_theta=100000.0)


def _conn_ns(identity: dict, **conn_kw) -> Namespace:
    """The namespace an engine_min connector builds from an engine's identity."""
    import torch
    conn = EngineMinConnector(ChunkStore(StoreConfig(cpu_bytes="8MiB")), chunk_size=CHUNK,
                              **conn_kw)
    conn.register_model(identity)
    conn.register_kv_caches(torch.zeros(30, 2, 2, BS, 3, 64), BS)
    ns = conn.ns
    conn.close()
    return ns


def test_engine_identity_flags_reach_the_namespace():
    fp = "xxh3_128:" + "2" * 32
    default = kv_identity(EngineConfig(), MC, SHIPPED_ID, "", fp)
    assert default == {"model_id": SHIPPED_ID, "revision": "", "weights_fingerprint": fp,
                       "compute_dtype": "float32",
                       "rope": '{"scaling":null,"theta":100000.0}',
                       "quantization": "", "kv_quantization": "", "adapter": ""}
    ns = _conn_ns(default)
    assert (ns.model_id, ns.revision, ns.weights_fingerprint) == (SHIPPED_ID, "", fp)
    named = kv_identity(EngineConfig(model_id="me/m", model_revision="r1"), MC, SHIPPED_ID, "",
                        fp)
    ns_named = _conn_ns(named)
    assert (ns_named.model_id, ns_named.revision, ns_named.weights_fingerprint) == \
        ("me/m", "r1", fp)     # naming the model keeps the fingerprint
    unprinted = kv_identity(EngineConfig(model_id="me/m", model_revision="r1",
                                         weights_fingerprint=False), MC, SHIPPED_ID, "", fp)
    assert _conn_ns(unprinted).weights_fingerprint == ""
    rope = kv_identity(EngineConfig(), dataclasses.replace(
        MC, rope_scaling={"rope_type": "linear", "factor": 2.0}), SHIPPED_ID, "", fp)
    bf16 = kv_identity(EngineConfig(dtype="bfloat16"), MC, SHIPPED_ID, "", fp)
    ids = {n.ns_id for n in (ns, ns_named, _conn_ns(unprinted), _conn_ns(rope), _conn_ns(bf16))}
    assert len(ids) == 5
    # a connector's explicit names win over the engine's; without an engine, the default id
    assert _conn_ns(default, model_id="x/y", revision="r").model_id == "x/y"
    assert _conn_ns({}).model_id == SHIPPED_ID and _conn_ns({}).weights_fingerprint == ""
    with pytest.raises(ValueError, match="model_id"):
        EngineConfig(model_id=" ")


def test_serve_flags_build_the_identity():
    import argparse
    from engine_min.serve.cli import add_serve_args, build_engine
    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--model-id", "me/m", "--model-revision", "r1", "--no-weights-fingerprint",
         "--kv-cache-bytes", "8MiB"])
    captured = {}

    class FakeEngine:
        def __init__(self, config, connector=None):
            captured["config"] = config
    import engine_min.engine as eng
    real, eng.LLMEngine = eng.LLMEngine, FakeEngine
    try:
        build_engine(args)
    finally:
        eng.LLMEngine = real
    c = captured["config"]
    assert (c.model_id, c.model_revision, c.weights_fingerprint) == ("me/m", "r1", False)


@pytest.mark.parametrize("field,value", [("cache_salt", None), ("cache_salt", 5),
                                         ("model_id", 7), ("revision", ["r"]),
                                         ("hash_algo", None)])
def test_namespace_text_fields_are_strings_not_coerced(field, value):
    """``null`` or ``5`` used to be read as ``"None"`` / ``"5"``: another namespace than the
    client meant. Now a ValueError naming the field, and on the wire a 400."""
    d = BASE.to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=f"namespace field '{field}' must be a string"):
        Namespace.from_dict(d)
    from kvstore.daemon.protocol import ProtocolError, parse_namespace
    with pytest.raises(ProtocolError, match=f"namespace field '{field}' must be a string"):
        parse_namespace(d)


def test_a_namespace_without_model_id_names_the_missing_field():
    from kvstore.daemon.protocol import ProtocolError, parse_namespace
    d = BASE.to_dict()
    del d["model_id"]
    with pytest.raises(ProtocolError) as e:
        parse_namespace(d)
    assert str(e.value) == "bad namespace: missing field 'model_id'"
    # absent optional fields still take their defaults
    d = BASE.to_dict()
    del d["cache_salt"], d["revision"]
    assert Namespace.from_dict(d) == BASE

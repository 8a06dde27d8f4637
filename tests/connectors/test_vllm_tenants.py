"""vLLM's KVStoreConnector with a daemon tenant's token (``auth_token`` in
``kv_connector_extra_config``): the connector learns its tenant's salt from the daemon, a second
engine of the same tenant loads the first one's chunks, another tenant's engine on the same
prompt loads nothing (and is refused nothing: its namespace is its own).

Skipped unless vLLM imports in the running interpreter; run it in the vLLM environment::

    .venv-vllm/bin/python -m pytest -q tests/connectors/test_vllm_tenants.py
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (tools/make_vllm_env.sh)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from bench.vllm_engine import make_document, run_child  # noqa: E402
from bench.vllm_model import convert  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app  # noqa: E402
from kvstore.store import ChunkStore  # noqa: E402
from kvstore.daemon.tenants import TenantTable  # noqa: E402

pytestmark = pytest.mark.slow
CHUNK, BLOCK = 256, 128
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab"}


def test_vllm_engines_with_tenant_tokens_share_only_within_their_tenant():
    from transformers import AutoTokenizer
    model_dir = str(convert())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.encode(make_document(0, 30) + "\nQuestion: how many tons of grain does Elm3 "
                        "export?\nAnswer:")
    assert 1100 < len(prompt) < 1280, len(prompt)   # 4 full chunks + one tail piece
    table = TenantTable.from_mapping({n: {"token": t} for n, t in TOKENS.items()})
    store = ChunkStore(StoreConfig(cpu_bytes="512MiB"))
    with ThreadedServer(create_app(store, ServerLimits(tenants=table))) as srv:
        def run(tenant):
            res = run_child({"model_dir": model_dir, "connector": "ours-daemon", "url": srv.url,
                             "max_tokens": 8, "prompts": [prompt], "warmup": False,
                             "extra": {"auth_token": TOKENS[tenant]}})
            return res["results"][0]["output_ids"], res["connector"]["worker"]
        out_a, wa = run("alice")
        out_b, wb = run("bob")
        out_a2, wa2 = run("alice")
    ns_ids = {k.ns_id for t in store.tiers for k in t.keys()}
    store.close()
    assert (wa["saved_chunks"], wa["saved_tail_chunks"], wa["loaded_tokens"]) == (4, 1, 0)
    assert (wb["saved_chunks"], wb["loaded_tokens"], wb["load_errors"]) == (4, 0, 0)
    assert wa2["loaded_tokens"] == 4 * CHUNK + BLOCK and wa2["load_errors"] == 0
    assert out_a == out_b == out_a2
    # alice's and bob's full chunks and tail pieces: four namespaces
    assert len(ns_ids) == 4

"""engine_min.serve.server with the KV store on (``--kvstore-cpu-bytes``), real model: a repeated
prompt is served from the store when the engine's own prefix cache is off, and /metrics
reports the store's queries and hits apart from the engine's."""
from __future__ import annotations

import argparse
import urllib.request

import openai
import pytest

pytest.importorskip("connectors.factory")  # the engine_min connector (issue: connectors)

from engine_min.config import EngineConfig  # noqa: E402
from engine_min.engine import LLMEngine  # noqa: E402
from engine_min.serve.cli import add_serve_args, build_connector  # noqa: E402
from engine_min.serve.server import ServerThread, create_app  # noqa: E402

MODEL = "smollm2-store"
CHUNK = 32
PROMPT = ("You are a careful assistant. Summarize the following note in one line: the meeting "
          "moved to Thursday at noon, bring the quarterly figures and the draft of the budget, "
          "and tell the new team members where the room is. Then list three action items.")


@pytest.fixture(scope="module")
def server():
    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--kvstore-cpu-bytes", "64MiB", "--kvstore-chunk-size", str(CHUNK)])
    connector = build_connector(args)
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256,
                                    enable_prefix_caching=False), connector=connector)
    with ServerThread(create_app(engine, MODEL)) as srv:
        srv.connector = connector
        yield srv
    connector.close()


def _metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return {n: float(v) for n, v in (ln.rsplit(" ", 1) for ln in lines
                                     if ln and not ln.startswith("#"))}


def test_repeated_prompt_is_loaded_from_the_store(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert server.connector.wait_for_save(30)  # the first request's chunks reached the store
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    # full chunks, then tail pieces of one block (16, the default), never the last token
    hit = min(n // 16 * 16, n - 1)
    assert again.usage.prompt_tokens_details.cached_tokens == hit > 0
    assert again.choices[0].text == first.choices[0].text
    m = _metrics(server)
    assert m["engine_external_prefix_cache_queries_total"] == 2 * n
    assert m["engine_external_prefix_cache_hits_total"] == hit
    assert m["engine_kvstore_hit_tokens_total"] == hit  # the connector's own series
    assert m['engine_kvstore_hit_tokens_by_tier_total{tier="cpu"}'] == hit
    assert m["engine_kvstore_loaded_bytes_total"] == hit * server.connector.layout.token_bytes
    assert m["engine_kvstore_load_fallbacks_total"] == 0
    assert m["engine_prefix_cache_queries_total"] == 0  # the engine's own cache is off
    assert m["engine_prefix_cache_hits_total"] == 0

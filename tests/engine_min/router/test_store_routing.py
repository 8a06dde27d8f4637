"""The router with a shared kvstore daemon (``--kvstore-url``), end to end on the real model:
two engines saving to and loading from one daemon; the router reads each engine's store
namespace from its ``/debug/stats``. A prompt engine A served (and saved to the store) is
held whole by the store, so A's own cache gives it no advantage: the router sends the prompt
to the less loaded engine B, which loads it from the store, where without the store A would
have won on its cache. A prompt no engine holds is routed without asking the store (it cannot
change the pick). A daemon that does not answer within the deadline is skipped (counted) and
the request is routed on the engines' own hits."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from connectors.factory import create_connector
from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.router.store_lookup import StoreLookup
from engine_min.serve.server import ServerThread, create_app
from kvstore.config import StoreConfig
from kvstore.daemon.run import ThreadedServer
from kvstore.daemon.server import create_app as create_daemon_app
from kvstore.store import ChunkStore
from tests.engine_min.router.served import (BS, KV_BYTES, MAX_MODEL_LEN, MODEL, metric, metrics,
                                            post_json, request, settle, start_router)

CHUNK = 64          # store chunk: 4 blocks
PROMPT_LEN = 192    # 3 chunks, 12 blocks


@pytest.fixture(scope="module")
def daemon():
    store = ChunkStore(StoreConfig(cpu_bytes="256MiB"))
    srv = ThreadedServer(create_daemon_app(store))
    yield srv
    srv.stop()
    store.close()


@pytest.fixture(scope="module")
def store_engines(daemon):
    out = []
    for _ in range(2):
        engine = LLMEngine(EngineConfig(kv_cache_bytes=KV_BYTES, block_size=BS,
                                        max_model_len=MAX_MODEL_LEN, max_num_seqs=8))
        connector = create_connector(url=daemon.url, chunk_size=CHUNK, deadline_s=30.0,
                                     tail_chunk_size=0)
        engine.set_connector(connector)
        srv = ServerThread(create_app(engine, MODEL)).start()
        srv.engine, srv.connector = engine, connector
        out.append(srv)
    yield out
    for srv in out:
        srv.stop()
        srv.connector.close()


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _stream_in_background(url: str, prompt: str, max_tokens: int) -> threading.Thread:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    t = threading.Thread(target=request, args=(url, "/v1/completions", body), daemon=True)
    t.start()
    return t


def test_a_prompt_the_store_holds_goes_to_the_least_loaded_engine(daemon, store_engines):
    a, b = store_engines
    srv = start_router([a.url, b.url], a.engine.tokenizer,
                       store=StoreLookup(daemon.url, timeout_s=2.0))
    try:
        settle(srv, store_engines)
        ra, rb = srv.router.engines
        deadline = time.monotonic() + 30
        while not (ra.store_namespace_read and rb.store_namespace_read):
            assert time.monotonic() < deadline, "store namespaces not read"
            time.sleep(0.05)
        assert ra.store_namespace == a.connector.ns == rb.store_namespace == b.connector.ns
        assert ra.store_namespace.layout.chunk_size == CHUNK

        # A serves the prompt directly and saves its 3 chunks to the store
        tok = a.engine.tokenizer
        ids = tok.encode("The lighthouse keeper wrote in his log every night. " * 20)
        ids = ids[:PROMPT_LEN]
        out = post_json(a.url, "/v1/completions", {"model": MODEL, "prompt": ids,
                                                    "max_tokens": 1})
        assert out["usage"]["prompt_tokens"] == PROMPT_LEN
        assert a.connector.wait_for_save(30.0)
        assert a.connector.get_stats()["kvstore_saved_chunks"] == PROMPT_LEN // CHUNK
        settle(srv, store_engines)
        from engine_min.block_hash import block_hashes
        hashes = block_hashes(ra.index.hash_seed, ids, BS)
        # without the store, A would win on its cache: it holds the whole prompt, B nothing
        assert ra.index.hit_blocks(hashes) * BS == PROMPT_LEN and rb.index.hit_blocks(hashes) == 0

        # A gets busier than B (a long stream); then the prompt comes through the router
        busy = _stream_in_background(a.url, "Write a long poem about the sea.", 60)
        deadline = time.monotonic() + 30
        while ra.load < 1:
            assert time.monotonic() < deadline, "A's load never showed"
            time.sleep(0.02)
        assert rb.load == 0
        before = metrics(srv.url)
        status, _, body = request(srv.url, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": ids, "max_tokens": 2}).encode())
        assert status == 200, body
        delta = _delta(before, metrics(srv.url))
        assert metric(delta, "router_requests_total", engine=b.url, reason="load") == 1
        assert sum(v for k, v in delta.items() if k.startswith("router_requests_total")) == 1
        assert metric(delta, "router_store_lookups_total", result="ok") == 1
        assert metric(delta, "router_store_hit_tokens_total") == PROMPT_LEN
        assert metric(delta, "router_predicted_hit_tokens_total", engine=b.url) == 0
        # B loaded the prompt from the store instead of computing it
        cached = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == PROMPT_LEN - 1     # all 3 chunks loaded, the last token recomputed
        stats = b.connector.get_stats()
        assert stats["kvstore_loaded_chunks"] == PROMPT_LEN // CHUNK
        assert stats["kvstore_loaded_tokens"] == PROMPT_LEN - 1
        busy.join(120)

        # a prompt no engine holds: the store cannot change the pick, so it is not asked
        fresh = tok.encode("A different question about volcanoes and their ash. " * 20)
        before = metrics(srv.url)
        status, _, body = request(srv.url, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": fresh[:PROMPT_LEN], "max_tokens": 1}).encode())
        assert status == 200, body
        delta = _delta(before, metrics(srv.url))
        assert metric(delta, "router_store_lookups_total", result="skipped") == 1
        assert metric(delta, "router_store_lookups_total", result="ok") == 0

        # A holds this prompt, B nothing, both idle: A wins on its hits and, being among the
        # least loaded, would also get it on load if the store held it all: not asked
        q = tok.encode("The gardener counted the roses every morning in June. " * 20)
        q = q[:PROMPT_LEN]
        post_json(a.url, "/v1/completions", {"model": MODEL, "prompt": q, "max_tokens": 1})
        assert a.connector.wait_for_save(30.0)
        settle(srv, store_engines)
        assert ra.load == rb.load == 0
        before = metrics(srv.url)
        status, _, body = request(srv.url, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": q, "max_tokens": 1}).encode())
        assert status == 200, body
        delta = _delta(before, metrics(srv.url))
        assert metric(delta, "router_store_lookups_total", result="skipped") == 1
        assert metric(delta, "router_requests_total", engine=a.url, reason="hit") == 1

        # A busier than B: the store could now move it to B, so it is asked; a daemon that
        # does not answer in time is skipped and counted, and the request is routed on the
        # engines' own hits
        busy = _stream_in_background(a.url, "Write a long poem about the sea.", 60)
        deadline = time.monotonic() + 30
        while ra.load < 1:
            assert time.monotonic() < deadline, "A's load never showed"
            time.sleep(0.02)
        hole = socket.create_server(("127.0.0.1", 0))   # listens, never answers
        srv.router.store.url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        srv.router.store.timeout_s = 0.05
        before = metrics(srv.url)
        status, _, body = request(srv.url, "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": q, "max_tokens": 1}).encode())
        hole.close()
        assert status == 200, body
        delta = _delta(before, metrics(srv.url))
        assert metric(delta, "router_store_lookups_total", result="timeout") == 1
        assert metric(delta, "router_requests_total", engine=a.url, reason="hit") == 1
        assert metric(delta, "router_predicted_hit_tokens_total", engine=a.url) == PROMPT_LEN
        assert metric(metrics(srv.url), "router_failed_requests_total") == 0
        busy.join(120)
    finally:
        srv.stop()

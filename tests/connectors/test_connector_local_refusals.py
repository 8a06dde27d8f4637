"""Chunks an in-process ``ChunkStore`` refuses, through EngineMinConnector on the real model
(SmolLM2-135M, fp32 KV on the CPU): counted in ``kvstore_refused_chunks`` (never in
``kvstore_saved_chunks``), equal to the store's own ``rejected_chunks``, and one WARNING for
the connector's life names the tier size, the chunk size and the flag to raise.

Sizes: chunks of C = 64 tokens are 64 * 30 layers * 2 * 3 heads * 64 * 4 bytes = 2.81 MiB; the
CPU tier of 4 MiB holds one. A prompt of 4 chunks + 5 tokens stores its chunk 0; chunk 1 fits
only by evicting its own prefix (``no_room``), chunks 2 and 3 then have no stored parent
(``parent_missing``): 3 refused. Tail pieces are off (exact full-chunk counts).
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from connectors.engine_min import EngineMinConnector
from connectors.put_answer import LocalPutResult, checked_put
from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from tests.redis_fixtures import redis_server  # noqa: F401 (fixture)

C = 64
CPU_BYTES = 4 << 20
LOGGER = "connectors.engine_min"


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20, enable_prefix_caching=False,
                                 dtype="float32", device="cpu"))
    yield eng
    eng.set_connector(None)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def stat(conn, name: str) -> int:
    return conn.get_stats()[f"kvstore_{name}"]


def test_refused_chunks_of_an_in_process_store_are_counted_and_warned_once(engine, caplog):
    store = ChunkStore(StoreConfig(cpu_bytes=CPU_BYTES))
    conn = EngineMinConnector(store, chunk_size=C, tail_chunk_size=0, deadline_s=60)
    engine.set_connector(conn)
    try:
        chunk_bytes = conn.layout.chunk_bytes
        assert chunk_bytes == C * 30 * 2 * 3 * 64 * 4 and chunk_bytes < CPU_BYTES < 2 * chunk_bytes
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            engine.generate([ids(1, 4 * C + 5)], SamplingParams(max_tokens=3, temperature=0.0))
            assert conn.wait_for_save(60)
            assert stat(conn, "queued_chunks") == 4
            assert stat(conn, "saved_chunks") == 1
            assert stat(conn, "refused_chunks") == 3
            assert stat(conn, "saved_bytes") == chunk_bytes
            assert store.stats()["rejected_chunks"] == 3
            assert stat(conn, "save_queue_bytes") == 0
            # a second prompt: refused again, counted, but no second WARNING
            engine.generate([ids(2, 3 * C)], SamplingParams(max_tokens=2, temperature=0.0))
            assert conn.wait_for_save(60)
        assert stat(conn, "refused_chunks") == 3 + 2   # its chunk 0 evicts the first one's
        assert stat(conn, "saved_chunks") == 2
        assert store.stats()["rejected_chunks"] == 5
        warns = [r.getMessage() for r in caplog.records
                 if r.name == LOGGER and r.levelno == logging.WARNING and "refused" in r.getMessage()]
        assert len(warns) == 1, warns
        msg = warns[0]
        for part in ("in-process store refused 3 of 4 chunks", "no_room", "cpu 4MiB",
                     "2.81MiB (64 tokens)", "about 1 chunk(s)", "--kvstore-cpu-bytes",
                     "remote tier"):
            assert part in msg, (part, msg)
        debug = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.DEBUG
                 and "in-process store refused" in r.getMessage()]
        assert debug, "later refusals are logged at DEBUG"
    finally:
        engine.set_connector(None)
        conn.close()


def test_the_local_tier_caps_what_reaches_the_remote_tier(engine, redis_server):  # noqa: F811
    """With a Redis tier below the 4 MiB CPU tier, the refused chunks are counted alike and
    only the stored chunk 0 reaches Redis: a store with a large CPU tier over the same Redis
    finds chunk 0 and nothing after it."""
    store = ChunkStore(StoreConfig(cpu_bytes=CPU_BYTES, remote_url=redis_server.url))
    conn = EngineMinConnector(store, chunk_size=C, tail_chunk_size=0, deadline_s=60)
    engine.set_connector(conn)
    prompt = ids(7, 4 * C + 5)
    try:
        engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))
        assert conn.wait_for_save(60) and store.flush(10)
        assert (stat(conn, "saved_chunks"), stat(conn, "refused_chunks")) == (1, 3)
        ns = conn.ns
    finally:
        engine.set_connector(None)
        conn.close()
    other = ChunkStore(StoreConfig(cpu_bytes=64 << 20, remote_url=redis_server.url))
    try:
        assert other.exists(ns, ns.chunk_keys(prompt)) == [True, False, False, False]
    finally:
        other.close()


def test_checked_put_tells_refused_from_stored_before():
    """``checked_put`` on a real ChunkStore: chunks held before are ``already_stored``, those
    held nowhere ``refused``, the first one's reason as its parent says; a put that stored
    every chunk is passed through."""
    store = ChunkStore(StoreConfig(cpu_bytes=CPU_BYTES))
    try:
        ns = Namespace("m", KVLayout(num_layers=2, num_kv_heads=1, head_dim=8,
                                     dtype=torch.float32, chunk_size=4))
        keys = ns.chunk_keys(list(range(16)))
        kv = [torch.full(ns.layout.shape(), float(i)) for i in range(4)]
        n = store.put_chunks(ns, keys[:2], kv[:2])
        whole = checked_put(store, ns, keys[:2], n)
        assert whole == 2 and type(whole) is int   # every chunk newly stored: passed through
        # chunk 1 held, chunk 2 new, chunk 3 new: all three held afterwards
        again = checked_put(store, ns, keys[1:], store.put_chunks(ns, keys[1:], kv[1:],
                                                                   [keys[0], keys[1], keys[2]]),
                            [keys[0], keys[1], keys[2]])
        assert isinstance(again, LocalPutResult)
        assert (int(again), again.already_stored, again.refused, again.first_refused) == \
            (2, 1, 0, None)
        assert store.remove(ns, keys[1:]) == 3      # the prefix is gone from chunk 1 on
        res = checked_put(store, ns, keys[2:], store.put_chunks(ns, keys[2:], kv[2:],
                                                                [keys[1], keys[2]]),
                          [keys[1], keys[2]])
        assert (int(res), res.num_chunks, res.refused) == (0, 2, 2)
        assert res.first_refused == {"index": 0, "key": keys[2].hex(),
                                     "reason": "parent_missing"}
    finally:
        store.close()


def test_vllm_worker_counts_what_an_in_process_store_refused(caplog):
    """The vLLM connector's writer (``WorkerSide``, without vLLM) over a ChunkStore whose CPU
    tier holds one chunk: a put of 3 chunks counts 1 saved and 2 refused (it counted all 3 as
    saved), and one WARNING names the tier and the chunk."""
    from connectors.vllm.shared import Counters, StoreCalls
    from connectors.vllm.worker import WorkerSide
    lay = KVLayout(1, 1, 4, "float32", 8)        # a chunk is 256 bytes
    ns = Namespace("m", lay)
    keys = ns.chunk_keys(list(range(100, 124)))
    store = ChunkStore(StoreConfig(cpu_bytes=384, page_bytes=128))
    counters = Counters()
    w = WorkerSide(lay, ["model.layers.0.attn"], 2, 8, StoreCalls(store, False, 5.0),
                   counters, 1 << 20, dict)
    try:
        with caplog.at_level(logging.DEBUG, logger="kvstore.connectors.vllm"):
            for rnd in range(2):
                assert w.saves.try_reserve(3 * lay.chunk_bytes)
                w.saves.submit(ns, keys, [torch.full(lay.shape(), float(i)) for i in range(3)],
                               3 * lay.chunk_bytes, None)
                assert w.flush(10)
        c = counters.snapshot()
        # round 1: chunk 0 stored, 1 and 2 refused; round 2: chunk 0 held, 1 and 2 refused
        assert (c["saved_chunks"], c["refused_chunks"]) == (2, 4)
        assert store.stats()["rejected_chunks"] == 4
        warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                 and "in-process store refused" in r.getMessage()]
        assert len(warns) == 1 and "cpu 384B" in warns[0] and "256B (8 tokens)" in warns[0], \
            warns
    finally:
        w.close(5)
        store.close()

"""engine_min.serve with an in-process store, real model: a request's saves that are written
after its last step (the server is idle then) still show in /metrics without another request:
``engine_kvstore_save_queue_bytes`` drops to 0 and the save counters (saved, refused) are
final. The store's puts wait on a gate the test opens after the answer, so the saves are
surely queued when the last step's stats are taken.

Sizes: chunks of 64 tokens of fp32 KV are 2.81 MiB; the 4 MiB CPU tier holds one, so a prompt
of 3 chunks + 5 tokens saves chunk 0 and the store refuses chunks 1 and 2 (tail pieces off).
"""
from __future__ import annotations

import random
import threading
import time
import urllib.request

import openai
import pytest

pytest.importorskip("connectors.engine_min")

from connectors.engine_min import EngineMinConnector  # noqa: E402
from engine_min.config import EngineConfig  # noqa: E402
from engine_min.engine import LLMEngine  # noqa: E402
from engine_min.serve.server import ServerThread, create_app  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.store import ChunkStore  # noqa: E402

MODEL = "smollm2-gauge"
C = 64


class GatedStore(ChunkStore):
    """A real in-process store whose puts wait until ``gate`` is set (at most 60 s)."""

    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        self.gate = threading.Event()

    def put_chunks(self, *args, **kw):
        self.gate.wait(60)
        return super().put_chunks(*args, **kw)


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return {n: float(v) for n, v in (ln.rsplit(" ", 1) for ln in lines
                                     if ln and not ln.startswith("#"))}


def test_saves_written_while_idle_reach_the_metrics():
    store = GatedStore(StoreConfig(cpu_bytes=4 << 20))
    conn = EngineMinConnector(store, chunk_size=C, tail_chunk_size=0, deadline_s=60)
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20, max_model_len=512, dtype="float32",
                                    device="cpu", enable_prefix_caching=False), connector=conn)
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40000) for _ in range(3 * C + 5)]
    try:
        with ServerThread(create_app(engine, MODEL)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert out.usage.prompt_tokens == 3 * C + 5
            m = _metrics(srv.url)
            chunk_bytes = conn.layout.chunk_bytes
            assert m["engine_kvstore_save_queue_bytes"] == 3 * chunk_bytes   # the gate holds it
            assert m["engine_kvstore_queued_chunks_total"] == 3
            store.gate.set()
            assert conn.wait_for_save(60)
            deadline = time.monotonic() + 10
            while True:   # no request comes: the idle server must refresh by itself
                m = _metrics(srv.url)
                if m["engine_kvstore_save_queue_bytes"] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert m["engine_kvstore_save_queue_bytes"] == 0
            assert m["engine_kvstore_saved_chunks_total"] == 1
            assert m["engine_kvstore_refused_chunks_total"] == 2
            assert m["engine_kvstore_saved_bytes_total"] == chunk_bytes
    finally:
        store.gate.set()
        conn.close()

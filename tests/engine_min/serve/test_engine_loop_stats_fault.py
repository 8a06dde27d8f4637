"""engine_min.serve's engine thread when ``engine.stats()`` raises while it is idle with saves
still queued (it refreshes the stats every 0.1 s until the queue drains): the failure is logged
once, not every 0.1 s, the thread stops polling, and one line says when stats work again.
Real model, an in-process store whose puts wait on a gate (as test_api_server_save_gauge)."""
from __future__ import annotations

import logging
import random
import time

import openai
import pytest

pytest.importorskip("connectors.engine_min")

from connectors.engine_min import EngineMinConnector  # noqa: E402
from engine_min.config import EngineConfig  # noqa: E402
from engine_min.engine import LLMEngine  # noqa: E402
from engine_min.serve.server import ServerThread, create_app  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from tests.engine_min.serve.test_api_server_save_gauge import C, GatedStore  # noqa: E402


def test_stats_failing_while_saves_are_queued_is_logged_once(caplog):
    store = GatedStore(StoreConfig(cpu_bytes=4 << 20))
    conn = EngineMinConnector(store, chunk_size=C, tail_chunk_size=0, deadline_s=60)
    engine = LLMEngine(EngineConfig(kv_cache_bytes=32 << 20, max_model_len=512, dtype="float32",
                                    device="cpu", enable_prefix_caching=False), connector=conn)
    prompt = [random.Random(5).randrange(100, 40000) for _ in range(C + 5)]
    real_stats, broken = engine.stats, [False]

    def stats():
        if broken[0]:
            raise RuntimeError("stats broke")
        return real_stats()

    engine.stats = stats
    try:
        with caplog.at_level(logging.INFO, logger="engine_min.serve.server"), \
                ServerThread(create_app(engine, "m")) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            client.completions.create(model="m", prompt=prompt, max_tokens=2)
            broken[0] = True        # the saves are queued behind the gate: the thread polls
            time.sleep(1.0)         # ten polls' worth
            failed = [r for r in caplog.records if "engine.stats() failed" in r.getMessage()]
            assert len(failed) == 1
            broken[0] = False
            store.gate.set()
            client.completions.create(model="m", prompt=prompt, max_tokens=1)
            deadline = time.monotonic() + 30   # (the answer can reach us before the refresh)
            while not any("engine.stats() works again" in r.getMessage()
                          for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert any("engine.stats() works again" in r.getMessage() for r in caplog.records)
            assert len([r for r in caplog.records
                        if "engine.stats() failed" in r.getMessage()]) == 1
    finally:
        store.gate.set()
        conn.close()
        store.close()

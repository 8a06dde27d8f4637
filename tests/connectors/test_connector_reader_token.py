"""An engine whose daemon token has the read-only role (``reader``, known from ``GET
/v1/whoami`` at start) loads what its tenant's writers saved and saves nothing: no chunk is
gathered or sent (each put would be refused 403 and counted as a save error), one INFO line
at start says so. Real daemon app with a tenants table, the connector over HTTP, the
stand-in engine of ``fake_engine`` (block size 4, chunks of 4 tokens).
"""
from __future__ import annotations

import logging

from connectors.factory import create_connector
from kvstore.config import StoreConfig
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.tenants import TenantTable
from kvstore.store import ChunkStore

from tests.connectors.fake_engine import FakeEngine, prompt

TOKENS = {"writer": "writer-token-0123456789", "viewer": "viewer-token-0123456789"}


def _keys(store: ChunkStore) -> int:
    return sum(len(list(t.keys())) for t in store.tiers)


def test_a_reader_token_loads_and_never_saves(caplog):
    table = TenantTable.from_mapping({
        "writer": {"token": TOKENS["writer"], "salt": "team"},
        "viewer": {"token": TOKENS["viewer"], "salt": "team", "role": "reader"}})
    store = ChunkStore(StoreConfig(cpu_bytes="16MiB"))
    with ThreadedServer(create_app(store, ServerLimits(tenants=table))) as srv:
        w = create_connector(url=srv.url, chunk_size=4, deadline_s=5.0,
                             auth_token=TOKENS["writer"])
        eng_w = FakeEngine(w, prefix_caching=False)
        eng_w.add("w", prompt(16))
        eng_w.run()
        assert w.wait_for_save(10) and w.get_stats()["kvstore_saved_chunks"] == 4
        w.close()
        stored = _keys(store)
        assert stored >= 4
        with caplog.at_level(logging.INFO, logger="kvstore.connectors.factory"):
            r = create_connector(url=srv.url, chunk_size=4, deadline_s=5.0,
                                 auth_token=TOKENS["viewer"])
        eng_r = FakeEngine(r, prefix_caching=False)
        seq = eng_r.add("r1", prompt(16) + [7])       # the writer's 16 tokens load
        eng_r.add("r2", prompt(16, base=300))         # a new prompt: nothing saved either
        eng_r.run()
        assert r.wait_for_save(10)
        st = r.get_stats()
        r.close()
        assert seq.is_finished and seq.num_cached_tokens == 16
        assert st["kvstore_loaded_tokens"] == 16
        assert (st["kvstore_queued_chunks"], st["kvstore_saved_chunks"],
                st["kvstore_save_errors"], st["kvstore_saved_tail_chunks"]) == (0, 0, 0, 0)
        assert _keys(store) == stored                  # the daemon got no put
    store.close()
    lines = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
    assert lines == [f"kvstore daemon {srv.url}: this token is read-only (role reader): the "
                     "engine loads from it and saves nothing"]

"""An engine whose daemon token has the read-only role (``reader``, known from ``GET
/v1/whoami`` at start) loads what its tenant's writers saved and never sends the daemon a save
(each put would be refused 403 and counted as an error), one INFO line at start says so. With
the daemon alone nothing is gathered or saved; with in-process tiers in front (a read-only
``LayeredStore``) saves go to those tiers only. Real daemon app with a tenants table, the
connector over HTTP, the stand-in engine of ``fake_engine`` (block size 4, chunks of 4 tokens).
"""
from __future__ import annotations

import logging

from connectors.factory import create_connector
from kvstore.config import StoreConfig
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.tenants import TenantTable
from kvstore.layered import LayeredStore
from kvstore.store import ChunkStore

from tests.connectors.fake_engine import FakeEngine, prompt

TOKENS = {"writer": "writer-token-0123456789", "viewer": "viewer-token-0123456789"}


def _keys(store: ChunkStore) -> int:
    return sum(len(list(t.keys())) for t in store.tiers)


def _hit(stats: dict) -> dict[str, int]:
    """Hit tokens of the tiers that had hits (the others are reported at 0)."""
    return {t: n for t, n in stats["kvstore_hit_tokens_by_tier"].items() if n}


def _table() -> TenantTable:
    return TenantTable.from_mapping({
        "writer": {"token": TOKENS["writer"], "salt": "team"},
        "viewer": {"token": TOKENS["viewer"], "salt": "team", "role": "reader"}})


def _writer_saves_16_tokens(url: str, store: ChunkStore) -> int:
    """A writer engine (daemon alone) saves ``prompt(16)``: 4 chunks; the daemon's keys."""
    w = create_connector(url=url, chunk_size=4, deadline_s=5.0, auth_token=TOKENS["writer"])
    eng_w = FakeEngine(w, prefix_caching=False)
    eng_w.add("w", prompt(16))
    eng_w.run()
    assert w.wait_for_save(10) and w.get_stats()["kvstore_saved_chunks"] == 4
    w.close()
    stored = _keys(store)
    assert stored >= 4
    return stored


def test_a_reader_token_loads_and_never_saves(caplog):
    store = ChunkStore(StoreConfig(cpu_bytes="16MiB"))
    with ThreadedServer(create_app(store, ServerLimits(tenants=_table()))) as srv:
        stored = _writer_saves_16_tokens(srv.url, store)
        with caplog.at_level(logging.INFO, logger="kvstore.connectors.stores"):
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


def test_a_reader_token_in_front_of_local_tiers_saves_only_to_them(caplog):
    store = ChunkStore(StoreConfig(cpu_bytes="16MiB"))
    with ThreadedServer(create_app(store, ServerLimits(tenants=_table()))) as srv:
        stored = _writer_saves_16_tokens(srv.url, store)
        with caplog.at_level(logging.INFO, logger="kvstore.layered"):
            r = create_connector(cpu_bytes="4MiB", url=srv.url, chunk_size=4, deadline_s=5.0,
                                 auth_token=TOKENS["viewer"])
        layered = r.store
        assert isinstance(layered, LayeredStore) and layered.remote_read_only
        eng_r = FakeEngine(r, prefix_caching=False)
        seq = eng_r.add("r1", prompt(16) + [7])       # the writer's 16 tokens, from the daemon
        eng_r.add("r2", prompt(16, base=300))         # new: saved into the local tier only
        eng_r.run()
        assert r.wait_for_save(10)
        st = r.get_stats()
        assert seq.is_finished and seq.num_cached_tokens == 16
        assert _hit(st) == {"remote:cpu": 16}
        assert st["kvstore_saved_chunks"] >= 4 and st["kvstore_save_errors"] == 0
        assert layered.remote_errors == 0             # no put was sent (each one: a 403)
        assert _keys(store) == stored                  # the daemon got no put
        seq2 = eng_r.add("r3", prompt(16, base=300) + [9])   # r2's chunks: a local hit
        eng_r.run()
        assert seq2.num_cached_tokens == 16
        assert _hit(r.get_stats()) == {"remote:cpu": 16, "cpu": 16}
        r.close()
    store.close()
    lines = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
    assert lines == [f"remote store {srv.url} is read-only for this engine (role reader): saves "
                     "stay in the local tiers, nothing is sent to it; lookups and loads still "
                     "ask it"]

"""EngineMinConnector's fallback log line names the real cause: a daemon that refuses the
connection is logged as refused (the client's ``StoreUnavailable`` is a ``TimeoutError``, which
once made it read "lookup timed out"), a store that fails a load as failed, and only a lookup
that outlives its deadline as timed out.

Stand-in engine of ``fake_engine``; block size 4 throughout.
"""
from __future__ import annotations

import logging
import socket
import time

from connectors.engine_min import EngineMinConnector
from connectors.factory import create_connector
from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.errors import StoreUnavailable
from kvstore.store import ChunkStore

from tests.connectors.fake_engine import STORE_MARK, FakeEngine, kv_value, prompt


def _connector_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv connector:")]


def test_a_refused_daemon_is_logged_as_refused_not_timed_out(caplog):
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sk.getsockname()[1]}"   # nothing listens once closed
    # a deadline far above the refused path (2 tries, ~50 ms): no timeout can happen
    conn = create_connector(url=url, chunk_size=4, deadline_s=5.0)
    eng = FakeEngine(conn, prefix_caching=False)
    with caplog.at_level(logging.WARNING):
        seq = eng.add("r", prompt(12))
        eng.run()
    assert seq.is_finished and seq.num_cached_tokens == 0 and eng.computed_tokens == 12
    st = conn.get_stats()
    assert st["kvstore_lookup_fallbacks"] == 1 and st["kvstore_lookup_seconds_max"] < 2.0
    lookup_lines = [m for m in _connector_lines(caplog) if m.startswith("kv connector: lookup")]
    assert lookup_lines == [
        f"kv connector: lookup failed (StoreUnavailable: GET {url}/v1/whoami: connection refused "
        f"(2 tries); is the kvstore daemon running?); recomputing "
        f"(logged once per cause until it recovers)"]
    assert not any("timed out" in r.getMessage() for r in caplog.records)
    conn.close()


class _Store(ChunkStore):
    """A store whose lookups stall ``lookup_stall_s`` or whose gets raise ``get_error``."""

    lookup_stall_s = 0.0
    get_error: Exception | None = None

    def lookup_keys(self, ns, keys):
        time.sleep(self.lookup_stall_s)
        return super().lookup_keys(ns, keys)

    def get_chunks(self, ns, keys):
        if self.get_error is not None:
            raise self.get_error
        return super().get_chunks(ns, keys)


def _run_stored_prompt(caplog, **flaw) -> tuple[EngineMinConnector, FakeEngine]:
    """One 33-token request whose first 32 tokens (4 chunks of 8) are stored, with ``flaw``."""
    toks = prompt(33)
    store = _Store(StoreConfig(cpu_bytes="1MiB"))
    conn = EngineMinConnector(store, chunk_size=8, deadline_s=0.2, deadline_s_per_chunk=0.0)
    eng = FakeEngine(conn, prefix_caching=False)
    PrefixStore(store, conn.ns).put(toks, kv_value(toks, 0, 32, STORE_MARK))
    for k, v in flaw.items():
        setattr(store, k, v)
    with caplog.at_level(logging.WARNING):
        seq = eng.add("r", toks)
        eng.run()
    assert seq.is_finished and seq.num_cached_tokens == 0 and eng.computed_tokens == 33
    return conn, eng


def test_a_lookup_past_its_deadline_is_logged_as_timed_out(caplog):
    conn, _ = _run_stored_prompt(caplog, lookup_stall_s=1.0)
    assert _connector_lines(caplog) == [
        "kv connector: lookup timed out after 0.200 s; recomputing "
        "(logged once per cause until it recovers)"]
    assert conn.get_stats()["kvstore_lookup_fallbacks"] == 1
    conn.close()


def test_a_load_the_store_refuses_is_logged_as_failed_not_missed_deadline(caplog):
    err = StoreUnavailable("POST http://127.0.0.1:9/v1/get: connection refused (2 tries)")
    conn, _ = _run_stored_prompt(caplog, get_error=err)
    assert _connector_lines(caplog) == [
        "kv connector: load failed (StoreUnavailable: POST http://127.0.0.1:9/v1/get: "
        "connection refused (2 tries)); recomputing (logged once per cause until it "
        "recovers)"]
    st = conn.get_stats()
    assert st["kvstore_load_fallbacks"] == 1 and st["kvstore_load_failed_tokens"] == 32
    conn.close()

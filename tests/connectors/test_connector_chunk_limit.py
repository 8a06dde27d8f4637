"""A connector whose chunk is larger than a real ``kvstore serve``'s ``--max-body-bytes``: one
WARNING at start naming both sizes and the settings to change, then its full-chunk saves are
skipped (counted in ``save_errors``, no other warning), on both paths to the daemon. The
stand-in engine (``fake_engine``: float32, 2 layers, 1 head of 2) makes 256-token chunks of
8192 bytes against a 4096-byte limit; its 4-token tail pieces (128 bytes) still fit."""
from __future__ import annotations

import logging
import os
import tempfile

import pytest

from connectors import chunk_limit
from kvstore.daemon.client import KVStoreClient
from tests.connectors.fake_engine import FakeEngine, make_conn, prompt
from tests.kvstore.daemon.serve_proc import free_port, start, stop

BODY, CHUNK = 4096, 256
CHUNK_BYTES = 2 * 2 * CHUNK * 1 * 2 * 4  # [L, 2, T, H, D] float32


@pytest.fixture(scope="module")
def daemon():
    """``(http_url, unix_url)`` of a real ``kvstore serve --max-body-bytes 4096``."""
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "kv.sock")
        proc = start(port, sock, ["--max-body-bytes", str(BODY)])
        try:
            yield f"http://127.0.0.1:{port}", "unix://" + sock
        finally:
            stop(proc)


def _limit_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and ("max-body-bytes" in r.getMessage() or "ChunkTooLarge" in r.getMessage())]


def _run(conn, n_tokens: int = 600, budget: int = 1024) -> list[int]:
    eng = FakeEngine(conn, num_blocks=256, budget=budget)
    toks = prompt(n_tokens)
    eng.add("r", toks)
    eng.run()
    return toks


@pytest.mark.parametrize("path", [0, 1], ids=["http", "unix"])
def test_one_warning_at_start_then_the_saves_are_skipped(daemon, path, caplog):
    caplog.set_level(logging.INFO)
    conn = make_conn(KVStoreClient(daemon[path], same_host=False, timeout_s=10), chunk=CHUNK)
    conn.store.clear()
    eng = FakeEngine(conn, num_blocks=256, budget=1024)  # (binds: the check at start)
    warned = _limit_warnings(caplog)
    assert len(warned) == 1, warned
    msg = warned[0]
    assert str(BODY) in msg and str(CHUNK_BYTES) in msg
    assert "kvstore serve --max-body-bytes" in msg and "--kvstore-chunk-size" in msg
    toks = prompt(600)  # 2 full chunks, then tail pieces
    eng.add("r", toks)
    eng.run()
    conn.close()
    st = conn.get_stats()
    assert st["kvstore_saved_chunks"] == 0 and st["kvstore_save_errors"] >= 1
    assert st["kvstore_saved_tail_chunks"] > 0  # (the pieces fit: saved as before)
    assert len(_limit_warnings(caplog)) == 1  # no warning per save
    with KVStoreClient(daemon[path], same_host=False, timeout_s=10) as c:
        assert c.lookup_keys(conn.ns, conn.ns.chunk_keys(toks)).num_hit_chunks == 0
        c.clear()


def test_a_chunk_within_the_limit_warns_nothing_and_is_saved(daemon, caplog):
    caplog.set_level(logging.INFO)
    conn = make_conn(KVStoreClient(daemon[0], same_host=False, timeout_s=10), chunk=64)
    conn.store.clear()
    toks = _run(conn, 200)  # 64-token chunks: 2048 bytes
    conn.close()
    assert _limit_warnings(caplog) == []
    st = conn.get_stats()
    assert st["kvstore_save_errors"] == 0 and st["kvstore_saved_chunks"] == 3
    with KVStoreClient(daemon[0], same_host=False, timeout_s=10) as c:
        assert c.lookup_keys(conn.ns, conn.ns.chunk_keys(toks)).num_hit_chunks == 3
        c.clear()


def test_limits_unknown_at_start_warn_once_at_the_first_failed_save(daemon, caplog,
                                                                   monkeypatch):
    """The daemon's limit not known at start (not answering then): the first save's
    ``ChunkTooLarge`` logs the same single warning, and later saves are skipped."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(chunk_limit, "oversize", lambda *a, **k: None)
    conn = make_conn(KVStoreClient(daemon[0], same_host=False, timeout_s=10), chunk=CHUNK)
    conn.store.clear()
    _run(conn, 1000, budget=256)  # 3 full chunks, one saved per prefill step
    conn.close()
    warned = _limit_warnings(caplog)
    assert len(warned) == 1, warned
    assert str(BODY) in warned[0] and "--kvstore-chunk-size" in warned[0]
    st = conn.get_stats()
    assert st["kvstore_saved_chunks"] == 0 and st["kvstore_save_errors"] >= 1


def test_no_daemon_no_check():
    from tests.connectors.fake_engine import make_store
    store = make_store()
    assert chunk_limit.daemon_client(store) is None
    assert not chunk_limit.saves_go_to_daemon_only(store)

"""The connector logs a store failure once per kind of operation *and cause*: a daemon that
first refuses connections and later answers 400 to every save logs both, and a cause is
logged again when it comes back after saves worked again (rate-limited per kind).

Real connector, save queue and scheduler (``fake_engine``) over a ``ChunkStore`` whose puts
raise scripted errors; block size 4, chunks of 4 tokens.
"""
from __future__ import annotations

import logging

from kvstore.config import StoreConfig
from kvstore.errors import RemoteError, StoreUnavailable
from kvstore.store import ChunkStore

from tests.connectors.fake_engine import FakeEngine, make_conn, prompt

REFUSED = StoreUnavailable("POST http://127.0.0.1:18611/v1/put: connection refused (2 tries)")
REFUSED_LATER = StoreUnavailable("POST http://127.0.0.1:18611/v1/put: connection refused "
                                 "(3 tries)")   # same cause: only numbers differ
TOO_SMALL = RemoteError(400, "namespace 0ccc refused: a 5898240-byte chunk does not fit the "
                             "disk tier (1048576 bytes)")


class _ScriptedStore(ChunkStore):
    """Puts raise ``error`` while it is set, else store."""

    error: Exception | None = None

    def put_chunks(self, ns, keys, kvs, parents=None):
        if self.error is not None:
            raise self.error
        return super().put_chunks(ns, keys, kvs, parents)


def _save_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("kv connector: save")]


def _requests(eng, conn, rid: str, n: int, base: int) -> None:
    """``n`` requests of 8 distinct tokens each (2 chunks to save), run and saved."""
    for i in range(n):
        eng.add(f"{rid}{i}", prompt(8, base=base + 50 * i))
    eng.run()
    assert conn.wait_for_save(5)


def test_each_cause_is_logged_and_again_after_a_recovery(caplog):
    store = _ScriptedStore(StoreConfig(cpu_bytes="1MiB"))
    conn = make_conn(store, chunk=4)
    conn.stats.relog_interval_s = 0.0   # rate limit off: the recovery alone re-arms
    eng = FakeEngine(conn, prefix_caching=False)
    with caplog.at_level(logging.INFO, logger="connectors.engine_min"):
        store.error = REFUSED
        _requests(eng, conn, "a", 2, 100)
        store.error = REFUSED_LATER
        _requests(eng, conn, "b", 1, 300)
        assert len(_save_lines(caplog)) == 1            # the same cause: one line
        store.error = TOO_SMALL                          # a new, permanent cause
        _requests(eng, conn, "c", 2, 500)
        lines = _save_lines(caplog)
        assert len(lines) == 2 and "RemoteError: kvstore server error 400" in lines[1]
        store.error = None                               # recovered
        _requests(eng, conn, "d", 1, 700)
        assert _save_lines(caplog)[2] == "kv connector: save works again (5 failures since " \
                                         "it last worked)"
        store.error = TOO_SMALL                          # fails anew: logged again
        _requests(eng, conn, "e", 1, 900)
    lines = _save_lines(caplog)
    assert len(lines) == 4 and lines[3] == lines[1]
    st = conn.get_stats()
    assert st["kvstore_save_errors"] == 6 and st["kvstore_saved_chunks"] == 2
    conn.close()


def test_relogging_a_cause_is_rate_limited(caplog):
    store = _ScriptedStore(StoreConfig(cpu_bytes="1MiB"))
    conn = make_conn(store, chunk=4)       # default relog_interval_s: 30 s
    eng = FakeEngine(conn, prefix_caching=False)
    with caplog.at_level(logging.WARNING, logger="connectors.engine_min"):
        for i in range(3):                 # flapping: fails, works, fails ...
            store.error = TOO_SMALL
            _requests(eng, conn, f"x{i}", 1, 100 + 200 * i)
            store.error = None
            _requests(eng, conn, f"y{i}", 1, 200 + 200 * i)
        store.error = REFUSED              # a new cause is not held back
        _requests(eng, conn, "z", 1, 900)
    lines = _save_lines(caplog)
    assert len(lines) == 2 and "400" in lines[0] and "connection refused" in lines[1]
    assert conn.get_stats()["kvstore_save_errors"] == 4
    conn.close()


def test_tail_saves_succeeding_do_not_rearm_failing_full_chunk_saves(caplog):
    """A daemon's small disk tier refuses the full-chunk namespace (400) but stores the
    smaller tail pieces: the full saves' cause is logged once, not after every tail save."""
    class _FullRefused(ChunkStore):
        def put_chunks(self, ns, keys, kvs, parents=None):
            if ns.layout.chunk_size == 8:
                raise TOO_SMALL
            return super().put_chunks(ns, keys, kvs, parents)

    conn = make_conn(_FullRefused(StoreConfig(cpu_bytes="1MiB")), chunk=8)
    conn.stats.relog_interval_s = 0.0
    eng = FakeEngine(conn, prefix_caching=False)
    with caplog.at_level(logging.INFO, logger="connectors.engine_min"):
        for i in range(3):                 # 8 + 4 tokens: one full chunk, one tail piece
            eng.add(f"r{i}", prompt(12, base=100 + 50 * i))
            eng.run()
            assert conn.wait_for_save(5)
    st = conn.get_stats()
    assert st["kvstore_save_errors"] >= 3 and st["kvstore_saved_tail_chunks"] >= 3
    assert _save_lines(caplog) == [
        f"kv connector: save failed (RemoteError: {TOO_SMALL}) (logged once per cause until it "
        f"recovers)"]
    conn.close()

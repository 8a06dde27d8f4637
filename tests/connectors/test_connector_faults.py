"""EngineMinConnector with the stand-in engine of ``fake_engine`` against a failing store: missing
chunks, stalled loads and lookups, and store errors fall back to recomputing, never failing a
request.

Block size 4 throughout; chunk sizes 4 or 8.
"""
from __future__ import annotations

import time

import torch

from connectors.engine_min import EngineMinConnector
from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.store import ChunkStore

from tests.connectors.fake_engine import STORE_MARK, FakeEngine, kv_value, make_conn, prompt


# ---- robustness ----------------------------------------------------------------------------
def test_chunk_removed_from_the_middle_stops_the_hit_before_it():
    toks = prompt(33)
    conn = make_conn(chunk=8)
    eng = FakeEngine(conn, prefix_caching=False)
    ps = PrefixStore(conn.store, conn.ns)
    ps.put(toks, kv_value(toks, 0, 32, STORE_MARK))
    conn.store.remove(conn.ns, ps.keys(toks)[2:3])      # chunk 2 = tokens [16, 24)
    seq = eng.add("r", toks)
    eng.step()
    assert seq.num_cached_tokens == 16 and eng.computed_tokens == 17
    assert torch.equal(eng.seq_kv(seq, 16, 33), kv_value(toks, 16, 33))
    conn.close()


class _Flaky(ChunkStore):
    """A store whose get_chunks misses from chunk ``miss_from`` on, or stalls."""

    miss_from: int | None = None
    stall_s: float = 0.0
    lookup_stall_s: float = 0.0

    def lookup_keys(self, ns, keys):
        time.sleep(self.lookup_stall_s)
        return super().lookup_keys(ns, keys)

    def get_chunks(self, ns, keys):
        time.sleep(self.stall_s)
        out = super().get_chunks(ns, keys)
        if self.miss_from is not None:
            out[self.miss_from:] = [None] * (len(out) - self.miss_from)
        return out


def _flaky_run(caplog, **flaw):
    toks = prompt(33)
    store = _Flaky(StoreConfig(cpu_bytes="1MiB"))
    conn = EngineMinConnector(store, chunk_size=8, deadline_s=0.2, deadline_s_per_chunk=0.0)
    eng = FakeEngine(conn, prefix_caching=False)
    PrefixStore(store, conn.ns).put(toks, kv_value(toks, 0, 32, STORE_MARK))
    for k, v in flaw.items():
        setattr(store, k, v)
    seqs = []
    for i in range(2):
        seqs.append(eng.add(f"r{i}", toks))
        eng.run()
    return eng, conn, seqs, toks


def test_partial_load_leaves_num_computed_at_what_landed(caplog):
    eng, conn, seqs, toks = _flaky_run(caplog, miss_from=1)
    for seq in seqs:
        assert seq.num_cached_tokens == 8 and seq.is_finished
    assert eng.computed_tokens == 2 * 25
    st = conn.get_stats()
    assert (st["kvstore_fallbacks"], st["kvstore_load_failed_tokens"]) == (2, 48)
    assert st["external_prefix_cache_hits"] == 16
    assert sum("recomputing the rest" in r.message for r in caplog.records) == 1  # logged once
    conn.close()


def test_stalled_load_misses_deadline_and_recomputes(caplog):
    eng, conn, seqs, toks = _flaky_run(caplog, stall_s=1.0)
    assert [s.num_cached_tokens for s in seqs] == [0, 0]
    assert eng.computed_tokens == 66
    st = conn.get_stats()
    assert st["kvstore_load_fallbacks"] == 2 and st["external_prefix_cache_hits"] == 0
    assert st["kvstore_load_seconds_max"] < 0.6
    assert sum("missed its deadline" in r.message for r in caplog.records) == 1
    conn.close()


def test_stalled_lookup_misses_deadline_and_recomputes(caplog):
    eng, conn, seqs, toks = _flaky_run(caplog, lookup_stall_s=1.0)
    assert [s.num_cached_tokens for s in seqs] == [0, 0]
    st = conn.get_stats()
    assert st["kvstore_lookup_fallbacks"] == 2 and st["kvstore_lookup_seconds_max"] < 0.6
    conn.close()


def test_failing_store_never_fails_a_request(caplog):
    class Broken(ChunkStore):
        def lookup_keys(self, ns, keys):
            raise OSError("disk on fire")

        def put_chunks(self, ns, keys, kvs):
            raise OSError("disk on fire")

    conn = make_conn(Broken(StoreConfig(cpu_bytes="1MiB")), chunk=4)
    eng = FakeEngine(conn, prefix_caching=False)
    seq = eng.add("a", prompt(16), max_tokens=3)
    eng.run()
    assert seq.is_finished and conn.wait_for_save(5)
    st = conn.get_stats()
    assert st["kvstore_lookup_fallbacks"] == 1 and st["kvstore_save_errors"] >= 1
    conn.close()

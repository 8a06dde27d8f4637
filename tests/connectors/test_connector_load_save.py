"""EngineMinConnector with the stand-in engine of ``fake_engine``: chunk geometry, which tokens an
admission loads and where, which chunks are saved, and how lookups and hits are counted.

Block size 4 throughout; chunk sizes 4 or 8.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from connectors.chunk_geometry import ChunkGeometry
from connectors.engine_min import EngineMinConnector
from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.store import ChunkStore

from tests.connectors.fake_engine import (
    BS, D, H, L, STORE_MARK, FakeEngine, kv_value, make_conn, prompt,
)


# ---- index arithmetic ----------------------------------------------------------------------
def test_chunk_geometry_arithmetic():
    m = ChunkGeometry(4, 8)
    assert m.blocks_per_chunk == 2
    assert m.num_external_tokens(num_tokens=40, num_local=16, num_hit=24) == 8
    assert m.num_external_tokens(num_tokens=40, num_local=20, num_hit=16) == 0
    assert m.num_external_tokens(num_tokens=16, num_local=0, num_hit=16) == 15  # last token computed
    assert m.num_external_tokens(num_tokens=40, num_local=6, num_hit=24) == 0   # not block aligned
    p = m.load_plan(20, 12)   # tokens [20, 32): chunks 2..3, blocks 5..7
    assert (p.first_chunk, p.last_chunk, p.first_block, p.last_block) == (2, 4, 5, 8)
    assert m.landed_end(p, 1) == 24 and m.landed_end(p, 0) == 20 and m.landed_end(p, 2) == 32
    assert list(m.chunks_to_save(8, 31)) == [1, 2] and list(m.chunks_to_save(24, 31)) == []
    assert m.chunk_blocks([9, 8, 7, 6, 5], 1) == [7, 6]
    with pytest.raises(ValueError, match="multiple of the engine's block_size=4"):
        ChunkGeometry(4, 6)
    with pytest.raises(ValueError, match="overwrite computed slots"):
        m.load_plan(6, 8)
    with pytest.raises(ValueError, match="block table has 5"):
        m.chunk_blocks([1, 2, 3, 4, 5], 2)


def test_chunk_size_not_multiple_of_block_size_is_a_clear_error():
    conn = make_conn(chunk=6)
    with pytest.raises(ValueError, match="chunk_size=6 must be a multiple"):
        conn.register_kv_caches(torch.zeros(L, 2, 4, BS, H, D), BS)
    conn.close()


# ---- admission: what is loaded, and where --------------------------------------------------
def _local_then_store(num_local, num_store, n=40):
    """An engine holding ``num_local`` tokens of a prompt in its prefix cache and a store
    holding ``num_store`` (marked) tokens of it; returns (engine, seq) after the admission step."""
    toks = prompt(n)
    conn = make_conn(chunk=8)
    eng = FakeEngine(conn)
    # fill the engine's prefix cache with num_local tokens: run the prefix as its own request
    if num_local:
        eng.add("warm", toks[:num_local] + [1])
        eng.run()
        conn.wait_for_save(5)
        conn.store.clear()
    PrefixStore(conn.store, conn.ns).put(toks, kv_value(toks, 0, num_store, STORE_MARK))
    eng.computed_tokens = 0
    seq = eng.add("r", toks)
    eng.step()
    return eng, seq, conn


def test_store_hit_24_with_16_local_loads_exactly_8_and_never_overwrites_computed_slots():
    eng, seq, conn = _local_then_store(16, 24)
    assert seq.num_cached_tokens == 24
    st = conn.get_stats()
    assert (st["kvstore_loaded_tokens"], st["external_prefix_cache_hits"]) == (8, 8)
    assert st["kvstore_hit_tokens_by_tier"] == {"cpu": 8}
    toks = seq.token_ids
    assert torch.equal(eng.seq_kv(seq, 0, 16), kv_value(toks, 0, 16))             # untouched
    assert torch.equal(eng.seq_kv(seq, 16, 24), kv_value(toks, 16, 24, STORE_MARK))  # loaded
    assert torch.equal(eng.seq_kv(seq, 24, 40), kv_value(toks, 24, 40))             # computed
    assert eng.computed_tokens == 40 - 24
    conn.close()


def test_store_16_with_20_local_loads_nothing():
    eng, seq, conn = _local_then_store(20, 16)
    assert seq.num_cached_tokens == 20
    st = conn.get_stats()
    assert (st["kvstore_loaded_tokens"], st["external_prefix_cache_hits"]) == (0, 0)
    assert torch.equal(eng.seq_kv(seq, 0, 40), kv_value(seq.token_ids, 0, 40))
    conn.close()


def test_store_hit_with_unaligned_local_start_loads_the_chunk_tail_only():
    eng, seq, conn = _local_then_store(20, 32)   # chunk 2 = [16, 24) is partly local
    assert seq.num_cached_tokens == 32
    toks = seq.token_ids
    assert conn.get_stats()["kvstore_loaded_tokens"] == 12
    assert torch.equal(eng.seq_kv(seq, 0, 20), kv_value(toks, 0, 20))
    assert torch.equal(eng.seq_kv(seq, 20, 32), kv_value(toks, 20, 32, STORE_MARK))
    conn.close()


def test_full_prompt_hit_loads_all_but_the_last_token():
    toks = prompt(16)
    conn = make_conn(chunk=8)
    eng = FakeEngine(conn, prefix_caching=False)
    PrefixStore(conn.store, conn.ns).put(toks, kv_value(toks, 0, 16, STORE_MARK))
    seq = eng.add("r", toks)
    eng.step()
    assert seq.num_cached_tokens == 15 and eng.computed_tokens == 1
    assert conn.get_stats()["external_prefix_cache_hits"] == 15
    conn.close()


# ---- saves ---------------------------------------------------------------------------------
def test_prompt_prefilled_in_6_token_slices_stores_all_4_chunks_and_replays():
    toks = prompt(16)
    conn = make_conn(chunk=4)
    eng = FakeEngine(conn, budget=6, prefix_caching=False)
    eng.add("a", toks, max_tokens=1)
    eng.run()
    assert conn.wait_for_save(5)
    ps = PrefixStore(conn.store, conn.ns)
    assert ps.lookup(toks).num_hit_chunks == 4
    assert torch.equal(ps.get(toks, 16), kv_value(toks, 0, 16))
    eng.computed_tokens = 0
    seq = eng.add("b", toks, max_tokens=1)
    eng.step()
    assert seq.num_cached_tokens == 15 and eng.computed_tokens == 1
    assert torch.equal(eng.seq_kv(seq, 0, 16), kv_value(toks, 0, 16))
    conn.close()


def test_generated_tokens_full_chunks_are_saved_at_request_end_partial_ones_not():
    toks = prompt(10)
    for save_generated, want in ((True, 4), (False, 2)):
        conn = make_conn(chunk=4, save_generated=save_generated)
        eng = FakeEngine(conn, prefix_caching=False)
        seq = eng.add("a", toks, max_tokens=9)   # 19 tokens, 18 with KV: 4 full chunks
        eng.run()
        assert conn.wait_for_save(5)
        assert seq.num_tokens == 19
        assert PrefixStore(conn.store, conn.ns).lookup(seq.token_ids).num_hit_chunks == want
        assert conn.get_stats()["kvstore_saved_chunks"] == want
        conn.close()


def test_full_save_queue_drops_and_counts_without_blocking():
    gate = threading.Event()

    class SlowPut(ChunkStore):
        def put_chunks(self, ns, keys, kvs):
            gate.wait(10)
            return super().put_chunks(ns, keys, kvs)

    store = SlowPut(StoreConfig(cpu_bytes="1MiB"))
    conn = EngineMinConnector(store, chunk_size=4, deadline_s=5.0, save_queue_bytes=1)
    eng = FakeEngine(conn, prefix_caching=False)
    t0 = time.perf_counter()
    eng.add("a", prompt(8, 100), max_tokens=1)
    eng.add("b", prompt(8, 300), max_tokens=1)
    eng.run()
    assert time.perf_counter() - t0 < 5   # the writer is stuck; the engine is not
    st = conn.get_stats()
    assert st["kvstore_queued_chunks"] == 2 and st["kvstore_dropped_save_chunks"] == 2
    gate.set()
    assert conn.wait_for_save(5)
    assert conn.get_stats()["kvstore_saved_chunks"] == 2
    conn.close()


# ---- counting ------------------------------------------------------------------------------
def test_repeated_lookups_while_waiting_do_not_inflate_counts():
    calls = []

    class Counting(ChunkStore):
        def lookup_keys(self, ns, keys):
            calls.append(len(keys))
            return super().lookup_keys(ns, keys)

    conn = make_conn(Counting(StoreConfig(cpu_bytes="1MiB")), chunk=4)
    eng = FakeEngine(conn, num_blocks=7, prefix_caching=False)   # 6 usable blocks = 24 tokens
    toks_a, toks_b = prompt(20, 100), prompt(16, 300)
    PrefixStore(conn.store, conn.ns).put(toks_b, kv_value(toks_b, 0, 16))
    eng.add("a", toks_a, max_tokens=4)
    b = eng.add("b", toks_b, max_tokens=1)
    for _ in range(3):   # b waits: a holds 5 of 6 blocks
        eng.step()
        assert b.status.value == "waiting"
    for _ in range(3):
        assert conn.get_num_new_matched_tokens(b, 0) == (15, False)
    assert calls.count(4) == 1      # b looked up once, its answer cached while it waits
    assert conn.get_stats()["external_prefix_cache_queries"] == 20
    eng.run()
    st = conn.get_stats()
    assert (st["external_prefix_cache_queries"], st["external_prefix_cache_hits"]) == (36, 15)
    assert st["kvstore_requests"] == 2
    conn.close()


def test_preemption_does_not_double_count():
    conn = make_conn(chunk=4)
    eng = FakeEngine(conn, num_blocks=9, budget=64, prefix_caching=False)   # 8 blocks
    ta, tb = prompt(12, 100), prompt(12, 300)
    ps = PrefixStore(conn.store, conn.ns)
    ps.put(tb, kv_value(tb, 0, 8))
    eng.add("a", ta, max_tokens=12)
    b = eng.add("b", tb, max_tokens=12)
    eng.run(200)
    assert eng.sched.num_preemptions >= 1
    st = conn.get_stats()
    assert st["external_prefix_cache_queries"] == 24
    # b's first admission loaded 8 tokens; readmissions reload real bytes but count no new hits
    assert st["external_prefix_cache_hits"] == 8
    assert st["kvstore_loaded_tokens"] >= 8
    assert b.is_finished
    conn.close()

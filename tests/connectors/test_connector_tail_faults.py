"""Trying to break EngineMinConnector's tail pieces (``tail_chunk_size``) with the stand-in engine
of ``fake_engine`` (real Scheduler and BlockManager; the KV of token t at position p is
``t * 10 + p``): odd prompt lengths, prompts shorter than a piece, chat rounds, preemption,
removed chunks, bad sizes, and a daemon (``KVStoreClient``) behind the connector.

Block size 4, chunk C = 8, pieces F = 4. After every run: the loaded slots hold exactly the
KV the first run computed, the store passes ``check_integrity()`` and no reader pin is left.
"""
from __future__ import annotations

import pytest
import torch

from connectors.engine_min import EngineMinConnector
from kvstore.api import PrefixStore
from kvstore.daemon.client import KVStoreClient
from kvstore.config import StoreConfig
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore
from tests.connectors.fake_engine import BS, FakeEngine, kv_value, prompt

C, F = 8, 4


@pytest.fixture(params=["inproc", "disk-only", "daemon"])
def store_kind(request, tmp_path):
    """(store the connector uses, the ChunkStore behind it)."""
    if request.param == "disk-only":  # borrowed loads go through read_lower
        backing = ChunkStore(StoreConfig(cpu_bytes=0, disk_path=str(tmp_path / "db"),
                                         disk_bytes=64 << 20))
    else:
        backing = ChunkStore(StoreConfig(cpu_bytes="1MiB"))
    if request.param != "daemon":
        yield backing, backing
    else:
        srv = ThreadedServer(create_app(backing, ServerLimits()))
        client = KVStoreClient(srv.url, timeout_s=10)
        yield client, backing
        client.close()
        srv.stop()
    assert backing._pins.pinned_keys() == set()
    backing.check_integrity()
    backing.close()


def conn_for(store, **kw) -> EngineMinConnector:
    return EngineMinConnector(store, chunk_size=C, tail_chunk_size=F, deadline_s=10.0,
                              owns_store=False, **kw)


def first_run(conn, toks, max_tokens=1, **eng_kw):
    eng = FakeEngine(conn, prefix_caching=False, **eng_kw)
    seq = eng.add("first", toks, max_tokens=max_tokens)
    eng.run()
    assert conn.wait_for_save(10)
    return eng, seq


def second_run(conn, toks, rid="second"):
    eng = FakeEngine(conn, prefix_caching=False)
    seq = eng.add(rid, toks)
    eng.step()
    return eng, seq


@pytest.mark.parametrize("n, cached, full, tail", [
    (3, 0, 0, 0),     # shorter than a piece: nothing stored, nothing loaded
    (4, 3, 0, 1),     # one whole piece: all but the last token (it must be computed)
    (5, 4, 0, 1),     # one piece and a token
    (7, 4, 0, 1),
    (8, 7, 1, 0),     # exactly a chunk: the chunk, not pieces
    (11, 8, 1, 0),    # chunk + 3 tokens: no whole piece past the chunk
    (12, 11, 1, 1),   # chunk + a piece: all but the last token
    (13, 12, 1, 1),
    (23, 20, 2, 1),   # two chunks + a piece + 3
])
def test_odd_prompt_lengths_store_and_load_exactly_the_arithmetic(store_kind, n, cached, full,
                                                                 tail):
    store, backing = store_kind
    conn = conn_for(store)
    toks = prompt(n)
    first_run(conn, toks)
    st = conn.get_stats()
    assert (st["kvstore_saved_chunks"], st["kvstore_saved_tail_chunks"]) == (full, tail)
    eng, seq = second_run(conn, toks)
    assert seq.num_cached_tokens == cached
    st = conn.get_stats()
    assert st["external_prefix_cache_hits"] == cached
    assert eng.computed_tokens == n - cached
    assert torch.equal(eng.seq_kv(seq, 0, n), kv_value(toks, 0, n))
    conn.close()


def test_chat_round_two_reuses_round_one_answer_pieces(store_kind):
    store, backing = store_kind
    conn = conn_for(store)
    r1 = prompt(10)
    eng, seq = first_run(conn, r1, max_tokens=7)          # 17 tokens, 16 with KV
    # request end saved chunk 1 = [8, 16); no piece past 16 (only 0 whole ones)
    r2 = list(seq.token_ids) + prompt(6, 500)             # 23 tokens
    eng2, s2 = second_run(conn, r2)
    assert s2.num_cached_tokens == 16
    assert torch.equal(eng2.seq_kv(s2, 0, 23), kv_value(r2, 0, 23))
    conn.close()


def test_a_changed_token_inside_a_piece_misses_only_that_piece(store_kind):
    store, backing = store_kind
    conn = conn_for(store)
    toks = prompt(21)                       # chunks [0,16), pieces [16,20)
    first_run(conn, toks)
    other = toks[:18] + [9999] + toks[19:]  # differs inside piece [16, 20)
    eng, seq = second_run(conn, other)
    assert seq.num_cached_tokens == 16
    assert torch.equal(eng.seq_kv(seq, 0, 21), kv_value(other, 0, 21))
    conn.close()


def test_removed_full_chunk_makes_its_pieces_unreachable(store_kind):
    store, backing = store_kind
    conn = conn_for(store)
    toks = prompt(13)
    first_run(conn, toks)
    ps = PrefixStore(backing, conn.ns)
    assert backing.remove(conn.ns, ps.keys(toks)[:1]) == 1
    eng, seq = second_run(conn, toks)
    assert seq.num_cached_tokens == 0 and eng.computed_tokens == 13
    conn.close()


def test_preemption_with_tail_pieces_loads_exact_bytes_and_counts_once(store_kind):
    store, backing = store_kind
    conn = conn_for(store)
    tb = prompt(14, 300)                                   # chunk + piece + 2
    first_run(conn, tb)
    conn.c.update({k: 0 for k in conn.c})                  # count the contended run only
    eng = FakeEngine(conn, num_blocks=9, budget=64, prefix_caching=False)   # 8 blocks
    eng.add("a", prompt(14, 100), max_tokens=12)
    b = eng.add("b", tb, max_tokens=12)
    eng.run(300)
    assert eng.sched.num_preemptions >= 1 and b.is_finished
    st = conn.get_stats()
    assert st["external_prefix_cache_hits"] == 12          # b's first admission only
    assert st["kvstore_loaded_tokens"] >= 12
    n = b.num_tokens - 1
    assert torch.equal(eng.seq_kv(b, 0, n), kv_value(b.token_ids, 0, n))
    conn.close()


@pytest.mark.parametrize("bad", [-4, 3, 8, 16, True, 4.0, "4"])   # (None: the default)
def test_bad_tail_chunk_sizes_are_refused_at_construction(bad):
    with pytest.raises(ValueError, match="tail_chunk_size"):
        EngineMinConnector(ChunkStore(StoreConfig(cpu_bytes="1MiB")), chunk_size=C,
                           tail_chunk_size=bad)


def test_tail_chunk_size_not_a_multiple_of_the_block_size_is_refused_at_binding():
    conn = EngineMinConnector(ChunkStore(StoreConfig(cpu_bytes="1MiB")), chunk_size=C,
                              tail_chunk_size=2)
    with pytest.raises(ValueError, match="multiple of the engine's block_size=4"):
        conn.register_kv_caches(torch.zeros(2, 2, 4, BS, 1, 2), BS)
    conn.close()


def test_tail_flag_without_any_store_flag_is_a_clear_error_not_ignored():
    import argparse

    from engine_min.serve.cli import add_serve_args, build_connector
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    assert build_connector(parse([])) is None
    assert build_connector(parse(["--kvstore-tail-chunk-size", "0"])) is None
    with pytest.raises(SystemExit, match="--kvstore-tail-chunk-size needs a store"):
        build_connector(parse(["--kvstore-tail-chunk-size", "16"]))

"""EngineMinConnector's demotion of superseded tail pieces through every store path (in
process, disk only, a daemon behind ``KVStoreClient``) and when the store's demote fails, with
the stand-in engine of ``fake_engine`` (block size 4; chunks C = 8, pieces F = 4).

A 13-token prompt saves chunk [0, 8) and piece 2 = [8, 12) after its prefill; with 4 tokens
generated (16 with KV) its end saves chunk [8, 16), which covers piece 2: piece 2 is demoted
in the store behind the connector. A second request of the same 13 tokens still loads
chunk 0 + piece 2 (12 tokens), which lifts the demotion.
"""
from __future__ import annotations

import torch

from kvstore.config import StoreConfig
from kvstore.store import ChunkStore
from tests.connectors.fake_engine import kv_value, prompt
from tests.connectors.test_connector_tail_faults import conn_for, first_run, second_run
from tests.connectors.test_connector_tail_faults import store_kind  # noqa: F401  (fixture)


def test_the_answer_filling_the_chunk_demotes_piece_2_on_every_store_path(store_kind):  # noqa: F811
    store, backing = store_kind
    conn = conn_for(store)
    toks = prompt(13)
    eng, seq = first_run(conn, toks, max_tokens=4)       # 17 tokens, 16 with KV
    st = conn.get_stats()
    assert (st["kvstore_saved_chunks"], st["kvstore_saved_tail_chunks"]) == (2, 1)
    assert (st["kvstore_demoted_tail_chunks"], st["kvstore_demote_errors"]) == (1, 0)
    piece2 = conn.tail_ns.chunk_keys(toks)[2]
    tier = backing.tiers[0]
    assert tier.is_demoted(piece2) and tier.policy.num_demoted == 1
    assert backing.stats()["demoted_chunks"] == 1
    eng2, s2 = second_run(conn, toks)
    assert s2.num_cached_tokens == 12                    # chunk 0 + piece 2, as before
    assert torch.equal(eng2.seq_kv(s2, 0, 13), kv_value(toks, 0, 13))
    assert not tier.is_demoted(piece2)                   # read: it proved useful
    conn.close()


class FailingDemote(ChunkStore):
    """A store whose ``demote`` fails (a daemon gone between the put and the demote)."""

    def demote(self, ns, keys):
        raise OSError("connection reset")


def test_a_failing_demote_is_counted_and_the_chunk_is_saved_anyway():
    store = FailingDemote(StoreConfig(cpu_bytes="1MiB"))
    conn = conn_for(store)
    toks = prompt(13)
    first_run(conn, toks, max_tokens=4)
    st = conn.get_stats()
    assert (st["kvstore_saved_chunks"], st["kvstore_demote_errors"]) == (2, 1)
    assert st["kvstore_demoted_tail_chunks"] == 0 and st["kvstore_save_errors"] == 0
    assert store.stats()["stored_chunks"] == 3           # chunks 0, 1 and piece 2
    assert store.tiers[0].policy.num_demoted == 0
    conn.close()
    store.close()


class NoDemote(ChunkStore):
    """The control: a store that keeps no demotion (``KVStoreBase``'s default)."""

    def demote(self, ns, keys):
        return 0


def test_under_pressure_the_demoted_piece_goes_before_an_older_chunk():
    """CPU tier of 8 pages of 128 bytes (a chunk: 2 pages, a piece: 1). Stored in this order:
    chunk X of another prompt, then the 13-token request's chunk 0, piece 2 and chunk 1 (7
    pages). An 8-token prompt then needs 2 pages with 1 free: LRU alone evicts X, the oldest
    chunk with no child; with demotion piece 2 goes instead and X stays."""
    gone = {}
    for cls in (NoDemote, ChunkStore):
        store = cls(StoreConfig(cpu_bytes=8 * 128, page_bytes=128))
        conn = conn_for(store)
        other, toks, new = prompt(8, 300), prompt(13), prompt(8, 700)
        first_run(conn, other)
        first_run(conn, toks, max_tokens=4)
        assert store.stats()["tiers"]["cpu"]["used_bytes"] == 7 * 128
        first_run(conn, new)
        x, c0 = conn.ns.chunk_keys(other)[0], conn.ns.chunk_keys(toks)[0]
        piece2 = conn.tail_ns.chunk_keys(toks)[2]
        assert store.exists(conn.ns, [c0, conn.ns.chunk_keys(new)[0]]) == [True, True]
        kept = store.exists(conn.ns, [x])[0], store.exists(conn.tail_ns, [piece2])[0]
        gone[cls.__name__] = [name for name, k in zip(("X", "piece 2"), kept) if not k]
        store.check_integrity()
        conn.close()
        store.close()
    assert gone == {"NoDemote": ["X"], "ChunkStore": ["piece 2"]}

"""``demote`` on the store: demoted chunks are the first to go when a put needs room, before
the LRU order would pick them; a spill carries the demotion to the tier below; a read lifts it;
the count and the metric; the layered store demotes in both parts.

Tiny layout of ``store_helpers`` (128-byte chunks of 4 tokens, one page each); tail pieces are
chunks of 2 tokens in a namespace of their own (64 bytes, one page each).
"""
import dataclasses

import pytest

from kvstore.api import chain_parents
from kvstore.keys import Namespace
from kvstore.layered import LayeredStore

from tests.kvstore.store_helpers import LAY, NS, kv_for, make, prompt

TAIL = Namespace("tiny", dataclasses.replace(LAY, chunk_size=2))
DOC = [7, 8, 9, 10]                      # a prompt whose tail is stored as two pieces
OTHER = Namespace("other", LAY)


def put_pieces(s):
    """Pieces p0, p1 of DOC (chained: p1's parent is p0); returns their keys."""
    keys = TAIL.chunk_keys(DOC)
    assert s.put_chunks(TAIL, keys, [kv_for(DOC[:2]), kv_for(DOC[2:])],
                        chain_parents(keys)) == 2
    return keys


def put_chunk(s, i):
    """Full chunk of prompt i (a first chunk); returns its key."""
    (key,) = NS.chunk_keys(prompt(i))
    assert s.put_chunks(NS, [key], [kv_for(prompt(i))]) == 1
    return key


def fill_then_read_pieces(demote):
    """A CPU tier of 4 pages: pieces p0, p1, chunks a, b; the pieces are read (most recently
    used now), optionally demoted; then chunks c and d are put. Returns (store, evicted keys
    in order, keys)."""
    s = make(cpu=4)
    s.register(TAIL)
    p0, p1 = put_pieces(s)
    a, b = put_chunk(s, 0), put_chunk(s, 1)
    assert all(kv is not None for kv in s.get_chunks(TAIL, [p0, p1]))
    if demote:
        assert s.demote(TAIL, [p0, p1]) == 2
    cpu = s.tiers[0]
    gone = []
    for i in (2, 3):
        before = set(cpu.keys())
        put_chunk(s, i)
        gone += sorted(before - set(cpu.keys()), key=[p0, p1, a, b].index)
        s.check_integrity()
    return s, gone, (p0, p1, a, b)


def test_demoted_pieces_are_evicted_first_where_lru_would_evict_the_chunks():
    s, gone, (p0, p1, a, b) = fill_then_read_pieces(demote=False)
    assert gone == [a, b]            # LRU: the pieces were read last, the chunks go
    assert s.stats()["demoted_chunks"] == 0
    s.close()
    s, gone, (p0, p1, a, b) = fill_then_read_pieces(demote=True)
    assert gone == [p1, p0]          # demoted: the leaf piece, then its parent, before a and b
    assert s.exists(NS, [a, b]) == [True, True]
    assert s.stats()["demoted_chunks"] == 2
    assert s.metrics.registry.get_sample_value("kvstore_demoted_chunks_total") == 2
    s.close()


def test_demote_counts_stored_keys_only_and_checks_the_namespace():
    s = make(cpu=4)
    s.register(TAIL)
    p0, p1 = put_pieces(s)
    absent = TAIL.chunk_keys([1, 2])[0]
    assert s.demote(TAIL, [p1, absent]) == 1
    assert s.tiers[0].is_demoted(p1) and not s.tiers[0].is_demoted(p0)
    with pytest.raises(ValueError):
        s.demote(OTHER, [p0])            # a key of another namespace
    assert s.demote(TAIL, []) == 0
    s.check_integrity()
    s.close()


def test_a_read_lifts_the_demotion_and_lru_order_returns():
    s = make(cpu=3)
    s.register(TAIL)
    p0, p1 = put_pieces(s)
    a = put_chunk(s, 0)
    s.demote(TAIL, [p1])
    assert s.get_chunks(TAIL, [p1])[0] is not None     # read: no longer demoted
    assert not s.tiers[0].is_demoted(p1)
    put_chunk(s, 1)
    assert s.exists(TAIL, [p0, p1]) == [True, True] and s.exists(NS, [a]) == [False]
    s.check_integrity()
    s.close()


def test_a_spilled_demoted_piece_stays_demoted_on_disk(tmp_path):
    s = make(tmp_path, cpu=2, disk=10**6, promote_on_hit=False)
    s.register(TAIL)
    p0, p1 = put_pieces(s)
    assert s.demote(TAIL, [p0, p1]) == 2
    put_chunk(s, 0)                   # evicts p1 from the CPU tier: spilled to disk
    cpu, disk = s.tiers
    assert disk.contains(p1) and not cpu.contains(p1)
    assert disk.is_demoted(p1) and cpu.is_demoted(p0)
    assert s.demote(TAIL, [p1]) == 1  # counted once though held by one tier only
    s.flush()
    s.check_integrity()
    s.close()


def test_layered_store_demotes_in_the_local_and_the_remote_part():
    local, remote = make(cpu=4), make(cpu=4)
    for st in (local, remote):
        st.register(TAIL)
    p0, p1 = put_pieces(local)
    put_pieces(remote)
    layered = LayeredStore(local, remote)
    assert layered.demote(TAIL, [p0]) == 1
    assert local.tiers[0].is_demoted(p0) and remote.tiers[0].is_demoted(p0)
    assert local.stats()["demoted_chunks"] == 1 == remote.stats()["demoted_chunks"]
    layered.close()


def test_a_demoted_victim_never_keeps_a_newcomer_out_with_tinylfu():
    # CPU tier of 2 one-chunk prompts, LRU, TinyLFU: A and B are put and read twice (3
    # requests each); a newcomer C asked once loses against A (test_admission's scenario) ...
    s = make(cpu=2, admission="tinylfu")
    a, b, c = (NS.chunk_keys(prompt(i))[0] for i in range(3))
    for i in (0, 1):
        put_chunk(s, i)
    for key in (a, a, b, b):
        assert s.get_chunks(NS, [key])[0] is not None
    assert s.put_chunks(NS, [c], [kv_for(prompt(2))]) == 0
    # ... but once A is demoted, C takes its place at the first put
    assert s.demote(NS, [a]) == 1
    assert s.put_chunks(NS, [c], [kv_for(prompt(2))]) == 1
    assert s.exists(NS, [a, b, c]) == [False, True, True]
    s.check_integrity()
    s.close()

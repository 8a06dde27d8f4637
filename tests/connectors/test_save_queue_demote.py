"""The follow-up of a save (``SaveQueue.submit(then=...)``) and ``demote_superseded`` over a
real ``ChunkStore``: the pieces a saved chunk covers are demoted only once the chunk is stored;
a follow-up runs after its put, never after a failed one, and its failure stops nothing.

Tiny layout of ``tests.kvstore.store_helpers`` (chunks of 4 tokens, 128 bytes, one page);
tail pieces of 2 tokens in a namespace of their own."""
import dataclasses
import logging


from connectors.chunk_records import Superseded
from connectors.save_queue import SaveQueue, demote_superseded
from kvstore.keys import Namespace

from tests.kvstore.store_helpers import LAY, NS, kv_for, make

TAIL = Namespace("tiny", dataclasses.replace(LAY, chunk_size=2))
TOKENS = list(range(100, 108))                  # chunks 0, 1; pieces 0..3
CKEYS, PKEYS = NS.chunk_keys(TOKENS), TAIL.chunk_keys(TOKENS)


def store_with_pieces():
    """A store holding chunk 0 and pieces 2, 3 (tokens [4, 8), past chunk 0)."""
    s = make(cpu=8)
    s.register(TAIL)
    assert s.put_chunks(NS, CKEYS[:1], [kv_for(TOKENS[:4])]) == 1
    assert s.put_chunks(TAIL, PKEYS[:4], [kv_for(TOKENS[i:i + 2]) for i in range(0, 8, 2)]) == 4
    return s


SUP = Superseded(TAIL, (PKEYS[2], PKEYS[3]), (0, 0))   # both inside the save's chunk 0 (= chunk 1)


def test_pieces_are_demoted_when_the_chunk_is_newly_stored():
    s = store_with_pieces()
    stored = s.put_chunks(NS, CKEYS[1:], [kv_for(TOKENS[4:])], [CKEYS[0]])
    assert stored == 1
    assert demote_superseded(s, NS, CKEYS[1:], stored, SUP) == 2
    assert [s.tiers[0].is_demoted(k) for k in PKEYS] == [False, False, True, True]
    s.close()


def test_a_rejected_chunk_leaves_its_pieces_and_an_already_stored_one_demotes_them():
    s = store_with_pieces()
    orphan_parent = NS.chunk_keys([9, 9, 9, 9])[0]       # stored nowhere: the put is rejected
    stored = s.put_chunks(NS, CKEYS[1:], [kv_for(TOKENS[4:])], [orphan_parent])
    assert stored == 0 and s.exists(NS, CKEYS[1:]) == [False]
    assert demote_superseded(s, NS, CKEYS[1:], stored, SUP) == 0
    assert s.tiers[0].policy.num_demoted == 0
    assert s.put_chunks(NS, CKEYS[1:], [kv_for(TOKENS[4:])], [CKEYS[0]]) == 1
    again = s.put_chunks(NS, CKEYS[1:], [kv_for(TOKENS[4:])], [CKEYS[0]])
    assert again == 0                                   # stored already: exists says so
    assert demote_superseded(s, NS, CKEYS[1:], again, SUP) == 2
    assert s.stats()["demoted_chunks"] == 2
    s.close()


def test_the_follow_up_runs_after_its_put_only_and_its_failure_stops_nothing(caplog):
    s = store_with_pieces()
    events = []

    def put(ns, keys, kvs, *parents):
        if keys == ["boom"]:
            raise OSError("daemon gone")
        n = s.put_chunks(ns, keys, kvs, *parents)
        events.append(("put", n))
        return n

    def then(stored):
        events.append(("then", stored))
        if stored == 99:
            raise RuntimeError("never")
        events.append(("demoted", demote_superseded(s, NS, CKEYS[1:], stored, SUP)))

    def broken(stored):
        raise RuntimeError("demote failed")

    done = []
    q = SaveQueue(put, capacity_bytes=1 << 20, done=lambda *a: done.append(a[1]))
    for keys, kvs, parents, follow in (
            (["boom"], [], None, then),                                  # put fails: no then
            (CKEYS[:1], [kv_for(TOKENS[:4])], None, broken),             # then raises: logged
            (CKEYS[1:], [kv_for(TOKENS[4:])], [CKEYS[0]], then)):
        assert q.try_reserve(1)
        q.submit(NS, keys, kvs, 1, parents, follow)
    with caplog.at_level(logging.ERROR, logger="connectors.save_queue"):
        assert q.wait(5)
    assert events == [("put", 0), ("put", 1), ("then", 1), ("demoted", 2)]
    assert done == [None, 0, 1]
    assert "save follow-up failed" in caplog.text
    q.close()
    s.close()

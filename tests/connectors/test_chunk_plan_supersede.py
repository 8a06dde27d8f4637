"""Tail pieces a full chunk's save supersedes (``SaveRange.supersedes``), on the connector core
alone: a chunk save names the pieces *this request saved* inside the chunk, with the index of
the chunk covering each; pieces it only loaded (another request's, proved useful by the hit)
are not named. Geometry of ``test_chunk_plan``: blocks of 16, C = 256, F = 64; a 701-token
prompt (2 chunks + pieces 8, 9) that grows to 800 tokens with its answer."""
from __future__ import annotations

from tests.connectors.test_chunk_plan import KEYS, TKEYS, TNS, TOKENS, req

GROWN = TOKENS + [5] * 99                       # 800 tokens: chunk 2 = tokens [512, 768)
GKEYS = TNS.chunk_keys(GROWN)                   # pieces 0..11 of the grown request


def test_the_chunk_filled_by_the_answer_supersedes_the_pieces_the_request_saved():
    r = req(tail=True)
    first = r.chunks_to_save(TOKENS, 701)
    assert first.keys == tuple(KEYS) and first.supersedes is None   # no piece saved yet
    tail = r.pieces_to_save(TOKENS, 701)
    assert tail.keys == tuple(TKEYS[8:10]) and tail.supersedes is None
    more = r.pieces_to_save(GROWN, 704)          # piece 10 [640, 704): answer tokens
    assert more.keys == (GKEYS[10],)
    chunk2 = r.chunks_to_save(GROWN, 790)
    assert (chunk2.first, len(chunk2.keys)) == (2, 1)
    sup = chunk2.supersedes
    assert sup.ns is TNS and sup.keys == (TKEYS[8], TKEYS[9], GKEYS[10])
    assert sup.chunk_index == (0, 0, 0)          # all inside chunk 2 = keys[0] of the save
    assert GKEYS[8:10] == TKEYS[8:10]            # (the same prefix: the same piece keys)
    assert r.pieces_to_save(GROWN, 790) is None  # nothing past chunk 2's start is pending


def test_a_save_of_two_chunks_maps_each_piece_to_its_own_chunk():
    r = req(tail=True)
    pieces = r.pieces_to_save(TOKENS[:200], 200)  # no full chunk saved yet: pieces 0, 1, 2
    assert pieces.first == 0 and pieces.keys == tuple(TKEYS[:3])
    later = r.pieces_to_save(TOKENS[:330], 330)   # from floor_C(330) = 256: piece 4
    assert later.first == 4 and later.keys == (TKEYS[4],) and later.parent is None
    both = r.chunks_to_save(TOKENS, 701)          # chunks 0 and 1 in one save
    assert both.keys == tuple(KEYS)
    assert both.supersedes.keys == (*TKEYS[:3], TKEYS[4])
    assert both.supersedes.chunk_index == (0, 0, 0, 1)


def test_pieces_the_request_only_loaded_are_not_superseded():
    r = req(tail=True)
    q = r.lookup_query(TOKENS, 701, 0)
    hit = q.hit(2, ("cpu", "cpu"), 2, ("cpu", "cpu"))      # chunks 0, 1 and pieces 8, 9
    assert hit.hit_end == 640 and r.record(hit) == 640
    plan = r.admit(TOKENS, 701, 0, 640)
    assert plan.end == 640 and r.tail_saved == 640
    assert r.pieces_to_save(TOKENS, 701) is None           # known stored: not saved again
    own = r.pieces_to_save(GROWN, 704)                     # piece 10: this request's own
    chunk2 = r.chunks_to_save(GROWN, 790)
    assert chunk2.supersedes.keys == (own.keys[0],) and chunk2.supersedes.chunk_index == (0,)


def test_no_tail_pieces_no_supersedes():
    r = req(tail=False)
    assert r.chunks_to_save(TOKENS, 701).supersedes is None
    assert r.chunks_to_save(GROWN, 790).supersedes is None

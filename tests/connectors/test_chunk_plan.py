"""The connector core (``connectors.chunk_plan``) on CPU, without a model or a store: key
chains, hit arithmetic, load plans, landing and save ranges, with exact values.

Geometry throughout: engine blocks of 16 tokens, store chunks of C = 256 tokens, tail pieces of
F = 64 tokens when on. Prompts have odd lengths (701 = 2 chunks + 189 tokens = 10 whole pieces
+ 61 tokens). ``L`` is the engine's own prefix-cache hit, ``N`` the request's tokens, ``E`` the
tokens the store supplies past ``L``.
"""
from __future__ import annotations

import dataclasses

import pytest

from connectors.chunk_geometry import ChunkGeometry
from connectors.chunk_plan import KeyChain, RequestChunks
from connectors.chunk_records import LookupHit
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

BS, C, F = 16, 256, 64
LAYOUT = KVLayout(2, 1, 4, "float16", C)        # 2*2*256*1*4*2 = 8192 bytes a chunk
NS = Namespace("m", LAYOUT)
TNS = dataclasses.replace(NS, layout=dataclasses.replace(LAYOUT, chunk_size=F))
TOKENS = [1000 + i for i in range(701)]
KEYS = NS.chunk_keys(TOKENS)                    # chunks 0, 1
TKEYS = TNS.chunk_keys(TOKENS)                  # pieces 0..9 (tokens [0, 640))


def req(tail: bool) -> RequestChunks:
    if tail:
        return RequestChunks(ChunkGeometry(BS, C, F), NS, TNS)
    return RequestChunks(ChunkGeometry(BS, C), NS)


# ---- key chains ------------------------------------------------------------------------------
def test_key_chain_extends_incrementally_to_the_namespace_keys():
    chain = KeyChain(NS)
    assert chain.keys(TOKENS, 1) == KEYS[:1]
    assert chain.keys(TOKENS, 5) == KEYS            # only 2 whole chunks in 701 tokens
    assert len(KEYS) == 2 and len(TKEYS) == 10
    assert KeyChain(TNS).keys(TOKENS, 10) == TKEYS
    longer = TOKENS + [7] * 99                      # 800 tokens: a third chunk, chained on
    assert chain.keys(longer, 3) == NS.chunk_keys(longer)[:3]
    assert chain.keys(longer, 3)[:2] == KEYS


# ---- hit arithmetic --------------------------------------------------------------------------
def test_store_hit_without_tail_pieces():
    r = req(tail=False)
    q = r.lookup_query(TOKENS, 701, 0)
    assert q.keys == tuple(KEYS) and q.tail_keys == () and not q.tail_range(2)
    hit = q.hit(2, ("cpu", "disk"))
    assert hit == LookupHit(701, 0, 512, 512, {0: "cpu", 256: "disk"})
    assert r.record(hit) == 512                     # E: both chunks; 189 tokens prefilled
    assert r.cached_hit(701, 0) is hit and r.cached_hit(701, 16) is None
    # a prompt of exactly two chunks: the last token is computed, E = N - 1
    q = req(tail=False).lookup_query(TOKENS[:512], 512, 0)
    assert req(tail=False).record(q.hit(2, ("cpu", "cpu"))) == 511


def test_store_hit_beyond_the_engines_own_hit():
    r = req(tail=False)
    q = r.lookup_query(TOKENS, 701, 256)            # the engine has chunk 0 (16 blocks)
    assert q.first_chunk == 1 and q.keys == (KEYS[1],)
    hit = q.hit(1, ("cpu",))
    assert (hit.hit_end, hit.full_end, hit.tiers) == (512, 512, {256: "cpu"})
    assert r.record(hit) == 256                     # E = 512 - 256


def test_engines_own_hit_beyond_the_store_hit():
    r = req(tail=False)
    q = r.lookup_query(TOKENS, 701, 480)            # 30 blocks: inside chunk 1
    assert q.keys == (KEYS[1],)
    assert r.record(q.hit(1, ("cpu",))) == 32       # chunk 1 stored: only [480, 512) loads
    assert r.record(q.hit(0)) == 0                  # chunk 1 missing: store ends at 256 < L
    # nothing to ask: L not block aligned, or no full chunk past L and no tail pieces
    assert r.lookup_query(TOKENS, 701, 250) is None
    assert r.lookup_query(TOKENS, 701, 512) is None


def test_tail_pieces_past_the_last_full_chunk():
    r = req(tail=True)
    q = r.lookup_query(TOKENS, 701, 0)
    assert q.keys == tuple(KEYS) and q.tail_keys == tuple(TKEYS)
    assert q.tail_range(2) == range(8, 10)          # pieces [512, 640): the prompt's tail
    hit = q.hit(2, ("cpu", "cpu"), 2, ("disk", "disk"))
    assert hit == LookupHit(701, 0, 640, 512, {0: "cpu", 256: "cpu", 512: "disk", 576: "disk"})
    assert r.record(hit) == 640                     # 61 tokens prefilled instead of 189
    # N = 640: every piece stored, but the last token is computed
    q = req(tail=True).lookup_query(TOKENS[:640], 640, 0)
    assert q.tail_range(2) == range(8, 10)
    assert req(tail=True).record(q.hit(2, ("cpu",) * 2, 2, ("cpu",) * 2)) == 639


def test_tail_pieces_inside_the_first_missing_chunk():
    r = req(tail=True)
    q = r.lookup_query(TOKENS, 701, 0)
    # chunk 1 missing: a shorter prompt's pieces may cover [256, 512)
    assert q.tail_range(1) == range(4, 8)
    hit = q.hit(1, ("cpu",), 2, ("cpu", "cpu"))
    assert (hit.hit_end, hit.full_end) == (384, 256) and r.record(hit) == 384
    # the engine's own hit (20 blocks = 320) past the stored chunks: pieces from 320 on
    q = r.lookup_query(TOKENS, 701, 320)
    assert q.keys == (KEYS[1],) and q.tail_range(0) == range(5, 8)
    hit = q.hit(0, (), 1, ("cpu",))
    assert (hit.hit_end, hit.full_end, hit.tiers) == (384, 256, {320: "cpu"})
    assert r.record(hit) == 64
    # off: nothing past the chunks
    assert req(tail=False).lookup_query(TOKENS, 701, 0).tail_range(1) == range(0)


def test_a_failed_lookup_is_a_miss():
    r = req(tail=True)
    assert r.record(LookupHit.miss(701, 0)) == 0
    assert r.record(LookupHit.miss(701, 256)) == 0


# ---- admission, load plans, landing ----------------------------------------------------------
def test_admission_plans_chunks_then_pieces_with_their_parents():
    r = req(tail=True)
    q = r.lookup_query(TOKENS, 701, 0)
    r.record(q.hit(2, ("cpu", "disk"), 2, ("cpu", "cpu")))
    plan = r.admit(TOKENS, 701, 0, 640)
    assert (plan.start, plan.end, plan.first_chunk, plan.last_chunk) == (0, 640, 0, 3)
    assert (plan.first_block, plan.last_block) == (0, 40)
    got = [(p.start, p.size, p.ns is TNS, p.key, p.parent, p.tier, p.tail) for p in plan.pieces]
    assert got == [(0, 256, False, KEYS[0], None, "cpu", False),
                   (256, 256, False, KEYS[1], KEYS[0], "disk", False),
                   (512, 64, True, TKEYS[8], None, "cpu", True),    # starts its chain
                   (576, 64, True, TKEYS[9], TKEYS[8], "cpu", True)]
    assert (r.saved, r.tail_saved, r.lookup) == (640, 640, None)  # found: not saved again


def test_admission_of_pieces_past_the_engines_own_hit():
    r = req(tail=True)
    r.record(r.lookup_query(TOKENS, 701, 320).hit(0, (), 1, ("cpu",)))
    plan = r.admit(TOKENS, 701, 320, 64)
    assert (plan.start, plan.end, plan.first_block, plan.last_block) == (320, 384, 20, 24)
    (p,) = plan.pieces
    assert (p.start, p.key, p.parent, p.tail) == (320, TKEYS[5], TKEYS[4], True)
    assert (r.saved, r.tail_saved) == (384, 384)
    assert r.admit(TOKENS, 701, 320, 0) is None      # readmission without a load


def test_partial_landing_rewinds_to_the_last_whole_piece():
    r = req(tail=True)
    r.record(r.lookup_query(TOKENS[:640], 640, 0).hit(2, ("cpu", "disk"), 2, ("cpu", "cpu")))
    plan = r.admit(TOKENS, 640, 0, 639)             # E = N - 1
    assert plan.last_block == 40
    none, one, three, every = (plan.landed(k) for k in (0, 1, 3, 4))
    assert (none.end, none.short, none.full_chunks, none.tokens_by_tier) == (0, 639, 0, {})
    assert (one.end, one.short, one.full_chunks, one.tail_pieces) == (256, 383, 1, 0)
    assert one.tokens_by_tier == {"cpu": 256} and one.nbytes == LAYOUT.chunk_bytes
    assert (three.end, three.short, three.tail_pieces) == (576, 63, 1)
    assert three.nbytes == 2 * LAYOUT.chunk_bytes + LAYOUT.chunk_bytes // 4
    assert (every.end, every.short) == (639, 0)
    assert every.tokens_by_tier == {"cpu": 256 + 64 + 63, "disk": 256}
    r.rewind(one.end)                               # chunk 1 and the pieces are saved again
    assert (r.saved, r.tail_saved) == (256, 256)


# ---- saves -----------------------------------------------------------------------------------
def test_chunk_saves_carry_their_true_parent():
    r = req(tail=False)
    first = r.chunks_to_save(TOKENS, 300)
    assert (first.first, first.keys, first.parent, first.parents) == (0, (KEYS[0],), None, None)
    assert first.starts == range(0, 256, 256) and first.nbytes == LAYOUT.chunk_bytes
    second = r.chunks_to_save(TOKENS, 520)
    assert (second.first, second.keys, second.parent) == (1, (KEYS[1],), KEYS[0])
    assert second.parents == [KEYS[0]] and second.starts == range(256, 512, 256)
    assert r.chunks_to_save(TOKENS, 701) is None and r.saved == 512
    assert r.pieces_to_save(TOKENS, 701) is None    # tail pieces off


def test_piece_saves_start_a_chain_at_the_last_full_chunk():
    r = req(tail=True)
    tail = r.pieces_to_save(TOKENS, 701)            # the prompt's prefill completed
    assert (tail.first, tail.keys, tail.parent, tail.tail) == (8, tuple(TKEYS[8:]), None, True)
    assert tail.starts == range(512, 640, 64) and r.tail_saved == 640
    grown = TOKENS + [5] * 99                       # 800 tokens with the answer
    more = r.pieces_to_save(grown, 760)             # piece 10 continues piece 9
    assert (more.first, more.keys, more.parent) == (10, (TNS.chunk_keys(grown)[10],), TKEYS[9])
    assert more.parents == [TKEYS[9]]
    assert r.pieces_to_save(grown, 790) is None     # [768, 768): past a new full chunk


# ---- geometry --------------------------------------------------------------------------------
def test_geometry_blocks_and_refusals():
    g = ChunkGeometry(BS, C, F)
    table = list(range(100, 150))
    assert g.blocks_per_chunk == 16 and g.floor_to_piece(701) == 640
    assert g.chunk_blocks(table, 1) == list(range(116, 132))
    assert g.unit_blocks(table, 576, F) == [136, 137, 138, 139]
    with pytest.raises(ValueError, match=r"tail piece 12 needs blocks \[48, 52\) but the "
                                         r"block table has 50"):
        g.unit_blocks(table, 768, F)
    with pytest.raises(ValueError, match="divide chunk_size=256 and be smaller, got 48"):
        ChunkGeometry(BS, C, 48)
    with pytest.raises(ValueError, match="tail_chunk_size=8 must be a multiple of the "
                                         "engine's block_size=16"):
        ChunkGeometry(BS, C, 8)
    with pytest.raises(ValueError, match="chunk_size=250 must be a multiple"):
        ChunkGeometry(BS, 250)
    assert ChunkGeometry(BS, C).floor_to_piece(701) == 0

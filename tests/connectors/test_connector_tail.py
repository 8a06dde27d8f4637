"""EngineMinConnector's tail pieces (``tail_chunk_size``) on the real model (SmolLM2-135M, one
engine for the module): greedy outputs equal the engine's without a connector, and hit counts are
what the chunk + piece arithmetic says.

Engine: block size 4, its own prefix cache off unless a test turns it on. Store chunks C = 16
tokens, tail pieces F = 4 (the default: the block size; 8 where the arithmetic asks). With
pieces a hit of a stored prefix of ``L`` tokens reaches ``floor_F(L)`` instead of
``floor_C(L)``; with ``tail_chunk_size=0`` (off) nothing changes.
"""
from __future__ import annotations

import argparse
import random

import pytest
import torch

from connectors.engine_min import EngineMinConnector
from connectors.factory import create_connector
from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.sampler import SamplingParams
from kvstore.config import StoreConfig
from kvstore.store import ChunkStore

BS, C, F = 4, 16, 4
DOC, Q = 152, 6             # doc = 9 chunks + 2 pieces; doc + question = 158 tokens
DEADLINE = 60.0             # generous: exact counts must not depend on machine load


def greedy(n, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def run(engine, prompt_ids, n, **kw):
    """(output ids, num_cached_tokens) of one greedy request."""
    out = engine.generate([list(prompt_ids)], greedy(n, **kw))[0]
    return out.output_token_ids, out.num_cached_tokens


WORDS = ("river harbor council winter market bridge archive lantern orchard quarry signal "
         "meadow tower ledger compass garden furnace beacon canal granary").split()


def text_ids(tok, seed: int, n: int) -> list[int]:
    """Exactly ``n`` token ids of deterministic English-like text."""
    rng = random.Random(seed)
    words: list[str] = []
    ids: list[int] = []
    while len(ids) < n:
        words += rng.sample(WORDS, 4) + [f"{rng.randint(2, 999)}."]
        ids = tok.encode(" ".join(words))
    return ids[:n]


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(block_size=BS, kv_cache_bytes=64 * 2**20,
                                 enable_prefix_caching=False))
    yield eng
    eng.set_connector(None)


@pytest.fixture(scope="module")
def prompts(engine):
    """The document, four 6-token questions, a 70-token chat round 1 and its follow-up, with
    each request's output from the engine without a connector."""
    tok = engine.tokenizer
    doc = text_ids(tok, 1, DOC)
    qs = [text_ids(tok, 10 + i, Q) for i in range(4)]
    r1 = text_ids(tok, 2, 70)
    engine.set_connector(None)
    want_qa = [run(engine, doc + q, 5)[0] for q in qs]
    r1_out = run(engine, r1, 20, ignore_eos=True)[0]
    r2 = r1 + r1_out + text_ids(tok, 3, 10)              # 100 tokens
    return {"doc": doc, "qs": qs, "want_qa": want_qa, "r1": r1, "r1_out": r1_out, "r2": r2,
            "r2_out": run(engine, r2, 5)[0]}


def connector(tail: int | None, chunk: int = C) -> EngineMinConnector:
    """A connector over a 128 MiB CPU tier; ``tail`` None = the default tail size."""
    return create_connector(cpu_bytes="128MiB", chunk_size=chunk, deadline_s=DEADLINE,
                            tail_chunk_size=tail)


def doc_qa(engine, prompts, conn):
    """The four questions through ``conn``: (cached tokens per question, stats)."""
    engine.set_connector(conn)
    try:
        cached = []
        for q, want in zip(prompts["qs"], prompts["want_qa"]):
            out, c = run(engine, prompts["doc"] + q, 5)
            assert out == want, f"question {len(cached) + 1} differs (tail {conn.tail_chunk_size})"
            cached.append(c)
            assert conn.wait_for_save(DEADLINE)
        return cached, engine.stats()
    finally:
        engine.set_connector(None)


def test_doc_qa_tail_pieces_hit_the_whole_document_and_outputs_match(engine, prompts):
    conn = connector(F)
    cached, st = doc_qa(engine, prompts, conn)
    # q1 stores chunks [0, 144) and pieces [144, 156); q2..q4 load 144 + 2 pieces = 152 (the
    # piece [152, 156) holds question tokens: it differs per question)
    assert cached == [0, DOC, DOC, DOC]
    assert st["external_prefix_cache_hits"] == 3 * DOC
    assert st["kvstore_hit_tokens_by_tier"] == {"cpu": 3 * DOC}
    assert st["kvstore_loaded_chunks"] == 3 * 9 and st["kvstore_loaded_tail_chunks"] == 3 * 2
    # each question saves its own piece [152, 156) and, at its end (158 + 5 generated, 162
    # with KV), its own chunk [144, 160); the document's chunks and pieces are saved once
    assert st["kvstore_saved_chunks"] == 9 + 4 and st["kvstore_saved_tail_chunks"] == 3 + 3
    assert st["kvstore_fallbacks"] == 0 and st["kvstore_dropped_save_chunks"] == 0
    keys = conn.tail_ns.chunk_keys(prompts["doc"] + prompts["qs"][0])   # pieces of q1's prompt
    assert conn.store.exists(conn.tail_ns, keys[36:39]) == [True, True, True]
    assert conn.store.exists(conn.tail_ns, keys[35:36]) == [False]      # inside a full chunk
    # loads scattered from borrowed pages: every reader pin is dropped again
    full = conn.ns.chunk_keys(prompts["doc"])
    assert [conn.store._pins.count(k) for k in full + keys[36:39]] == [0] * 12
    conn.close()


def test_default_stores_tail_pieces_of_one_block(engine, prompts):
    conn = connector(None)
    cached, st = doc_qa(engine, prompts, conn)
    assert conn.tail_chunk_size == BS and conn.tail_ns.layout.chunk_size == BS
    assert cached == [0, DOC, DOC, DOC]          # the whole document, as with F = 4 given
    assert st["kvstore_loaded_tail_chunks"] == 3 * 2 and st["kvstore_saved_tail_chunks"] == 6
    conn.close()


def test_tail_chunk_size_zero_stores_no_tail_pieces(engine, prompts):
    conn = connector(0)
    cached, st = doc_qa(engine, prompts, conn)
    assert conn.tail_ns is None
    assert cached == [0, 144, 144, 144]          # floor_C(152): the 8 tokens past it recompute
    assert st["kvstore_loaded_tail_chunks"] == 0 and st["kvstore_saved_tail_chunks"] == 0
    conn.close()


def test_chat_round_two_loads_the_pieces_of_round_one_answer(engine, prompts):
    """Round 1: prompt 70 + 20 generated (89 with KV). Stored: chunks [0, 80) (64 after the
    prefill, 80 at the end), pieces [64, 68) after the prefill and [80, 88) at the end.
    Round 2 (100 tokens) misses chunk [80, 96), then finds the pieces [80, 88) inside it."""
    conn = connector(F)
    engine.set_connector(conn)
    try:
        out, cached = run(engine, prompts["r1"], 20, ignore_eos=True)
        assert (out, cached) == (prompts["r1_out"], 0)
        assert conn.wait_for_save(DEADLINE)
        st = engine.stats()
        assert (st["kvstore_saved_chunks"], st["kvstore_saved_tail_chunks"]) == (5, 3)
        out, cached = run(engine, prompts["r2"], 5)
        assert (out, cached) == (prompts["r2_out"], 88)
        st = engine.stats()
        assert (st["kvstore_loaded_chunks"], st["kvstore_loaded_tail_chunks"]) == (5, 2)
    finally:
        engine.set_connector(None)
        conn.close()


def test_a_piece_matches_only_its_identical_prefix(engine, prompts):
    """Same tail tokens after a different first chunk: no piece matches (chained keys)."""
    doc, q = prompts["doc"], prompts["qs"][0]
    other = list(reversed(doc[:C])) + doc[C:]          # differs in chunk 0 only
    assert other[:C] != doc[:C]
    want, _ = run(engine, other + q, 3)
    conn = connector(F)
    engine.set_connector(conn)
    try:
        run(engine, doc + q, 1)
        assert conn.wait_for_save(DEADLINE)
        keys_a = conn.tail_ns.chunk_keys(doc + q)
        keys_b = conn.tail_ns.chunk_keys(other + q)
        assert not set(keys_a) & set(keys_b)
        out, cached = run(engine, other + q, 3)
        assert (out, cached) == (want, 0)
    finally:
        engine.set_connector(None)
        conn.close()


def test_engine_cache_past_the_full_chunks_loads_only_the_rest_of_a_piece(engine, prompts):
    """40 tokens stored as chunks [0, 32) + piece [32, 40) (F = 8); the engine's own cache
    holds 36: the load writes tokens [36, 39) (the last one is always computed) and nothing
    below 36."""
    prompt = prompts["r2"][:40]
    want, _ = run(engine, prompt, 2)
    conn = connector(8)
    engine.set_connector(conn)
    try:
        run(engine, prompt, 1)
        assert conn.wait_for_save(DEADLINE)
        assert engine.stats()["kvstore_saved_tail_chunks"] == 1
        engine.set_connector(None)
        engine.block_manager.enable_prefix_caching = True
        run(engine, prompt[:37], 1)                    # the engine caches 9 blocks = 36 tokens
        engine.set_connector(conn)
        out, cached = run(engine, prompt, 2)
        assert (out, cached) == (want, 39)
        st = engine.stats()
        assert (st["kvstore_loaded_tokens"], st["kvstore_loaded_tail_chunks"]) == (3, 1)
    finally:
        engine.block_manager.enable_prefix_caching = False
        engine.set_connector(None)
        conn.close()


def test_default_tail_size_is_the_block_size_when_it_divides_the_chunk():
    from connectors.engine_min import default_tail_size
    assert [default_tail_size(b, 256) for b in (16, 64, 128, 256, 48, 512)] == \
        [16, 64, 128, 0, 0, 0]


PIECE_BYTES = 30 * 2 * F * 3 * 64 * 4            # SmolLM2-135M, float32: 184,320 bytes
CHUNK_BYTES = PIECE_BYTES * C // F                # 737,280 bytes


def test_pieces_of_one_request_are_bounded_and_take_tier_bytes_like_chunks(engine, prompts):
    """Round 1 of the chat (70 prompt + 20 generated, 89 with KV) writes 5 chunks [0, 80) and
    3 pieces: [64, 68) after the prefill and [80, 88) at the end (each piece's tokens past
    the last full chunk of what it covers; never a piece inside a chunk it saved before).
    The CPU tier's bytes are exactly those 8 units. Then a tier 80 pieces (20 chunks) big
    takes a 2nd and 3rd round of new prompts: the pieces fill it like chunks and are evicted
    like them."""
    conn = connector(None)
    engine.set_connector(conn)
    try:
        run(engine, prompts["r1"], 20, ignore_eos=True)
        assert conn.wait_for_save(DEADLINE)
        cpu = conn.store.stats()["tiers"]["cpu"]
        assert cpu["num_chunks"] == 5 + 3
        assert cpu["used_bytes"] == 5 * CHUNK_BYTES + 3 * PIECE_BYTES
        tail_keys = conn.tail_ns.chunk_keys(prompts["r1"] + prompts["r1_out"])
        assert conn.store.exists(conn.tail_ns, tail_keys[15:22]) == \
            [False, True, False, False, False, True, True]          # pieces 16, 20, 21
    finally:
        engine.set_connector(None)
        conn.close()

    store = ChunkStore(StoreConfig(cpu_bytes="4MiB"))
    for bad in (-4, 5, 16, 32, 1.5, True):
        with pytest.raises(ValueError, match="tail_chunk_size"):
            EngineMinConnector(store, chunk_size=16, tail_chunk_size=bad, owns_store=False)
    conn = EngineMinConnector(store, chunk_size=16, tail_chunk_size=2, owns_store=False)
    with pytest.raises(ValueError, match="multiple of the engine's block_size=4"):
        conn.register_kv_caches(torch.zeros(2, 2, 8, 4, 1, 8), 4)
    conn.close()
    store.close()


def test_server_flag_and_factory_pass_the_tail_chunk_size(tmp_path):
    from engine_min.serve.cli import add_serve_args, build_connector
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    c = build_connector(parse(["--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32"]))
    assert c.tail_chunk_size is None          # the default: the engine's block size, at binding
    c.register_kv_caches(torch.zeros(2, 2, 8, 8, 1, 8), 8)
    assert c.tail_chunk_size == 8
    c.close()
    c = build_connector(parse(["--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32",
                               "--kvstore-tail-chunk-size", "0"]))
    c.register_kv_caches(torch.zeros(2, 2, 8, 8, 1, 8), 8)
    assert (c.tail_chunk_size, c.tail_ns) == (0, None)
    c.close()
    c = build_connector(parse(["--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32",
                               "--kvstore-tail-chunk-size", "8", "--block-size", "8"]))
    assert isinstance(c, EngineMinConnector) and (c.chunk_size, c.tail_chunk_size) == (32, 8)
    c.close()
    with pytest.raises(SystemExit, match="tail_chunk_size=8 must be a multiple"):  # block 16
        build_connector(parse(["--kvstore-cpu-bytes", "8MiB", "--kvstore-chunk-size", "32",
                               "--kvstore-tail-chunk-size", "8"]))
    with pytest.raises(ValueError, match="tail_chunk_size"):
        create_connector(cpu_bytes="8MiB", chunk_size=32, tail_chunk_size=12)


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_in_use():
    """The bench's in-context bound primes the engine's own cache after this reset."""
    from engine_min.block_manager import BlockManager
    from engine_min.sequence import Sequence
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("a", list(range(10)), greedy(1))
    bm.allocate(seq, 10)
    seq.num_computed_tokens = 10
    bm.cache_blocks(seq)                                 # 2 full blocks hashed
    assert bm.reset_prefix_cache() is False              # seq still holds them
    assert len(bm.lookup(Sequence("b", list(range(10)), greedy(1)))) == 2
    bm.free_seq(seq)
    assert len(bm.lookup(Sequence("b", list(range(10)), greedy(1)))) == 2   # freed, cached
    assert bm.reset_prefix_cache() is True
    assert bm.lookup(Sequence("c", list(range(10)), greedy(1))) == []
    assert bm.num_free_blocks == 7 and not bm.hash_to_block
    bm.check_integrity()

"""The vLLM connector's translations that need no vLLM: a core load plan into the worker's
transfers (full chunks, then tail pieces), and the requests' namespaces (tenant salt, request
salt, tail namespace)."""
from __future__ import annotations

from types import SimpleNamespace

from connectors.chunk_geometry import ChunkGeometry
from connectors.chunk_plan import RequestChunks
from connectors.vllm.identity import RequestNamespaces
from connectors.vllm.records import load_transfers
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

LAY = KVLayout(1, 1, 4, "float32", 8)
NS = Namespace("m", LAY)
TAIL_NS = Namespace("m", KVLayout(1, 1, 4, "float32", 2))


def test_a_load_plan_becomes_one_chunk_transfer_and_one_piece_transfer():
    toks = list(range(100, 122))                      # chunks 0-1 (16), pieces 8-10 (22)
    keys, pieces = NS.chunk_keys(toks), TAIL_NS.chunk_keys(toks)
    req = RequestChunks(ChunkGeometry(2, 8, 2), NS, TAIL_NS)
    q = req.lookup_query(toks, 22, 4)                 # vLLM has tokens [0, 4)
    assert q.keys == tuple(keys) and q.tail_range(2) == range(8, 11)
    ext = req.record(q.hit(2, num_hit_pieces=2))      # chunks 0-1 and pieces 8-9 stored
    assert ext == 20 - 4
    plan = req.admit(toks, 22, 4, ext)
    got = load_transfers("r", plan, [7, 6, 5, 4, 3, 2, 1, 0, 9, 10])
    assert [(t.ns, t.first_chunk, t.keys, t.start, t.end, t.parent) for t in got] == [
        (NS, 0, keys, 4, 16, None), (TAIL_NS, 8, pieces[8:10], 16, 20, None)]
    assert got[0].block_ids == [7, 6, 5, 4, 3, 2, 1, 0, 9, 10]
    # the chunks and pieces it loaded are known stored: nothing of them is saved again
    assert req.chunks_to_save(toks, 16) is None and req.pieces_to_save(toks, 20) is None


def test_request_namespaces_bind_the_tenant_salt_and_keep_the_tail_apart():
    ns = RequestNamespaces(NS, "acme", tail_chunk_size=2)
    assert ns.base.cache_salt == "acme"
    plain = ns.of(SimpleNamespace(cache_salt=None, lora_request=None))
    salted = ns.of(SimpleNamespace(cache_salt="u1", lora_request=None))
    assert plain == ns.base and salted.cache_salt == "acme/u1"
    assert ns.of(SimpleNamespace(cache_salt="u1", lora_request=None)) is salted   # cached
    tail = ns.tail(salted)
    assert tail.layout.chunk_size == 2 and tail.cache_salt == "acme/u1"
    assert tail.ns_id != salted.ns_id
    assert RequestNamespaces(NS, None, 0).tail(NS) is None
    assert RequestNamespaces(NS, None, 0).base == NS

"""The vLLM connector's demotion of superseded tail pieces, without vLLM: a chunk save's
transfer carries the pieces its chunks cover (``ChunkTransfer.supersedes``) and the worker's
writer demotes them in the store after the put, counting what it demoted or a failure.

Geometry: blocks of 2 tokens, chunks C = 8, pieces F = 2; a 12-token prompt (chunk 0 + pieces
4, 5) whose answer fills chunk 1 at 16 tokens."""
from __future__ import annotations

import torch

from connectors.chunk_geometry import ChunkGeometry
from connectors.chunk_plan import RequestChunks
from connectors.vllm.records import save_transfer
from connectors.vllm.shared import Counters, StoreCalls
from connectors.vllm.worker import WorkerSide
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAY = KVLayout(1, 1, 4, "float32", 8)
NS = Namespace("m", LAY)
TAIL_NS = Namespace("m", KVLayout(1, 1, 4, "float32", 2))
TOKS = list(range(100, 116))                       # 16 tokens: chunks 0, 1; pieces 0..7
KEYS, PIECES = NS.chunk_keys(TOKS), TAIL_NS.chunk_keys(TOKS)


def kv(layout, seed):
    return torch.full(layout.shape(), float(seed))  # [1, 2, chunk, 1, 4]


def saves_of_one_request():
    """The transfers of the prompt's saves, then of the chunk the answer fills."""
    req = RequestChunks(ChunkGeometry(2, 8, 2), NS, TAIL_NS)
    first = [save_transfer("r", r, list(range(8))) for r in
             (req.chunks_to_save(TOKS, 12), req.pieces_to_save(TOKS, 12))]
    last = save_transfer("r", req.chunks_to_save(TOKS, 16), list(range(8)))
    return first, last


def worker(store) -> WorkerSide:
    return WorkerSide(LAY, ["model.layers.0.attn"], 2, 8, StoreCalls(store, False, 5.0),
                      Counters(), 1 << 20, dict)


def test_the_chunk_transfer_names_the_pieces_and_the_writer_demotes_them():
    (chunk0, pieces), last = saves_of_one_request()
    assert chunk0.supersedes is None and pieces.keys == PIECES[4:6]
    assert last.keys == KEYS[1:] and last.parent == KEYS[0]
    assert last.supersedes.ns == TAIL_NS and last.supersedes.keys == tuple(PIECES[4:6])
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=128))
    w = worker(store)
    assert store.put_chunks(NS, KEYS[:1], [kv(LAY, 0)]) == 1
    assert store.put_chunks(TAIL_NS, PIECES[4:6], [kv(TAIL_NS.layout, i) for i in (4, 5)],
                            [None, PIECES[4]]) == 2
    assert w.saves.try_reserve(LAY.chunk_bytes)     # as WorkerSide.save queues a transfer
    w.saves.submit(NS, last.keys, [kv(LAY, 1)], LAY.chunk_bytes, [KEYS[0]],
                   lambda stored: w._demote(last, stored))
    assert w.flush(5)
    assert store.exists(NS, KEYS) == [True, True]
    assert [store.tiers[0].is_demoted(k) for k in PIECES[4:6]] == [True, True]
    assert w.counters.values["demoted_tail_chunks"] == 2
    assert w.counters.values["demote_errors"] == 0
    w.close()
    store.close()


class FailingDemote(ChunkStore):
    def demote(self, ns, keys):
        raise TimeoutError("daemon late")


def test_a_failed_demote_is_counted_not_raised():
    _, last = saves_of_one_request()
    store = FailingDemote(StoreConfig(cpu_bytes=1 << 20, page_bytes=128))
    w = worker(store)
    w._demote(last, 1)
    assert w.counters.values["demote_errors"] == 1
    assert w.counters.values["demoted_tail_chunks"] == 0
    w.close()
    store.close()

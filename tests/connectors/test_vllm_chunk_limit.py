"""The vLLM connector's worker side (built without vLLM) against a real ``kvstore serve
--max-body-bytes 4096``: at registration a chunk larger than the limit is found and logged
once with both sizes and the settings to change; the saves of chunks of that layout are then
skipped before any gather (counted in ``save_errors``) when the daemon is the only store,
while tail pieces that fit go on; a ``ChunkTooLarge`` met at a put does the same. Layout:
float32, 2 layers, 1 head of 2, 256-token chunks (8192 bytes) and 4-token pieces (128)."""
from __future__ import annotations

import logging

import pytest
import torch

from connectors.vllm.records import ChunkTransfer
from connectors.vllm.shared import Counters, StoreCalls
from connectors.vllm.worker import WorkerSide
from kvstore.daemon.batches import ChunkTooLarge
from kvstore.daemon.client import KVStoreClient
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from tests.kvstore.daemon.serve_proc import free_port, start, stop

BODY = 4096
LAY = KVLayout(2, 1, 2, "float32", 256)
NS = Namespace("m", LAY)
TAIL_NS = Namespace("m", KVLayout(2, 1, 2, "float32", 4))


@pytest.fixture(scope="module")
def url():
    port = free_port()
    proc = start(port, None, ["--max-body-bytes", str(BODY)])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def _worker(store) -> WorkerSide:
    return WorkerSide(LAY, ["model.layers.0.attn", "model.layers.1.attn"], 4, 8,
                      StoreCalls(store, True, 5.0), Counters(), 1 << 20, dict)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "max-body-bytes" in r.getMessage()]


def _transfer(ns: Namespace, n_tokens: int) -> ChunkTransfer:
    keys = ns.chunk_keys(list(range(n_tokens)))
    return ChunkTransfer("r", ns, 0, keys, 0, n_tokens, list(range(8)))


def test_an_oversized_chunk_is_found_at_registration_and_its_saves_skipped(url, caplog):
    caplog.set_level(logging.INFO)
    with KVStoreClient(url, same_host=False, timeout_s=10) as store:
        w = _worker(store)
        try:
            w.check_chunk_limit(NS, TAIL_NS)
            (msg,) = _warnings(caplog)
            assert str(BODY) in msg and "8192" in msg and LAY.chunk_bytes == 8192
            assert "--kvstore-chunk-size" in msg and "saves are skipped" in msg
            w.check_chunk_limit(NS)  # once per layout
            assert len(_warnings(caplog)) == 1
            # skipped before any gather (no paged layout derived: none to gather from)
            w.save([_transfer(NS, 256), _transfer(NS, 512)])
            assert w.counters.values["save_errors"] == 2
            assert w.paged is None and w._layout_error is None  # never reached
            assert not store.exists(NS, NS.chunk_keys(list(range(256))))[0]
        finally:
            w.close()


def test_a_chunk_that_fits_is_not_warned_nor_skipped(url, caplog):
    caplog.set_level(logging.INFO)
    with KVStoreClient(url, same_host=False, timeout_s=10) as store:
        w = _worker(store)
        try:
            w.check_chunk_limit(TAIL_NS, None)
            assert _warnings(caplog) == []
            w.save([_transfer(TAIL_NS, 4)])  # goes on to the layout (none here: logged)
            assert w.counters.values["save_errors"] == 0 and w._layout_error is not None
        finally:
            w.close()


def test_chunk_too_large_at_a_put_skips_later_saves(url, caplog):
    caplog.set_level(logging.INFO)
    with KVStoreClient(url, same_host=False, timeout_s=10) as store:
        w = _worker(store)
        try:
            w._saved(NS, None, 0.0, ChunkTooLarge(0, LAY.chunk_bytes + 200, BODY))
            assert len(_warnings(caplog)) == 1 and w.counters.values["save_errors"] == 1
            w.save([_transfer(NS, 256)])
            assert w.counters.values["save_errors"] == 2
        finally:
            w.close()


def test_chunks_the_daemon_refused_are_counted_not_saved(url):
    """A save whose parent the daemon has not (``parent_missing``): the put's ``PutResult``
    says so and the writer counts it in ``refused_chunks``, not in ``saved_chunks``."""
    keys = TAIL_NS.chunk_keys(list(range(12)))
    kvs = [torch.zeros(TAIL_NS.layout.shape()) for _ in range(2)]
    with KVStoreClient(url, same_host=False, timeout_s=10) as store:
        w = _worker(store)
        try:
            assert w._put(TAIL_NS, keys[:1], kvs[:1]) == 1
            assert w._put(TAIL_NS, keys[2:3], kvs[1:], [keys[1]]) == 0  # orphan
            assert w.counters.values["saved_tail_chunks"] == 1
            assert w.counters.values["refused_chunks"] == 1
        finally:
            w.close()
            store.clear(TAIL_NS)

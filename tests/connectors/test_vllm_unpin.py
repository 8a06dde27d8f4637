"""vLLM's scheduler side drops the pins its lookups took when the request ends.

A lookup pins the chunks it found (``pin_lease_s``, default 30 s) so no eviction takes them
before the worker loads them. Kept until the lease ran out, they filled a small in-process store:
with ``cpu_bytes`` 128 MiB (11 chunks of SmolLM2 in fp32) a few hits in a row made the next
save be refused (``no_room``), which made ``test_vllm_connector``'s delayed-save test fail when
its module ran in under 30 s. Runs without vLLM (the stand-in of
``test_vllm_scheduler_reader``).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from connectors.chunk_geometry import ChunkGeometry
from connectors.stores import StoreSpec, open_store
from connectors.vllm.identity import RequestNamespaces
from connectors.vllm.shared import Counters, StoreCalls
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from tests.connectors.test_vllm_scheduler_reader import (  # noqa: F401 - fixture by name
    _request, scheduler_module)

BLOCK, CHUNK = 4, 8
LAYOUT = KVLayout(1, 2, 64, "float32", CHUNK)   # 8 KiB chunks: whole pages


def _stored(scheduler_module, cpu_bytes: int, name: str, n_chunks: int):
    """An in-process store of ``cpu_bytes`` holding a document of ``n_chunks`` chunks, and a
    scheduler side over it pinning for 30 s: ``(store, ns, doc, keys, side)``."""
    opened = open_store(StoreSpec(cpu_bytes=str(cpu_bytes), name=name))
    store, base = opened.store, Namespace("m", LAYOUT)
    ns = RequestNamespaces(base, opened.tenant_salt, 0).base
    doc = list(range(100, 100 + n_chunks * CHUNK))
    store.put_chunks(ns, ns.chunk_keys(doc), [torch.ones(LAYOUT.shape())] * n_chunks)
    side = scheduler_module.SchedulerSide(
        ChunkGeometry(BLOCK, CHUNK, 0), RequestNamespaces(base, opened.tenant_salt, 0),
        StoreCalls(store, opened.remote, 5.0), Counters(), 30.0,
        lambda rid, fallback: fallback)
    return store, ns, doc, ns.chunk_keys(doc), side


def test_a_finished_request_drops_its_lookups_pins_and_the_store_can_evict_again(
        scheduler_module):
    store, ns, doc, keys, side = _stored(scheduler_module, 3 * LAYOUT.chunk_bytes, "unpin", 3)
    req = _request("r", doc + [7])                                 # the store is full
    assert side.lookup(req, 0) == 24                               # 3 chunks found, pinned
    assert [store.pin_count(k) for k in keys] == [1, 1, 1]
    other = list(range(500, 508))                                 # a new prompt's chunk
    assert store.put_chunks(ns, ns.chunk_keys(other), [torch.ones(LAYOUT.shape())]) == 0
    side.allocated(req, 24)
    req.num_computed_tokens, req.all_token_ids = 25, doc + [7, 8]
    side.finished(req, [0, 1, 2, 3, 4, 5, 6])
    assert [store.pin_count(k) for k in keys] == [0, 0, 0]        # dropped, not left to lease
    assert store.put_chunks(ns, ns.chunk_keys(other), [torch.ones(LAYOUT.shape())]) == 1
    store.close()


def test_a_request_looked_up_twice_before_admission_drops_both_pins(scheduler_module):
    store, ns, doc, keys, side = _stored(scheduler_module, 1 << 20, "unpin2", 2)
    req = _request("r", doc + [7])
    side.lookup(req, 0)
    side.lookup(req, 0)                     # vLLM asks again while the request waits
    assert [store.pin_count(k) for k in keys] == [2, 2]
    req.all_token_ids = doc + [7]
    side.finished(req, [])                  # aborted before it ran: nothing to save
    assert [store.pin_count(k) for k in keys] == [0, 0]
    store.close()

"""vLLM's scheduler side with a read-only daemon token (role ``reader``, the daemon as the only
store) and the connector's default pin lease: its lookups find the stored chunks and pin
nothing, since the daemon refuses a reader's pin (403) and a refused pin would turn every hit
into a prefill.

Runs without vLLM (the scheduler module over a stand-in of vLLM's base module where vLLM is not
installed, as ``test_vllm_scheduler_reader.py`` does); the end-to-end test in vLLM is
``test_vllm_reader.py``.
"""
from __future__ import annotations

import logging

import torch

from connectors.chunk_geometry import ChunkGeometry
from connectors.stores import StoreSpec, engine_saves, open_store
from connectors.vllm.identity import RequestNamespaces
from connectors.vllm.options import ConnectorOptions
from connectors.vllm.shared import Counters, StoreCalls
from kvstore.config import StoreConfig
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.tenants import TenantTable
from kvstore.keys import Namespace
from kvstore.store import ChunkStore
from tests.connectors.test_vllm_scheduler_reader import (  # noqa: F401 - fixture used by name
    BLOCK, CHUNK, LAYOUT, TOKENS, _request, scheduler_module)


def _lookup(mod, opened, base: Namespace, tokens: list[int]) -> tuple[int, dict]:
    """One lookup of ``tokens`` by a scheduler side built as ``KVStoreConnector`` builds it
    (the default pin lease, ``saves`` from ``engine_saves``): ``(external tokens, counters)``."""
    pin_lease_s = ConnectorOptions.from_extra({"kvstore_url": "http://x"}, BLOCK).pin_lease_s
    assert pin_lease_s > 0
    counters = Counters()
    side = mod.SchedulerSide(ChunkGeometry(BLOCK, CHUNK, 0),
                             RequestNamespaces(base, opened.tenant_salt, 0),
                             StoreCalls(opened.store, opened.remote, 5.0), counters,
                             pin_lease_s, lambda rid, fallback: fallback,
                             saves=engine_saves(opened, quiet=True))
    return side.lookup(_request("r", tokens), 0), counters.snapshot()


def test_a_reader_token_with_the_daemon_alone_finds_chunks_and_pins_none(scheduler_module,
                                                                        caplog):
    table = TenantTable.from_mapping({
        "writer": {"token": TOKENS["writer"], "salt": "team"},
        "viewer": {"token": TOKENS["viewer"], "salt": "team", "role": "reader"}})
    daemon = ChunkStore(StoreConfig(cpu_bytes="4MiB"))
    base = Namespace("m", LAYOUT)
    stored = list(range(100, 116))                     # 2 chunks the writer saved
    with ThreadedServer(create_app(daemon, ServerLimits(tenants=table))) as srv:
        writer = open_store(StoreSpec(url=srv.url, auth_token=TOKENS["writer"], timeout_s=5))
        ns = RequestNamespaces(base, writer.tenant_salt, 0).base
        writer.store.put_chunks(ns, ns.chunk_keys(stored),
                                [torch.ones(LAYOUT.shape()), torch.ones(LAYOUT.shape())])
        w_ext, w_counts = _lookup(scheduler_module, writer, base, stored + [7, 8, 9])
        w_pinned = daemon.stats()["num_pinned_chunks"]
        writer.store.close()
        viewer = open_store(StoreSpec(url=srv.url, auth_token=TOKENS["viewer"], timeout_s=5))
        with caplog.at_level(logging.INFO, logger="kvstore.connectors"):
            ext, counts = _lookup(scheduler_module, viewer, base, stored + [7, 8, 9])
        viewer.store.close()
    daemon.close()
    # the writer pins what it found; the reader finds the same and pins nothing
    assert (w_ext, w_counts["lookup_errors"], w_pinned) == (16, 0, 2)
    assert (ext, counts["lookup_errors"], counts["hit_tokens"]) == (16, 0, 16)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []

"""vLLM's scheduler side plans no save when the store may only be read: a daemon token whose
role is ``reader`` with the daemon as the only store (``connectors.stores.engine_saves``, which
``KVStoreConnector`` passes to ``SchedulerSide(saves=...)``). Lookups still ask the daemon and
loads are still planned.

Runs without vLLM: where it is not installed, the one vLLM class the scheduler side imports
(``KVConnectorMetadata``) is stood in for while this module imports it, and the stand-in is
taken out again afterwards. A real daemon app with a tenants table serves the lookups; vLLM's
requests and scheduler outputs are the few attributes the scheduler side reads.
"""
from __future__ import annotations

import importlib
import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from connectors.chunk_geometry import ChunkGeometry
from connectors.stores import StoreSpec, engine_saves, open_store
from connectors.vllm.identity import RequestNamespaces
from connectors.vllm.shared import Counters, StoreCalls
from kvstore.config import StoreConfig
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.tenants import TenantTable
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

BLOCK, CHUNK = 4, 8
LAYOUT = KVLayout(1, 1, 4, "float32", CHUNK)
TOKENS = {"writer": "writer-token-0123456789", "viewer": "viewer-token-0123456789"}
VLLM_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@pytest.fixture
def scheduler_module(monkeypatch):
    """``connectors.vllm.scheduler``, imported over a stand-in of vLLM's base module when vLLM
    is not installed (both leave ``sys.modules`` when the test ends)."""
    try:
        importlib.import_module(VLLM_BASE)
    except ImportError:
        parts = VLLM_BASE.split(".")
        for i in range(1, len(parts) + 1):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]),
                                types.ModuleType(".".join(parts[:i])))
        sys.modules[VLLM_BASE].KVConnectorMetadata = type("KVConnectorMetadata", (), {})
        monkeypatch.setitem(sys.modules, "connectors.vllm.scheduler", None)
        del sys.modules["connectors.vllm.scheduler"]   # imported anew; removed at the end
    return importlib.import_module("connectors.vllm.scheduler")


def _request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, all_token_ids=list(tokens),
                           num_computed_tokens=0, cache_salt=None, lora_request=None)


def _step(rid: str, computed: int, scheduled: int, blocks: list[int]) -> SimpleNamespace:
    """A ``SchedulerOutput`` scheduling one new request."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=computed,
                                            block_ids=(blocks,))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              num_computed_tokens=[]),
        num_scheduled_tokens={rid: scheduled})


def _plan(mod, opened, base: Namespace, saves: bool, tokens: list[int]):
    """Look up, admit and schedule ``tokens`` (one step computing all but the last chunk),
    then finish the request once all are computed: ``(external tokens, the step's metadata,
    whether finishing holds the blocks back for a last save)``."""
    side = mod.SchedulerSide(ChunkGeometry(BLOCK, CHUNK, 0),
                             RequestNamespaces(base, opened.tenant_salt, 0),
                             StoreCalls(opened.store, opened.remote, 5.0), Counters(), 0.0,
                             lambda rid, fallback: fallback, saves=saves)
    req = _request("r", tokens)
    ext = side.lookup(req, 0)
    side.allocated(req, ext)
    blocks = list(range(len(tokens) // BLOCK + 1))
    meta = side.build_meta(_step("r", 0, len(tokens) - CHUNK, blocks))
    req.num_computed_tokens = len(tokens)
    req.all_token_ids = tokens + [5]
    return ext, meta, side.finished(req, blocks)


def test_a_reader_token_with_the_daemon_alone_plans_loads_and_no_save(scheduler_module,
                                                                       caplog):
    table = TenantTable.from_mapping({
        "writer": {"token": TOKENS["writer"], "salt": "team"},
        "viewer": {"token": TOKENS["viewer"], "salt": "team", "role": "reader"}})
    daemon = ChunkStore(StoreConfig(cpu_bytes="4MiB"))
    base = Namespace("m", LAYOUT)
    stored = list(range(100, 116))                     # 2 chunks the writer saved
    with ThreadedServer(create_app(daemon, ServerLimits(tenants=table))) as srv:
        writer = open_store(StoreSpec(url=srv.url, auth_token=TOKENS["writer"], timeout_s=5))
        ns = RequestNamespaces(base, writer.tenant_salt, 0).base   # the tenant's salt
        writer.store.put_chunks(ns, ns.chunk_keys(stored),
                                [torch.ones(LAYOUT.shape()), torch.ones(LAYOUT.shape())])
        assert engine_saves(writer) is True
        w_ext, w_meta, w_held = _plan(scheduler_module, writer, base, True,
                                      stored + list(range(200, 217)))   # chunks 0-3 + 1
        writer.store.close()
        with caplog.at_level(logging.INFO, logger="kvstore.connectors.stores"):
            viewer = open_store(StoreSpec(url=srv.url, auth_token=TOKENS["viewer"],
                                          timeout_s=5))
            saves = engine_saves(viewer)
        assert viewer.role == "reader" and saves is False
        ext, meta, held = _plan(scheduler_module, viewer, base, saves,
                                stored + list(range(300, 317)))
        viewer.store.close()
    daemon.close()
    # the writer's plan saves chunk 2 at the step and chunk 3 at the end (blocks held back
    # for it); the reader's plan saves nothing and holds nothing back
    assert w_ext == 16 and [(t.first_chunk, len(t.keys)) for t in w_meta.saves] == [(2, 1)]
    assert w_held is True
    assert ext == 16 and [(t.first_chunk, len(t.keys)) for t in meta.loads] == [(0, 2)]
    assert meta.saves == [] and held is False
    assert [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()] == [
        f"kvstore daemon {srv.url}: this token is read-only (role reader): the engine loads "
        "from it and saves nothing"]

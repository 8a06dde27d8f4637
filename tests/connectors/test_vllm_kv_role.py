"""vLLM's ``KVTransferConfig.kv_role`` in the vLLM connector: ``kv_both`` loads and saves,
``kv_producer`` saves and never loads (no lookup reaches the store), ``kv_consumer`` loads and
never saves; and the in-process store refused under vLLM's ``mp`` executor.

The scheduler-side decision runs without vLLM (vLLM's requests and scheduler outputs as the
few attributes the scheduler side reads, an in-process store); the real-model tests run in the
vLLM environment (skipped elsewhere): a producer and a consumer engine on one daemon, and an
engine whose CPU platform picks the ``mp`` executor (``VLLM_ENABLE_V1_MULTIPROCESSING`` unset)
without ``kvstore_url``.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from connectors.chunk_geometry import ChunkGeometry
from connectors.stores import StoreSpec, open_store
from connectors.vllm.identity import RequestNamespaces
from connectors.vllm.shared import Counters, StoreCalls
from kvstore.keys import Namespace
from tests.connectors.test_vllm_scheduler_reader import (  # noqa: F401 - fixture by name
    BLOCK, CHUNK, LAYOUT, _request, _step, scheduler_module)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ROLES = {"kv_both": (True, True), "kv_producer": (True, False), "kv_consumer": (False, True)}


class Recording:
    """A store that records the names of the calls made to it."""

    def __init__(self, store):
        self._store, self.calls = store, []

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if callable(attr):
            self.calls.append(name)
        return attr


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_scheduler_side_loads_and_saves_as_the_role_says(scheduler_module, role):
    saves, loads = ROLES[role]
    opened = open_store(StoreSpec(cpu_bytes="4MiB"))
    ns = Namespace("m", LAYOUT)
    stored = list(range(100, 116))                        # chunks 0-1 are in the store
    opened.store.put_chunks(ns, ns.chunk_keys(stored), [torch.ones(LAYOUT.shape())] * 2)
    store = Recording(opened.store)
    side = scheduler_module.SchedulerSide(
        ChunkGeometry(BLOCK, CHUNK, 0), RequestNamespaces(ns, None, 0),
        StoreCalls(store, False, 5.0), Counters(), 30.0, lambda rid, fallback: fallback,
        saves=saves, loads=loads, pins=True)
    tokens = stored + list(range(200, 217))               # 4 full chunks + 1 token
    req = _request("r", tokens)
    ext = side.lookup(req, 0)
    side.allocated(req, ext)
    blocks = list(range(len(tokens) // BLOCK + 1))
    meta = side.build_meta(_step("r", 0, len(tokens) - CHUNK, blocks))   # computes chunks 0-2
    req.num_computed_tokens, req.all_token_ids = len(tokens), tokens + [5]
    held = side.finished(req, blocks)                     # chunk 3 left for the next step
    saved = [(t.first_chunk, len(t.keys)) for t in meta.saves + side.finish_saves]
    loaded = [(t.first_chunk, len(t.keys)) for t in meta.loads]
    opened.store.close()
    asked = {"exists", "lookup_keys", "pin"} & set(store.calls)
    if role == "kv_both":
        assert (ext, loaded, saved, held) == (16, [(0, 2)], [(2, 1), (3, 1)], True)
        assert asked >= {"pin"} and len(asked) == 2
    elif role == "kv_producer":          # no lookup: chunks 0-1 are computed and saved again
        assert (ext, loaded, saved, held) == (0, [], [(0, 3), (3, 1)], True)
        assert asked == set()
    else:                                # loads and pins the hit, saves nothing
        assert (ext, loaded, saved, held) == (16, [(0, 2)], [], False)
        assert asked >= {"pin"} and len(asked) == 2


needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here "
                                                     "(tools/make_vllm_env.sh)")


@needs_vllm
@pytest.mark.slow
def test_a_producer_engine_never_loads_and_a_consumer_engine_never_saves(tmp_path):
    from bench.vllm_engine import Daemon, run_child
    from bench.vllm_model import convert
    from tests.connectors.vllm_fixtures import sharing_prompts
    model_dir = str(convert())
    p, other = sharing_prompts(model_dir)                 # 4 chunks + a 128-token piece each
    with Daemon("512MiB") as d:
        common = {"model_dir": model_dir, "connector": "ours-daemon", "url": d.url,
                  "max_tokens": 8, "warmup": False, "prefix_caching": False}
        prod = run_child({**common, "kv_role": "kv_producer", "prompts": [p, p]})
        cons = run_child({**common, "kv_role": "kv_consumer", "prompts": [p, other]})
    (p1, p2), (c1, c2) = prod["results"], cons["results"]
    pw, ps = prod["connector"]["worker"], prod["connector"]["scheduler"]
    cw, cs = cons["connector"]["worker"], cons["connector"]["scheduler"]
    # the producer saved P once per request and never looked up nor loaded it
    assert (p1["num_cached_tokens"], p2["num_cached_tokens"]) == (0, 0)
    assert pw["saved_chunks"] == 8 and pw["saved_tail_chunks"] == 2
    assert pw["loaded_tokens"] == 0 and ps["lookups"] == 0
    # the consumer loaded P (the same answer) and saved neither P's rest nor the other prompt
    assert c1["num_cached_tokens"] == 4 * 256 + 128 and cw["loaded_tokens"] == 4 * 256 + 128
    assert c1["output_ids"] == p1["output_ids"] == p2["output_ids"]
    assert c2["num_cached_tokens"] == 0 and cs["lookups"] == 2
    assert cw["saved_chunks"] == 0 and cw["saved_tail_chunks"] == 0


@needs_vllm
@pytest.mark.slow
def test_an_in_process_store_under_the_mp_executor_is_refused_at_start():
    from bench.vllm_model import convert
    model_dir = str(convert())
    script = (
        "from vllm import LLM\n"
        "from vllm.config import KVTransferConfig\n"
        "ktc = KVTransferConfig(kv_connector='KVStoreConnector', kv_role='kv_both',\n"
        "    kv_connector_module_path='connectors.vllm',\n"
        "    kv_connector_extra_config={'cpu_bytes': '64MiB'})\n"
        f"LLM(model={model_dir!r}, dtype='float32', max_model_len=1024, enforce_eager=True,\n"
        "    distributed_executor_backend='uni', kv_cache_memory_bytes=64 << 20,\n"
        "    kv_transfer_config=ktc)\n"
        "print('STARTED', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["PYTHONPATH"] = str(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "STARTED" not in out
    assert "vLLM's executor 'mp' runs the worker in another process than the scheduler" in out
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in out

"""Fixtures of the router's end-to-end tests on the real SmolLM2-135M model: two in-process
engines (``ServerThread``) shared by the package, one ``python -m engine_min serve``
subprocess per module that asks for it (so it can be SIGKILLed), and a cache-aware router
over the two in-process engines per module."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine_min.config import EngineConfig
from engine_min.engine import LLMEngine
from engine_min.serve.server import ServerThread, create_app
from tests.engine_min.router.served import (BS, KV_BYTES, MAX_MODEL_LEN, MODEL, ROOT,
                                            free_port, settle, start_router)


@pytest.fixture(scope="module")
def spare():
    """An engine in its own process (so it can be SIGKILLed; one per module)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_min", "serve", "--port", str(port), "--served-model-name",
         MODEL, "--kv-cache-bytes", str(KV_BYTES), "--block-size", str(BS), "--max-model-len",
         str(MAX_MODEL_LEN), "--log-level", "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    yield proc, url
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    proc.stderr.close()


@pytest.fixture(scope="package")
def engines():
    """Two in-process engines (``srv.engine``), shared by the package's modules."""
    out = []
    for _ in range(2):
        engine = LLMEngine(EngineConfig(kv_cache_bytes=KV_BYTES, block_size=BS,
                                        max_model_len=MAX_MODEL_LEN, max_num_seqs=8))
        srv = ServerThread(create_app(engine, MODEL)).start()
        srv.engine = engine
        out.append(srv)
    yield out
    for srv in out:
        srv.stop()


@pytest.fixture(scope="module")
def router(engines):
    """A cache-aware router over ``engines``, its index caught up."""
    srv = start_router([e.url for e in engines], engines[0].engine.tokenizer)
    settle(srv, engines)
    yield srv
    srv.stop()

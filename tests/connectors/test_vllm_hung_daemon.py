"""KVStoreConnector on the real vLLM engine (CPU build) with a ``kvstore serve`` daemon that
stops answering (SIGSTOP): the daemon's circuit breaker makes the first lookup cost one
``timeout_s`` and skips the rest while it cools down (one probe per cool-down), the failure
is warned once, and after SIGCONT a probe brings the daemon back and requests hit again.
The daemon's own lookup counters move with vLLM traffic (the adapter asks the daemon's
lookup).

Skipped unless vLLM imports in the running interpreter; run it in the vLLM environment::

    .venv-vllm/bin/python -m pytest -q tests/connectors/test_vllm_hung_daemon.py

Engine starts: one in-process engine (prefix caching off, the daemon alone as store).
"""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (tools/make_vllm_env.sh)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from bench.vllm_engine import MODEL_ID, Daemon, make_document  # noqa: E402
from kvstore.daemon.client import KVStoreClient  # noqa: E402
from tests.connectors.vllm_fixtures import BLOCK, CHUNK, model_dir  # noqa: E402, F401

pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0   # the connector's per-call deadline (timeout_s)


class Records(logging.Handler):
    """INFO and WARNING records of the connector's and the breaker's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _prompts(first: int) -> list[str]:
    """Four new ~520-token questions (two full chunks each), distinct from every other call's."""
    return [make_document(first + k, 16) + "\nQuestion: what is exported?\nAnswer:"
            for k in range(4)]


def test_hung_daemon_costs_one_timeout_then_hits_again(model_dir):
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    # vLLM keeps one worker connector per process and builds none while it holds one: an engine
    # made earlier in this process (test_vllm_connector's) would lend this engine its worker,
    # whose saves then go to that engine's store, not this daemon
    ensure_kv_transfer_shutdown()
    rec = Records()
    loggers = [logging.getLogger(n) for n in ("kvstore.connectors.vllm", "kvstore.layered")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(rec)
        lg.setLevel(logging.INFO)
    with Daemon("256MiB") as d:
        ktc = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="connectors.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"model_id": MODEL_ID, "chunk_size": CHUNK,
                                       "kvstore_url": d.url, "timeout_s": TIMEOUT_S})
        llm = LLM(model=model_dir, dtype="float32", distributed_executor_backend="uni",
                  max_model_len=2048, enforce_eager=True, seed=0,
                  kv_cache_memory_bytes=128 << 20, enable_prefix_caching=False,
                  kv_transfer_config=ktc)
        w = get_kv_transfer_group()
        s = llm.llm_engine.engine_core.engine_core.scheduler.connector
        assert llm.llm_engine.vllm_config.cache_config.block_size == BLOCK
        sp = SamplingParams(temperature=0.0, max_tokens=2)
        lookup_s: list[float] = []
        real_lookup = s.scheduler.lookup

        def timed_lookup(*a):
            t0 = time.perf_counter()
            try:
                return real_lookup(*a)
            finally:
                lookup_s.append(time.perf_counter() - t0)
        s.scheduler.lookup = timed_lookup
        client = KVStoreClient(d.url, timeout_s=10.0)
        try:
            up = _prompts(100)
            llm.generate(up, sp, use_tqdm=False)   # saves their chunks in the daemon
            assert w.flush(60)
            assert w.counters["saved_chunks"] >= 8 and w.counters["save_errors"] == 0
            before = dict(s.counters)

            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                rec.records.clear()
                lookup_s.clear()
                t0 = time.perf_counter()
                outs = llm.generate(_prompts(200), sp, use_tqdm=False)
                stopped_s = time.perf_counter() - t0
                warnings = [r.getMessage() for r in rec.records
                            if r.levelno >= logging.WARNING]
                stats = s.stats()
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
            assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
            assert len(lookup_s) >= 4
            # the first lookup waits for its deadline, then lookups are skipped at once, but
            # for one probe each time a cool-down (2 s, then 4 s...) ends while the batch runs
            slow = [t for t in lookup_s if t >= 0.9 * TIMEOUT_S]
            fast = [t for t in lookup_s if t < 0.2 * TIMEOUT_S]
            assert len(slow) + len(fast) == len(lookup_s), lookup_s
            assert 1 <= len(slow) <= 1 + int(stopped_s // 2.0), (lookup_s, stopped_s)
            assert len(fast) >= 3, (lookup_s, stopped_s)
            assert s.counters["lookup_errors"] - before["lookup_errors"] >= 4
            assert stats["remote_breaker_trips"] >= len(slow)
            assert stats["remote_skipped_calls"] >= len(fast)
            # the breaker's line and the connector's one, not one per request
            lookup_lines = [m for m in warnings if "lookup" in m]
            assert 1 <= len(lookup_lines) <= 2, warnings

            # SIGCONT: once the cool-down ends a probe finds the daemon, and lookups hit again
            daemon0 = client.stats()
            deadline, hits = time.monotonic() + 60, 0
            while time.monotonic() < deadline and not hits:
                time.sleep(TIMEOUT_S)
                e0 = s.counters["external_tokens"]
                out = llm.generate(up[:1], sp, use_tqdm=False)[0]
                hits = s.counters["external_tokens"] - e0
            assert hits >= 2 * CHUNK, hits
            assert out.num_cached_tokens >= 2 * CHUNK
            daemon1 = client.stats()
            assert daemon1["lookups"] > daemon0["lookups"]
            assert daemon1["hit_tokens"] - daemon0["hit_tokens"] >= 2 * CHUNK
            assert any("answers again" in r.getMessage() for r in rec.records), \
                [r.getMessage() for r in rec.records]
        finally:
            for lg, level in zip(loggers, levels):
                lg.removeHandler(rec)
                lg.setLevel(level)
            client.close()
            ensure_kv_transfer_shutdown()

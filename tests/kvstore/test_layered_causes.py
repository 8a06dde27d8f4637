"""``LayeredStore`` logs the daemon's failures once per operation and cause, logs anew after the
operation worked again, and says when it works again. Real ``kvstore serve`` processes, one at
a time on one port: a daemon killed (connection refused), restarted with a CPU tier smaller
than a full chunk (400 on every full-chunk put; the small tail pieces still fit), restarted
whole (works again), killed again (refused, logged again).
"""
from __future__ import annotations

import logging
import re
import signal
import time

import torch

from kvstore.config import StoreConfig
from kvstore.daemon.client import KVStoreClient
from kvstore.keys import Namespace
from kvstore.layered import CircuitBreakerStore, LayeredStore
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from tests.kvstore.daemon.test_cli import TOKEN, Daemon

FULL = Namespace("m", KVLayout(2, 1, 64, "float16", 256))    # 128 KiB chunks
TAIL = Namespace("m", KVLayout(2, 1, 64, "float16", 16))     # 8 KiB pieces
SMALL_TIER = ("--cpu-bytes", "64KiB", "--page-bytes", "64KiB")   # holds no full chunk


def _put(store: LayeredStore, ns: Namespace, seed: int) -> int:
    toks = list(range(seed * 1000, seed * 1000 + ns.layout.chunk_size))
    kv = torch.full(ns.layout.shape(), float(seed % 100), dtype=torch.float16)
    return store.put_chunks(ns, ns.chunk_keys(toks), [kv])


def _lines(caplog, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvstore.layered" and r.levelno == level and "-token chunks" in
            r.getMessage()]


def _past_cooldown(store: LayeredStore) -> None:
    time.sleep(0.15)   # the breaker's 0.1 s cool-down: the next call is sent (a probe)


def test_each_daemon_failure_cause_is_logged_then_recovery_then_again(tmp_path, caplog):
    d = Daemon(tmp_path / "log1", "--cpu-bytes", "4MiB")
    port, url = d.port, d.url
    client = KVStoreClient(url, auth_token=TOKEN, timeout_s=5)
    store = LayeredStore(ChunkStore(StoreConfig(cpu_bytes="4MiB")),
                         CircuitBreakerStore(client, cooldown_s=0.1, max_cooldown_s=0.1))
    store.causes.relog_interval_s = 0.0   # rate limit off: a recovery alone re-arms a cause
    full_kind = f"remote store {url} put of 256-token chunks"
    daemons = [d]
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.layered"):
            assert _put(store, FULL, 1) == 1 and _put(store, TAIL, 1) == 1
            assert _lines(caplog) == [] and store.remote_errors == 0

            assert d.stop(signal.SIGKILL) == -signal.SIGKILL          # connection refused
            _put(store, FULL, 2)
            for seed in (3, 4):            # the same cause again (probes after cool-downs)
                _past_cooldown(store)
                assert _put(store, FULL, seed) == 1                   # the local copy
            lines = _lines(caplog)
            assert len(lines) == 1 and lines[0].startswith(f"{full_kind} failed (StoreUnavailable")
            assert "connection refused" in lines[0] and store.remote_errors == 3

            daemons.append(Daemon(tmp_path / "log2", "--port", str(port), *SMALL_TIER))
            _past_cooldown(store)
            _put(store, FULL, 5)                                      # 400: a new cause
            assert _put(store, TAIL, 5) == 1                          # pieces still fit
            _put(store, FULL, 6)                                      # same 400: quiet
            lines = _lines(caplog)
            assert len(lines) == 2, lines
            assert lines[1].startswith(f"{full_kind} failed (RemoteError: kvstore server error "
                                       f"400: cpu tier capacity 65536 bytes")
            assert store.remote_errors == 5
            assert daemons[1].stop() == 0

            daemons.append(Daemon(tmp_path / "log3", "--port", str(port), "--cpu-bytes", "4MiB"))
            _past_cooldown(store)
            assert _put(store, FULL, 7) == 1
            info = _lines(caplog, logging.INFO)
            assert len(info) == 1 and re.fullmatch(
                rf"{re.escape(full_kind)} works again \((\d+) failures since it last worked\)",
                info[0]), info
            assert int(info[0].split("(")[1].split()[0]) >= 5   # refused x3, 400 x2 (+ skipped)
            with KVStoreClient(url, auth_token=TOKEN, timeout_s=5) as c:
                assert c.exists(FULL, FULL.chunk_keys(list(range(7000, 7256)))) == [True]

            assert daemons[2].stop(signal.SIGKILL) == -signal.SIGKILL  # fails anew
            _put(store, FULL, 8)
            lines = _lines(caplog)
            assert len(lines) == 3 and lines[2].startswith(f"{full_kind} failed "
                                                           "(StoreUnavailable")
            # the tail pieces never failed: nothing logged nor recovered for them
            assert not any("16-token" in line for line in lines + _lines(caplog, logging.INFO))
    finally:
        for dd in daemons:
            if dd.proc.poll() is None:
                dd.stop(signal.SIGKILL)
        store.close()

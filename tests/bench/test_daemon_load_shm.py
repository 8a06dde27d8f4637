"""``bench.daemon_load_shm`` at its smallest: one repetition of one real-model-sized chunk per
round against an in-process daemon serving its Unix socket; every figure is filled in."""
from __future__ import annotations

import argparse

from bench.daemon_load_common import chunk_pool
from bench.daemon_load_shm import shm_phase
from kvstore.config import StoreConfig
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore


def test_shm_phase_fills_every_figure(tmp_path, capsys):
    store = ChunkStore(StoreConfig(cpu_bytes=256 << 20, cpu_shared=True))
    sock = str(tmp_path / "kv.sock")
    srv = ThreadedServer(create_app(store, ServerLimits(max_batch_keys=256)), unix_socket=sock)
    out: dict = {}
    try:
        shm_phase(sock, argparse.Namespace(reps=1, rounds=1, batch=1, quick=True),
                  chunk_pool(2), out)
        assert store.stored_keys() == set()  # every namespace it wrote was cleared
    finally:
        srv.stop()
        store.close()
    for sfx in ("", "_8c"):
        for name in ("shm_put_gbps", "shm_get_gbps", "shm_get_alloc_gbps",
                     "shm_get_vs_memcpy", "shm_put_vs_memcpy"):
            assert out[name + sfx] > 0, name + sfx
    for name in ("memcpy_gbps", "memcpy_put_gbps", "memcpy_2t_gbps", "memcpy_put_2t_gbps",
                 "memcpy_cached_gbps", "shm_get_vs_memcpy_cached", "shm_put_vs_memcpy_cached"):
        assert out[name] > 0, name
    assert 0 < out["unix_lookup32_ms"] <= out["unix_lookup32_p99_ms"]
    assert out["shm_load8_borrow_ms"] > 0 and out["shm_load8_copy_ms"] > 0
    assert "lookup of a 32-chunk prompt over the unix socket" in capsys.readouterr().out

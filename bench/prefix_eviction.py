"""Bookkeeping cost of placement with prefix-aware eviction: put time per chunk into full
tiers, with chunks so small (128 bytes) that copies cost little and the eviction choice (keep
each put's ancestors, prefer victims with no stored child, spill or take descendants along)
dominates.

    python -m bench.prefix_eviction [--prompts 300] [--chunks 20]

Prints microseconds per chunk put, for a CPU tier of 1000 chunks and for a CPU tier of 500
chunks in front of a disk tier of ~1000, each fed ``prompts`` distinct prompts of ``chunks``
chunks, and ``unreachable_bytes`` after (0: nothing stranded). Figures, not a timed test.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch

from kvstore.api import PrefixStore
from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAYOUT = KVLayout(1, 1, 4, "float32", 4)  # [1, 2, 4, 1, 4] float32: 128 bytes per chunk
NS = Namespace("bench/prefix-eviction", LAYOUT)


def run(cfg: StoreConfig, prompts: int, chunks: int) -> tuple[float, int]:
    """(microseconds per chunk put, unreachable bytes after) for one store config."""
    store = ChunkStore(cfg, [NS])
    ps = PrefixStore(store, NS)
    T = 4 * chunks
    kv = torch.randn(1, 2, T, 1, 4)  # [L, 2, T, H, D]
    toks = [[p * 100_000 + t for t in range(T)] for p in range(prompts)]
    t0 = time.perf_counter()
    for t in toks:
        ps.put(t, kv)
    store.flush()
    dt = time.perf_counter() - t0
    unreachable = store.stats()["unreachable_bytes"]
    store.close()
    return dt / (prompts * chunks) * 1e6, unreachable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=20, help="chunks per prompt")
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    try:
        for name, cfg in (
                ("cpu 1000 chunks", StoreConfig(cpu_bytes=1000 * 128, page_bytes=128)),
                ("cpu 500 + disk ~1000 chunks",
                 StoreConfig(cpu_bytes=500 * 128, page_bytes=128,
                             disk_bytes=1000 * (128 + HEADER_BYTES_MAX), disk_path=d))):
            us, unreachable = run(cfg, args.prompts, args.chunks)
            print(f"{name:28s} {us:8.1f} us/chunk  unreachable_bytes {unreachable}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()

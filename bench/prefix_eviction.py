"""Bookkeeping cost of placement with prefix-aware eviction: put time per chunk into full
tiers, with chunks so small (128 bytes) that copies cost little and the eviction choice (keep
each put's ancestors, prefer victims with no stored child, spill or take descendants along)
dominates.

    python -m bench.prefix_eviction [--prompts 300] [--chunks 20] [--long 1024,4096,16384]

Prints microseconds per chunk put, for a CPU tier of 1000 chunks and for a CPU tier of 500
chunks in front of a disk tier of ~1000, each fed ``prompts`` distinct prompts of ``chunks``
chunks, and ``unreachable_bytes`` after (0: nothing stranded).

Then one long prompt (a chain of each ``--long`` length) through a CPU tier of 1024 chunks,
alone (the chain's head stays, the rest is refused) and over a disk tier that takes every
chunk (each chunk past the first 1024 spills one), by both put paths of the daemon:
``put_chunks`` in requests of 64 chunks, and ``reserve_chunks`` one chunk at a time with a
``commit_chunks`` per request. Microseconds per chunk should not grow with the chain's length.
Figures, not a timed test.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch

from bench.arg_checks import int_at_least, int_list
from kvstore.api import PrefixStore
from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.direct import Reservation
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


def run_chain(cfg: StoreConfig, n: int, path: str, batch: int = 64) -> tuple[float, int, int]:
    """(microseconds per chunk, chunks a lookup hits, unreachable bytes) for one chain of ``n``
    chunks put through ``path`` (``"put"``: ``put_chunks`` per request of ``batch`` chunks;
    ``"reserve"``: ``reserve_chunks`` per chunk, ``commit_chunks`` per request, a chunk with no
    reservation committed as a tensor, as the daemon stages it for a lower tier)."""
    store = ChunkStore(cfg, [NS])
    keys = NS.chunk_keys(range(4 * n))
    kv = torch.randn(LAYOUT.shape())  # [1, 2, 4, 1, 4]
    raw = kv.reshape(-1).view(torch.uint8)
    t0 = time.perf_counter()
    for lo in range(0, n, batch):
        ks = keys[lo:lo + batch]
        parents = [keys[i - 1] if i else None for i in range(lo, lo + len(ks))]
        if path == "put":
            store.put_chunks(NS, ks, [kv] * len(ks), parents)
            continue
        items = []
        for k, p in zip(ks, parents):
            (it,) = store.reserve_chunks(NS, [k], [p])
            if isinstance(it, Reservation):
                it.views[0].copy_(raw)
            items.append(it if it is not None else kv)
        store.commit_chunks(NS, ks, items, parents)
    store.flush()
    dt = time.perf_counter() - t0
    hit = store.lookup_keys(NS, keys).num_hit_chunks
    unreachable = store.stats()["unreachable_bytes"]
    store.close()
    return dt / n * 1e6, hit, unreachable


def long_chains(lengths: list[int], d: str) -> None:
    for n in lengths:
        for name, cfg in (
                ("cpu 1024", StoreConfig(cpu_bytes=1024 * 128, page_bytes=128)),
                ("cpu 1024 + disk", StoreConfig(cpu_bytes=1024 * 128, page_bytes=128,
                                                disk_bytes=n * (128 + HEADER_BYTES_MAX),
                                                disk_path=f"{d}/chain{n}"))):
            for path in ("put", "reserve"):
                us, hit, unreachable = run_chain(cfg, n, path)
                print(f"chain {n:6d} {name:16s} {path:8s} {us:8.1f} us/chunk  hits {hit:6d}  "
                      f"unreachable_bytes {unreachable}", flush=True)
                shutil.rmtree(f"{d}/chain{n}", ignore_errors=True)


_DURATION = ("Duration on the 2-core machine: the default run 13 s wall (nice 19, load average\n"
             "2.4-5.0 from other work, 2026-12-02).")


def build_parser() -> argparse.ArgumentParser:
    """The command line (numeric flags checked as it is parsed: ``bench.arg_checks``)."""
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int_at_least(1), default=300)
    ap.add_argument("--chunks", type=int_at_least(1), default=20, help="chunks per prompt")
    ap.add_argument("--long", type=int_list(1), default=[1024, 4096, 16384],
                    help="chain lengths (chunks) of the long-prompt runs; empty: skip them")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    d = tempfile.mkdtemp()
    try:
        for name, cfg in (
                ("cpu 1000 chunks", StoreConfig(cpu_bytes=1000 * 128, page_bytes=128)),
                ("cpu 500 + disk ~1000 chunks",
                 StoreConfig(cpu_bytes=500 * 128, page_bytes=128,
                             disk_bytes=1000 * (128 + HEADER_BYTES_MAX), disk_path=d))):
            us, unreachable = run(cfg, args.prompts, args.chunks)
            print(f"{name:28s} {us:8.1f} us/chunk  unreachable_bytes {unreachable}", flush=True)
        long_chains(args.long, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()

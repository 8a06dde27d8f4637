"""Store micro-benchmark: put/get GB/s per tier next to memcpy and raw lmdb, lz4 ratios,
lookup time of a 128k-token prompt.

    python -m bench.store_micro [--quick] [--json PATH]

Chunks are shaped like the real model's (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64,
256 tokens, fp16 -> 5,898,240 bytes). Payloads are random normal fp16 unless noted: lz4 on
real KV is measured on KV computed by ``engine_min`` when it loads (else reported as null).
Figures, not a timed test. Targets (issue 2): CPU get >= 0.5x memcpy; disk get >= 0.5x raw
lmdb + lz4; lookup of 128k tokens < 2 ms.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import lmdb
import lz4.block
import numpy as np
import torch
import xxhash

from kvstore.api import PrefixStore
from kvstore.codec import shuffle
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from bench.outputs import output_file

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", chunk_size=256)
NS = Namespace("bench/SmolLM2-135M", LAYOUT)
GB = 1e9


def _best(fn, reps: int) -> float:
    """Best wall time of ``reps`` runs of ``fn`` (seconds)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _best_alternating(fns: dict, reps: int) -> dict:
    """Best wall time of each function, running them in turn ``reps`` times, so that load from
    other processes hits all of them alike (this machine is shared)."""
    best = {k: float("inf") for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _chunks(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYOUT.shape(), generator=g).half() for _ in range(n)]  # [30, 2, 256, 3, 64]


def bench_memory(chunks, reps) -> dict:
    """memcpy (numpy, into a new buffer and into a preallocated one) and CPU-tier put/get,
    measured in turn."""
    n, nbytes = len(chunks), sum(c.nbytes for c in chunks)
    src = [c.numpy() for c in chunks]
    dst = [np.empty_like(a) for a in src]
    store = ChunkStore(StoreConfig(cpu_bytes=n * LAYOUT.chunk_bytes), [NS])
    keys = NS.chunk_keys(np.arange(n * 256) % 49152)

    def put():
        store.clear()
        store.put_chunks(NS, keys, chunks)

    def copy_into():
        for a, b in zip(src, dst):
            np.copyto(b, a)

    bufs = [torch.empty_like(c) for c in chunks]
    best = _best_alternating({
        "memcpy_gbps": lambda: [a.copy() for a in src],
        "memcpy_into_gbps": copy_into,
        "cpu_put_gbps": put,
        "cpu_get_gbps": lambda: store.get_chunks(NS, keys),
        "cpu_get_into_gbps": lambda: store.get_chunks(NS, keys, out=bufs),
    }, reps)
    got = store.get_chunks(NS, keys)
    assert all(torch.equal(a, b) for a, b in zip(got, chunks))
    out = {k: nbytes / t / GB for k, t in best.items()}
    out.update(bench_threads(store, keys, chunks, 8, reps))
    store.close()
    return out


def bench_threads(store: ChunkStore, keys, chunks, threads: int, reps: int,
                  batch: int = 2, rounds: int = 4) -> dict:
    """Aggregate CPU-tier GB/s of ``threads`` threads doing batched put, get into fresh
    tensors, and get into reused buffers (as the daemon's store threads do), each thread over
    its own slice of the chunks (gets: ``rounds`` passes; best of ``reps``). Fresh tensors of 5.9 MB are page-faulted in on every call
    (glibc hands such freed buffers back to the OS), which is what the daemon measured as
    ~0.3 GB/s under load before it reused buffers."""
    import threading
    n = len(keys)
    slices = [list(range(i, n, threads)) for i in range(threads)]
    bufs = [[torch.empty_like(chunks[0]) for _ in range(batch)] for _ in range(threads)]

    def run(fn) -> float:
        ths = [threading.Thread(target=fn, args=(t,)) for t in range(threads)]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return time.perf_counter() - t0

    def batches(t):
        idx = slices[t]
        return [idx[i:i + batch] for i in range(0, len(idx), batch)]

    def put(t):
        for b in batches(t):
            store.put_chunks(NS, [keys[i] for i in b], [chunks[i] for i in b])

    def get(t):
        for _ in range(rounds):
            for b in batches(t):
                store.get_chunks(NS, [keys[i] for i in b])

    def get_into(t):
        for _ in range(rounds):
            for b in batches(t):
                store.get_chunks(NS, [keys[i] for i in b], out=bufs[t][:len(b)])

    nbytes = sum(c.nbytes for c in chunks)
    t_put = t_get = t_into = float("inf")
    for _ in range(reps):
        store.clear()
        t_put = min(t_put, run(put))
        t_get, t_into = min(t_get, run(get)), min(t_into, run(get_into))
    return {f"cpu_put_{threads}t_gbps": nbytes / t_put / GB,
            f"cpu_get_{threads}t_gbps": rounds * nbytes / t_get / GB,
            f"cpu_get_into_{threads}t_gbps": rounds * nbytes / t_into / GB}


def _cold_get(store, keys, nbytes: int, data_file: str, reps: int) -> dict:
    """Disk-tier get GB/s with the tier's data file evicted from the page cache before each
    rep (best of ``reps``; ``bench.page_cache``), and the bytes still cached after the last
    eviction (0 when the eviction worked; where it cannot, the figure is not a cold one)."""
    from bench import page_cache
    best, left = float("inf"), None
    for _ in range(reps):
        page_cache.drop(data_file)
        left = page_cache.resident_bytes(data_file)[0]
        t0 = time.perf_counter()
        store.get_chunks(NS, keys)
        best = min(best, time.perf_counter() - t0)
    return {"disk_cold_get_gbps": nbytes / best / GB, "disk_cold_cached_bytes": left}


def bench_disk(chunks, reps, workdir) -> dict:
    """Disk-tier put (until ``put`` returns, and until committed) and get, next to raw lmdb
    put/get of the same bytes; the gets are measured in turn."""
    n, nbytes = len(chunks), sum(c.nbytes for c in chunks)
    cfg = StoreConfig(cpu_bytes=0, disk_bytes=4 * n * LAYOUT.chunk_bytes, disk_path=f"{workdir}/disk",
                      promote_on_hit=False)
    store = ChunkStore(cfg, [NS])
    keys = NS.chunk_keys(np.arange(n * 256) % 49152)
    t0 = time.perf_counter()
    store.put_chunks(NS, keys, chunks)
    t_return = time.perf_counter() - t0
    store.flush()
    t_durable = time.perf_counter() - t0
    out = {"disk_put_return_gbps": nbytes / t_return / GB, "disk_put_gbps": nbytes / t_durable / GB}

    raws = [c.numpy().view(np.uint8).reshape(-1) for c in chunks]
    env = lmdb.open(f"{workdir}/raw", map_size=8 * nbytes + 2**26, readahead=False, metasync=False)
    t0 = time.perf_counter()
    with env.begin(write=True) as txn:
        for i, r in enumerate(raws):
            txn.put(b"k%05d" % i, r)
    env.sync(True)
    out["lmdb_raw_put_gbps"] = nbytes / (time.perf_counter() - t0) / GB
    with env.begin(write=True) as txn:
        for i, r in enumerate(raws):
            txn.put(b"z%05d" % i, lz4.block.compress(r, store_size=False))

    def get_raw(check=False):
        with env.begin(buffers=True) as txn:
            for i in range(n):
                buf = txn.get(b"k%05d" % i)
                if check:
                    xxhash.xxh3_64_intdigest(buf)
                np.frombuffer(buf, dtype=np.uint8).copy()

    def get_lz4():
        with env.begin(buffers=True) as txn:
            for i, r in enumerate(raws):
                lz4.block.decompress(txn.get(b"z%05d" % i), uncompressed_size=r.nbytes)

    best = _best_alternating({
        "disk_get_gbps": lambda: store.get_chunks(NS, keys),
        "lmdb_raw_get_gbps": get_raw,
        "lmdb_lz4_get_gbps": get_lz4,
        "lmdb_raw_get_xxh3_gbps": lambda: get_raw(True),
    }, reps)
    out.update({k: nbytes / t / GB for k, t in best.items()})
    got = store.get_chunks(NS, keys)
    assert all(torch.equal(a, b) for a, b in zip(got, chunks))
    out.update(_cold_get(store, keys, nbytes, f"{workdir}/disk/data.mdb", reps))
    out["disk_codec_counts"] = _codec_counts(store)
    store.close()
    env.close()
    return out


def _codec_counts(store) -> dict:
    from kvstore.codec import unpack_header
    disk = next(t for t in store.tiers if t.name == "disk")
    counts: dict = {}
    with disk.env.begin(buffers=True) as txn:
        for _, v in txn.cursor():
            c = unpack_header(v).codec
            counts[c] = counts.get(c, 0) + 1
    return counts


def lz4_ratios(raw: np.ndarray, itemsize: int = 2) -> dict:
    """Compressed/raw size for plain lz4 and byte-shuffle + lz4 (lower is better)."""
    return {"lz4": len(lz4.block.compress(raw, store_size=False)) / raw.nbytes,
            "shuffle_lz4": len(lz4.block.compress(shuffle(raw, itemsize), store_size=False)) / raw.nbytes}


def real_kv_bytes(max_tokens: int = 512) -> tuple[np.ndarray | None, str]:
    """KV bytes computed by engine_min on the real model (fp16), or (None, reason)."""
    try:
        from engine_min.config import EngineConfig
        from engine_min.engine import LLMEngine
        from engine_min.sampler import SamplingParams
        eng = LLMEngine(EngineConfig(dtype="float16", kv_cache_bytes=64 * 2**20))
        text = ("The history of the printing press begins in the fifteenth century, when movable "
                "type changed how knowledge spread across Europe. ") * 40
        ids = eng.tokenizer.encode(text)[:max_tokens]
        eng.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        kv = eng.kv_cache  # [layers, 2, num_blocks, block_size, heads, head_dim]
        used = kv.flatten(3).abs().sum(dim=(0, 1, 3)) > 0  # blocks that hold KV
        data = kv[:, :, used].contiguous()
        return data.view(torch.uint8).numpy().reshape(-1), f"engine_min, {len(ids)} prompt tokens"
    except Exception as e:  # the engine is optional here
        return None, f"engine_min unavailable: {type(e).__name__}: {e}"[:200]


def bench_lookup(reps) -> dict:
    lay = KVLayout(1, 1, 8, "float16", 256)  # lookup cost does not depend on the chunk's bytes
    ns = Namespace("bench/lookup", lay)
    tokens = np.arange(128 * 1024) % 49152
    store = ChunkStore(StoreConfig(cpu_bytes=512 * lay.chunk_bytes, page_bytes=lay.chunk_bytes), [ns])
    ps = PrefixStore(store, ns)
    ps.put(tokens, torch.zeros(lay.shape(len(tokens)), dtype=torch.float16))
    assert ps.lookup(tokens).num_hit_tokens == 128 * 1024
    keys = ps.keys(tokens)
    out = {"lookup_128k_ms": _best(lambda: ps.lookup(tokens), reps) * 1e3,
           "lookup_128k_keys_only_ms": _best(lambda: store.lookup_keys(ns, keys), reps) * 1e3,
           "hash_128k_ms": _best(lambda: ns.chunk_keys(tokens), reps) * 1e3}
    store.close()
    return out


_DURATION = ("Duration on the 2-core machine: --quick 12 s wall, the default run (64 chunks, best\n"
             "of 9) 45 s wall (nice 19, load average 2.4-5.0 from other work, 2026-12-02).")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 chunks (94 MB), best of 5 (default: 64 chunks, best of 9)")
    ap.add_argument("--json", metavar="PATH", type=output_file,
                    help="also write the figures as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n, reps = (16, 5) if args.quick else (64, 9)
    chunks = _chunks(n)
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-")
    res: dict = {"chunk_bytes": LAYOUT.chunk_bytes, "num_chunks": n, "payload": "random normal fp16"}
    try:
        res.update(bench_memory(chunks, reps))
        res.update(bench_disk(chunks, reps, workdir))
        res.update(bench_lookup(max(reps, 10)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    random_raw = chunks[0].numpy().view(np.uint8).reshape(-1)
    rnd = lz4_ratios(random_raw)
    res["lz4_ratio_random"] = rnd["lz4"]
    res["shuffle_lz4_ratio_random"] = rnd["shuffle_lz4"]
    real, source = real_kv_bytes(256 if args.quick else 1024)
    res["real_kv_source"] = source
    if real is not None:
        r = lz4_ratios(real)
        res["lz4_ratio_real"], res["shuffle_lz4_ratio_real"] = r["lz4"], r["shuffle_lz4"]
        res["lz4_ratio"] = r["lz4"]
    else:
        res["lz4_ratio_real"] = res["shuffle_lz4_ratio_real"] = None
        res["lz4_ratio"] = rnd["lz4"]
    res["cpu_get_vs_memcpy"] = res["cpu_get_gbps"] / res["memcpy_gbps"]
    res["disk_get_vs_lmdb_lz4"] = res["disk_get_gbps"] / res["lmdb_lz4_get_gbps"]
    _print(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


def _print(res: dict) -> None:
    print(f"chunk {res['chunk_bytes']} bytes x {res['num_chunks']} ({res['payload']})")
    rows = [("memcpy (np.copy, new buffer)", "memcpy_gbps"), ("memcpy (np.copyto, preallocated)", "memcpy_into_gbps"),
            ("CPU tier put", "cpu_put_gbps"), ("CPU tier get", "cpu_get_gbps"),
            ("CPU tier get into reused buffers", "cpu_get_into_gbps"),
            ("CPU tier put, 8 threads", "cpu_put_8t_gbps"),
            ("CPU tier get, 8 threads", "cpu_get_8t_gbps"),
            ("CPU tier get into buffers, 8 thr.", "cpu_get_into_8t_gbps"),
            ("disk tier put (returns)", "disk_put_return_gbps"), ("disk tier put (committed)", "disk_put_gbps"),
            ("disk tier get", "disk_get_gbps"),
            ("disk tier get, page cache cold", "disk_cold_get_gbps"),
            ("raw lmdb put", "lmdb_raw_put_gbps"),
            ("raw lmdb get", "lmdb_raw_get_gbps"), ("raw lmdb get + lz4 decompress", "lmdb_lz4_get_gbps"),
            ("raw lmdb get + xxh3 check", "lmdb_raw_get_xxh3_gbps")]
    for label, k in rows:
        print(f"  {label:32s} {res[k]:7.2f} GB/s")
    print(f"  CPU get / memcpy                 {res['cpu_get_vs_memcpy']:7.2f}x  (target >= 0.5)")
    print(f"  disk get / (lmdb + lz4)          {res['disk_get_vs_lmdb_lz4']:7.2f}x  (target >= 0.5)")
    print(f"  disk codecs used                 {res['disk_codec_counts']}")
    print(f"  lookup 128k tokens               {res['lookup_128k_ms']:7.3f} ms (hash {res['hash_128k_ms']:.3f} ms; "
          f"keys only {res['lookup_128k_keys_only_ms']:.3f} ms; target < 2)")
    print(f"  lz4 ratio random fp16            {res['lz4_ratio_random']:.3f} (shuffle+lz4 "
          f"{res['shuffle_lz4_ratio_random']:.3f})")
    if res["lz4_ratio_real"] is not None:
        print(f"  lz4 ratio real KV                {res['lz4_ratio_real']:.3f} (shuffle+lz4 "
              f"{res['shuffle_lz4_ratio_real']:.3f}; {res['real_kv_source']})")
    else:
        print(f"  lz4 ratio real KV                n/a ({res['real_kv_source']})")


if __name__ == "__main__":
    main()

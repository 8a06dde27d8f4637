"""The same-host phase of ``bench.daemon_load``: get and put through the daemon's Unix socket
with its CPU arena mapped read-only (``kvstore.daemon.shm_client``), against memcpy of the same
chunks in the same run, and a 32-chunk lookup over the socket.

Figures (GB/s of chunk payload; ``_8c``: 8 client threads sharing one client's connection
pool, each with its own connections):

* ``memcpy_gbps``: one thread's ``np.copyto`` of the same chunks from the same memory into the
  same destinations as the 1-client get: from the arena pages the stored chunks occupy (the
  client's read-only mapping, borrowed views) into the get's ``out`` buffers (target: get >=
  0.8x). ``memcpy_put_gbps``: the same chunks as the 1-client put, from its source tensors
  into a destination as large as the bytes it stores, touched once before (as the arena's
  pages are; target: put >= 0.5x). ``memcpy_cached_gbps``: 8 source tensors copied round robin
  into ``batch`` destinations (70 MB in all: it stays in a large L3 cache, so it runs 1.3-1.8x
  the figures above, which move as many distinct bytes as the paths they are compared to).
  ``_2t`` suffixes: the same copies cut in two halves on two threads (a copy from or to
  memory outside the cache gains 1.4-1.8x from a second thread, on this host). With 1 client
  the get and the put are timed in pairs with these copies, batch by batch
  (``paired_passes``), so the host's load moves both sides of a ratio alike; with 8 clients
  the passes are timed whole, one after the other.
* ``shm_get_gbps``: ``get_chunks(..., out=)`` into preallocated buffers (an engine copying
  into its KV pool); ``shm_get_alloc_gbps``: into new tensors.
* ``shm_put_gbps``: ``put_chunks`` of ``batch`` chunks per call, by the client's default path:
  read by the daemon from the tensors' memory when the kernel lets it (``shm_put_path``:
  ``"vm"``; ``kvstore.daemon.shm_vm``), else through the staging area (``"staging"``);
  ``shm_put_staged_gbps``: the same puts through the staging area (``vm_put=False``), in the
  same repetition; ``shm_put_client_cpu_ms`` / ``shm_put_staged_client_cpu_ms``: the client
  process's CPU time per chunk put (1 client), what a put takes from the engine.
* ``unix_lookup32_ms``: median (and p99) round trip of a lookup of a 32-chunk prompt.
* ``shm_load8_borrow_ms`` / ``shm_load8_copy_ms``: median milliseconds to load 8 chunks into a
  paged KV pool (16-token blocks) as the engine's connector does: scattered straight from
  borrowed views of the arena (``get_borrowed``), or ``get_chunks`` into new tensors first.
"""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from bench.daemon_load_common import CHUNK_BYTES, LAYOUT
from kernels import ops
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.keys import Namespace


def bench_memcpy_chunks(tensors: list[torch.Tensor], copies: int, batch: int) -> float:
    """GB/s of ``copies`` chunk copies from ``tensors`` (round robin) into ``batch``
    preallocated destinations (round robin: as a get copies into its ``out`` buffers), one
    thread."""
    srcs = [t.view(torch.uint8).reshape(-1).numpy() for t in tensors]
    dsts = [np.empty_like(srcs[0]) for _ in range(batch)]
    for d in dsts:  # first touch of the destinations
        np.copyto(d, srcs[0])
    t0 = time.perf_counter()
    for i in range(copies):
        np.copyto(dsts[i % len(dsts)], srcs[i % len(srcs)])
    return copies * CHUNK_BYTES / (time.perf_counter() - t0) / 1e9


def _copy_2t(pool: ThreadPoolExecutor | None, dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)``, the second half on ``pool``'s thread when given."""
    if pool is None:
        np.copyto(dst, src)
        return
    h = dst.size // 2
    f = pool.submit(np.copyto, dst[h:], src[h:])
    np.copyto(dst[:h], src[:h])
    f.result()


def memcpy_same_chunks(c: ShmKVStoreClient, ns: Namespace, batches: list, outs: list,
                       pool: ThreadPoolExecutor | None = None) -> dict:
    """GB/s of one thread (two with ``pool``) copying the chunks of ``batches`` (``[(keys,
    source tensors)]``, stored in the daemon) as the get and the put move them: ``get``, from
    their arena pages (borrowed views; the borrow's round trip is not timed) into ``outs``;
    ``put``, from the source tensors into a destination of all their bytes, touched first."""
    t_get = 0.0
    for ks, _ in batches:
        with c.get_borrowed(ns, ks) as b:
            dsts = [o.view(torch.uint8).reshape(-1).numpy() for o in outs[:len(ks)]]
            t0 = time.perf_counter()
            for parts, dst in zip(b.parts, dsts):
                pos = 0
                for v in parts:
                    n = v.numel()
                    _copy_2t(pool, dst[pos:pos + n], v.numpy())
                    pos += n
            t_get += time.perf_counter() - t0
    last_kvs = batches[-1][1]
    assert all(torch.equal(o, kv) for o, kv in zip(outs, last_kvs)), "memcpy copied wrong bytes"
    n_chunks = sum(len(ks) for ks, _ in batches)
    big = np.ones(n_chunks * CHUNK_BYTES, dtype=np.uint8)  # first touch, as the arena's pages
    t0, pos = time.perf_counter(), 0
    for _, kvs in batches:
        for kv in kvs:
            _copy_2t(pool, big[pos:pos + CHUNK_BYTES], kv.view(torch.uint8).reshape(-1).numpy())
            pos += CHUNK_BYTES
    t_put = time.perf_counter() - t0
    total = n_chunks * CHUNK_BYTES
    return {"get": total / t_get / 1e9, "put": total / t_put / 1e9}


def paired_passes(c: ShmKVStoreClient, ns: Namespace, batches: list, outs: list) -> dict:
    """GB/s of one client's puts and gets of ``batches`` (``[(keys, source tensors)]``; ``ns``
    empty before) and of one thread's memcpy of the same chunks (as ``memcpy_same_chunks``),
    timed in pairs: each put or get of batch ``r`` beside the memcpy of batch ``r + n/2``, the
    order inside a pair alternating. A get and its copy read distinct arena pages, neither
    just brought into the cache by the other; a put and its copy write distinct pages but read
    the same few source tensors (``tensors`` round robin), which stay in the cache for both. On a shared host two separate passes of ~0.2 s over the same copy differ by up
    to 1.5x; paired, a slow second slows both sides. Leaves the batches stored.

    Returns:
        ``{"put", "memcpy_put", "get", "memcpy_get"}``: bytes moved over the summed seconds;
        ``"put_cpu_s"``: this process's CPU seconds inside the puts.
    """
    n, half = len(batches), len(batches) // 2
    sizes = [len(ks) * CHUNK_BYTES for ks, _ in batches]
    starts = [sum(sizes[:r]) for r in range(n)]
    big = np.ones(sum(sizes), dtype=np.uint8)  # the put's memcpy destination, touched first
    dsts = [o.view(torch.uint8).reshape(-1).numpy() for o in outs]

    put_cpu = [0.0]

    def put(r: int) -> float:
        ks, kvs = batches[r]
        t0, cpu0 = time.perf_counter(), time.process_time()
        assert c.put_chunks(ns, ks, kvs) == len(ks)
        dt = time.perf_counter() - t0
        put_cpu[0] += time.process_time() - cpu0
        return dt

    def memcpy_put(r: int) -> float:
        pos = starts[r]
        t0 = time.perf_counter()
        for kv in batches[r][1]:
            np.copyto(big[pos:pos + CHUNK_BYTES], kv.view(torch.uint8).reshape(-1).numpy())
            pos += CHUNK_BYTES
        return time.perf_counter() - t0

    def get(r: int) -> float:
        ks = batches[r][0]
        t0 = time.perf_counter()
        got = c.get_chunks(ns, ks, outs[:len(ks)])
        dt = time.perf_counter() - t0
        assert all(g is not None for g in got)
        return dt

    def memcpy_get(r: int) -> float:
        with c.get_borrowed(ns, batches[r][0]) as b:  # the borrow's round trip is not timed
            t0 = time.perf_counter()
            for parts, dst in zip(b.parts, dsts):
                pos = 0
                for v in parts:
                    np.copyto(dst[pos:pos + v.numel()], v.numpy())
                    pos += v.numel()
            return time.perf_counter() - t0

    def paired(path, base) -> tuple[float, float]:
        t_path = t_base = 0.0
        for r in range(n):
            if r % 2:
                t_path += path(r)
                t_base += base((r + half) % n)
            else:
                t_base += base((r + half) % n)
                t_path += path(r)
        return sum(sizes) / t_path / 1e9, sum(sizes) / t_base / 1e9
    put_gbps, mput_gbps = paired(put, memcpy_put)
    get_gbps, mget_gbps = paired(get, memcpy_get)
    return {"put": put_gbps, "memcpy_put": mput_gbps, "get": get_gbps, "memcpy_get": mget_gbps,
            "put_cpu_s": put_cpu[0]}


def _run_threads(n: int, fn) -> float:
    """Seconds for ``fn(i)`` to finish on ``n`` threads started together."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def bench_shm(path: str, clients: int, rounds: int, batch: int,
              tensors: list[torch.Tensor], tag: str) -> dict:
    """``{"put", "get", "get_alloc"}`` GB/s of ``clients`` threads doing ``rounds`` batches
    each over the socket at ``path``."""
    ns = Namespace(f"bench-shm-{tag}-{clients}", LAYOUT)
    keys = ns.chunk_keys(list(range(clients * rounds * batch * LAYOUT.chunk_size)))
    c = ShmKVStoreClient(path, timeout_s=120, pool_size=max(clients, 8))
    staged = ShmKVStoreClient(path, timeout_s=120, pool_size=max(clients, 8), vm_put=False)
    outs = [[torch.empty(LAYOUT.shape(), dtype=LAYOUT.torch_dtype) for _ in range(batch)]
            for _ in range(clients)]  # [30, 2, 256, 3, 64] each
    for bufs in outs:
        for b in bufs:
            b.zero_()  # first touch

    def batch_of(ci: int, r: int):
        i = (ci * rounds + r) * batch
        return keys[i:i + batch], [tensors[(i + j) % len(tensors)] for j in range(batch)]

    def put(ci: int, client=c) -> None:
        for r in range(rounds):
            ks, kvs = batch_of(ci, r)
            assert client.put_chunks(ns, ks, kvs) == batch

    def get(ci: int, out: bool = True) -> None:
        for r in range(rounds):
            ks, _ = batch_of(ci, r)
            got = c.get_chunks(ns, ks, outs[ci] if out else None)
            assert all(g is not None for g in got)
    try:
        total = clients * rounds * batch * CHUNK_BYTES
        _run_threads(clients, put)  # warm-up: first touch of the arena's pages
        _run_threads(clients, get)
        c.clear(ns)
        _run_threads(clients, lambda ci: put(ci, staged))  # the staged client's warm-up
        c.clear(ns)
        if clients == 1:  # timed in pairs with the memcpy of the same chunks
            paired = paired_passes(c, ns, [batch_of(0, r) for r in range(rounds)], outs[0])
            t_put, t_get = total / paired["put"] / 1e9, total / paired["get"] / 1e9
            cpu_put = paired["put_cpu_s"]
        else:
            cpu0 = time.process_time()
            t_put = _run_threads(clients, put)
            cpu_put = time.process_time() - cpu0
            t_get = _run_threads(clients, get)
        t_alloc = _run_threads(clients, lambda ci: get(ci, out=False))
        ks, kvs = batch_of(0, 0)  # bit-exact, as a benchmark that moves bytes must check
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(ns, ks), kvs))
        mine = [batch_of(0, r) for r in range(clients * rounds)]  # every chunk, one thread
        same = (paired if clients == 1
                else memcpy_same_chunks(c, ns, mine, outs[0]))
        with ThreadPoolExecutor(1) as pool:
            same_2t = memcpy_same_chunks(c, ns, mine, outs[0], pool)
        c.clear(ns)
        cpu0 = time.process_time()
        t_staged = _run_threads(clients, lambda ci: put(ci, staged))
        cpu_staged = time.process_time() - cpu0
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(ns, ks), kvs))
        path_used = "vm" if c._idle and c._idle[0].hello.vm_read else "staging"
        c.clear(ns)
    finally:
        c.close()
        staged.close()
    n = clients * rounds * batch
    return {"put": total / t_put / 1e9, "get": total / t_get / 1e9,
            "get_alloc": total / t_alloc / 1e9, "put_staged": total / t_staged / 1e9,
            "put_cpu_ms": 1e3 * cpu_put / n, "put_staged_cpu_ms": 1e3 * cpu_staged / n,
            "put_path": path_used, "memcpy_get": same["memcpy_get" if clients == 1 else "get"],
            "memcpy_put": same["memcpy_put" if clients == 1 else "put"],
            "memcpy_get_2t": same_2t["get"], "memcpy_put_2t": same_2t["put"]}


def bench_unix_lookup32(path: str, tensors: list[torch.Tensor], reps: int) -> dict:
    """Median and p99 milliseconds of a 32-chunk lookup over the socket (1 client)."""
    ns = Namespace("bench-shm-lookup", LAYOUT)
    keys = ns.chunk_keys(list(range(32 * LAYOUT.chunk_size)))
    with ShmKVStoreClient(path, timeout_s=60) as c:
        for i in range(0, 32, 8):
            c.put_chunks(ns, keys[i:i + 8], [tensors[j % len(tensors)] for j in range(8)])
        assert c.lookup_keys(ns, keys).num_hit_chunks == 32
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            c.lookup_keys(ns, keys)
            times.append(time.perf_counter() - t0)
        c.clear(ns)
    times.sort()
    return {"unix_lookup32_ms": 1e3 * times[len(times) // 2],
            "unix_lookup32_p99_ms": 1e3 * times[int(len(times) * 0.99)]}


def bench_shm_load(path: str, tensors: list[torch.Tensor], reps: int) -> dict:
    """Median ms of a load of 8 chunks into a paged pool, borrowed vs copied (alternated)."""
    ns = Namespace("bench-shm-load", LAYOUT)
    keys = ns.chunk_keys(list(range(8 * LAYOUT.chunk_size)))
    bs, per = 16, LAYOUT.chunk_size // 16
    pool = torch.zeros(LAYOUT.num_layers, 2, 8 * per, bs, LAYOUT.num_kv_heads,
                       LAYOUT.head_dim, dtype=LAYOUT.torch_dtype)  # [L, 2, blocks, 16, H, D]

    def scatter(i: int, kv: torch.Tensor) -> None:
        ops.scatter_chunk(pool, list(range(i * per, (i + 1) * per)), kv)

    with ShmKVStoreClient(path, timeout_s=60) as c:
        c.put_chunks(ns, keys, [tensors[j % len(tensors)] for j in range(8)])

        def borrowed() -> None:
            with c.get_borrowed(ns, keys) as b:
                for i, parts in enumerate(b.parts):
                    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
                    scatter(i, flat.view(LAYOUT.torch_dtype).view(LAYOUT.shape()))

        def copied() -> None:
            for i, kv in enumerate(c.get_chunks(ns, keys)):
                scatter(i, kv)
        times: dict = {"borrow": [], "copy": []}
        for _ in range(reps):
            for name, fn in (("borrow", borrowed), ("copy", copied)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        got = pool[:, :, :per].reshape(LAYOUT.shape())  # chunk 0's blocks, token order
        assert torch.equal(got, tensors[0])  # bit-exact, as a benchmark that moves bytes must
        c.clear(ns)
    return {f"shm_load8_{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}


def shm_phase(path: str, args, tensors: list[torch.Tensor], out: dict) -> None:
    """Fill ``out`` with the figures of the module docstring: memcpy and shm alternate
    ``args.reps`` times per client count (medians; ratios are medians of per-repetition
    ratios)."""
    runs: dict = {}
    copies = 8 * len(tensors)
    for rep in range(args.reps):
        for clients in (1, 8):
            mc = bench_memcpy_chunks(tensors, copies, args.batch)
            rounds = max(1, args.rounds // clients * 2)
            r = bench_shm(path, clients, rounds, args.batch, tensors, f"r{rep}")
            r["memcpy_cached"] = mc
            runs.setdefault(clients, []).append(r)
            print(f"rep {rep}  {clients} client(s): shm put {r['put']:.2f} ({r['put_path']}; "
                  f"staged {r['put_staged']:.2f}) get {r['get']:.2f} "
                  f"(new tensors {r['get_alloc']:.2f}) GB/s | memcpy of the same chunks: "
                  f"get's {r['memcpy_get']:.2f} (2 threads {r['memcpy_get_2t']:.2f}), put's "
                  f"{r['memcpy_put']:.2f} ({r['memcpy_put_2t']:.2f}); cached {mc:.2f} GB/s")
    for clients in (1, 8):
        sfx = "" if clients == 1 else "_8c"
        rs = runs[clients]
        out[f"shm_put_gbps{sfx}"] = statistics.median(r["put"] for r in rs)
        out[f"shm_get_gbps{sfx}"] = statistics.median(r["get"] for r in rs)
        out[f"shm_get_alloc_gbps{sfx}"] = statistics.median(r["get_alloc"] for r in rs)
        out[f"shm_get_vs_memcpy{sfx}"] = statistics.median(r["get"] / r["memcpy_get"]
                                                           for r in rs)
        out[f"shm_put_vs_memcpy{sfx}"] = statistics.median(r["put"] / r["memcpy_put"]
                                                           for r in rs)
        out[f"shm_get_vs_memcpy_cached{sfx}"] = statistics.median(
            r["get"] / r["memcpy_cached"] for r in rs)
        out[f"shm_put_vs_memcpy_cached{sfx}"] = statistics.median(
            r["put"] / r["memcpy_cached"] for r in rs)
        out[f"shm_put_staged_gbps{sfx}"] = statistics.median(r["put_staged"] for r in rs)
        out[f"shm_put_vs_staged{sfx}"] = statistics.median(r["put"] / r["put_staged"] for r in rs)
    out["shm_put_path"] = runs[1][0]["put_path"]
    out["shm_put_client_cpu_ms"] = statistics.median(r["put_cpu_ms"] for r in runs[1])
    out["shm_put_staged_client_cpu_ms"] = statistics.median(r["put_staged_cpu_ms"]
                                                            for r in runs[1])
    one = runs[1]
    for name, field in (("memcpy_gbps", "memcpy_get"), ("memcpy_put_gbps", "memcpy_put"),
                        ("memcpy_2t_gbps", "memcpy_get_2t"),
                        ("memcpy_put_2t_gbps", "memcpy_put_2t")):
        out[name] = statistics.median(r[field] for r in one)
    out["memcpy_cached_gbps"] = statistics.median(r["memcpy_cached"] for rs in runs.values()
                                                  for r in rs)
    out.update(bench_unix_lookup32(path, tensors, 300 if not args.quick else 100))
    out.update(bench_shm_load(path, tensors, 10 if not args.quick else 3))
    print(f"shm (median of {args.reps}): put {out['shm_put_gbps']:.2f} get "
          f"{out['shm_get_gbps']:.2f} GB/s, 8 clients put {out['shm_put_gbps_8c']:.2f} get "
          f"{out['shm_get_gbps_8c']:.2f} GB/s; memcpy of the same chunks {out['memcpy_gbps']:.2f}"
          f" (get's), {out['memcpy_put_gbps']:.2f} (put's) GB/s: get "
          f"{out['shm_get_vs_memcpy']:.2f}x, put {out['shm_put_vs_memcpy']:.2f}x "
          f"(8 clients {out['shm_get_vs_memcpy_8c']:.2f}x, {out['shm_put_vs_memcpy_8c']:.2f}x); "
          f"cache-resident memcpy {out['memcpy_cached_gbps']:.2f} GB/s: get "
          f"{out['shm_get_vs_memcpy_cached']:.2f}x, put {out['shm_put_vs_memcpy_cached']:.2f}x")
    print(f"put by path {out['shm_put_path']}: {out['shm_put_vs_staged']:.2f}x the staging "
          f"area's {out['shm_put_staged_gbps']:.2f} GB/s; client CPU per chunk "
          f"{out['shm_put_client_cpu_ms']:.2f} ms vs {out['shm_put_staged_client_cpu_ms']:.2f} ms")
    print(f"lookup of a 32-chunk prompt over the unix socket: median "
          f"{out['unix_lookup32_ms']:.3f} ms, p99 {out['unix_lookup32_p99_ms']:.3f} ms")
    print(f"load of 8 chunks into a paged pool: borrowed {out['shm_load8_borrow_ms']:.1f} ms, "
          f"copied first {out['shm_load8_copy_ms']:.1f} ms (medians)")

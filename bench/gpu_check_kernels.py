"""The kernel and copy-bandwidth checks of ``python -m bench.gpu_check``.

* ``kernel_check(device)``: the kernels ``kernels.ops`` uses on ``device`` (Triton on CUDA)
  against ``kernels.reference``: reshape-and-cache, gather/scatter and block copies bit-equal,
  paged decode attention within 1e-4 (float32) or 2e-2 (float16, bfloat16).
* ``chunk_copy_bandwidth(device, quick)``: GB/s of ``ops.gather_chunk`` / ``ops.scatter_chunk``
  on SmolLM2-135M's KV layout next to a plain device-to-device ``dst.copy_(src)`` of the same
  bytes, timed in the same run; ``ratio`` = kernel GB/s / copy GB/s (target >= 0.70).
* ``host_copy_bandwidth(device, quick)``: device -> pinned host and pinned host -> device GB/s
  of the store's own path (a GPU tier spilling chunks into a CPU tier and promoting them back:
  ``MemoryTier.put_from`` on the tier's copy stream) next to a plain ``tensor.copy_`` of the
  same bytes (target >= 0.90).

GB/s counts the payload once (bytes of KV moved, not read + written). Times are medians of
``reps`` runs after a warm-up (CUDA events on CUDA, ``perf_counter`` elsewhere).
"""
from __future__ import annotations

import hashlib
import statistics
import time
from typing import Callable

import torch

from kernels import ops
from kernels import reference as ref

#: SmolLM2-135M-Instruct's KV: 30 layers, 3 KV heads of 64; blocks of 16 tokens, chunks of 256
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, CHUNK_BLOCKS = 30, 3, 64, 16, 16


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up (device synchronized)."""
    fn()
    cuda = device.type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _cache_kernels(device: torch.device, dtype: torch.dtype) -> dict:
    """gather / scatter / copy_blocks through ``kernels.ops`` vs the reference, bit for bit."""
    g = torch.Generator().manual_seed(0)
    nb = 64
    pool = torch.randn(LAYERS, 2, nb, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    pool = pool.to(device)        # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    ids = (torch.randperm(nb - 1, generator=g)[:9] + 1).tolist()
    gather_ok = torch.equal(_bits(ops.gather_chunk(pool, ids)), _bits(ref.gather_chunk(pool, ids)))
    chunk = torch.randn(LAYERS, 2, 9 * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)  # host f32
    want, got = pool.clone(), pool.clone()
    ref.scatter_chunk(want, ids, chunk.to(device))
    ops.scatter_chunk(got, ids, chunk)
    scatter_ok = torch.equal(_bits(got), _bits(want))
    ref.copy_blocks(want, ids[:4], ids[3:7])          # overlapping: block ids[3] read, written
    ops.copy_blocks(got, ids[:4], ids[3:7])
    return {"gather": gather_ok, "scatter": scatter_ok,
            "copy_blocks": torch.equal(_bits(got), _bits(want))}


def _attention_kernels(device: torch.device, dtype: torch.dtype) -> dict:
    """reshape_and_cache (bit-equal) and paged decode (max abs error) vs the reference."""
    g = torch.Generator().manual_seed(1)
    nb, hq, b = 64, 9, 5
    kv = torch.zeros(2, nb, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    kv_ref = kv.clone()
    t = 37
    qkv = torch.randn(t, (hq + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype).to(device)
    key = qkv[:, hq * HEAD_DIM:(hq + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)  # strided
    value = qkv[:, (hq + KV_HEADS) * HEAD_DIM:].view(t, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(nb * BLOCK_SIZE, generator=g)[:t].to(device)
    ops.reshape_and_cache(key, value, kv, slots)
    ref.reshape_and_cache(key, value, kv_ref, slots)
    cache_ok = torch.equal(_bits(kv), _bits(kv_ref))
    kv = torch.randn(2, nb, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype).to(device)
    lens = torch.tensor([1, 16, 17, 46, 112], device=device)
    tables = torch.zeros(b, 7, dtype=torch.long)
    perm = torch.randperm(nb - 1, generator=g)[:b * 7].view(b, 7) + 1
    for i, n in enumerate(lens.tolist()):
        k = -(-n // BLOCK_SIZE)
        tables[i, :k] = perm[i, :k]          # scattered blocks, padded with the null block 0
    tables = tables.to(device)
    q = torch.randn(b, hq, HEAD_DIM, generator=g).to(dtype).to(device)
    got = ops.paged_attention_decode(q, kv, tables, lens, HEAD_DIM ** -0.5)
    want = ref.paged_attention_decode(q, kv, tables, lens, HEAD_DIM ** -0.5)
    err = (got.float() - want.float()).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return {"reshape_and_cache": cache_ok, "decode_max_abs_err": err, "decode_tol": tol,
            "decode": err <= tol}


def kernel_check(device: str | torch.device) -> dict:
    """Every kernel ``kernels.ops`` dispatches on ``device`` vs the reference, for float16,
    bfloat16 and float32 (see module docstring). ``impl`` names what ran."""
    device = torch.device(device)
    impl = "triton" if ops.HAS_TRITON and device.type == "cuda" else "reference"
    res: dict = {"impl": impl}
    ok = True
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        r = {**_cache_kernels(device, dtype), **_attention_kernels(device, dtype)}
        ok &= all(v for v in r.values() if isinstance(v, bool))
        res[str(dtype).removeprefix("torch.")] = r
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"ok": bool(ok), **res}


def chunk_copy_bandwidth(device: str | torch.device, quick: bool = False, reps: int = 20) -> dict:
    """Gather/scatter GB/s vs plain device copies of the same bytes (see module docstring).

    Two sizes: ``bulk`` (a quarter of an 8,192-block pool, 2,048 blocks in random order, in
    one call; the kernels' own bandwidth, where the target applies) and ``chunk`` (one
    256-token chunk per call, as the connector gathers and scatters; launch and id checks
    included). ``quick``: a 64-block pool (a CPU run that checks the code, not a figure).
    """
    device = torch.device(device)
    nb = 64 if quick else 8192
    g = torch.Generator().manual_seed(2)
    pool = torch.empty(LAYERS, 2, nb, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.float16,
                       device=device).normal_()  # [layers, 2, num_blocks, block_size, heads, dim]
    res: dict = {"impl": "triton" if ops.HAS_TRITON and device.type == "cuda" else "reference",
                 "dtype": "float16", "pool_bytes": pool.numel() * 2}
    for name, k in (("bulk", nb // 4), ("chunk", CHUNK_BLOCKS)):
        ids = (torch.randperm(nb - 1, generator=g)[:k] + 1).tolist()
        chunk = ops.gather_chunk(pool, ids)              # [layers, 2, k * block_size, heads, dim]
        nbytes = chunk.numel() * chunk.element_size()
        src, dst = torch.empty_like(chunk).normal_(), torch.empty_like(chunk)
        t_copy = timed(lambda: dst.copy_(src), device, reps)
        t_gather = timed(lambda: ops.gather_chunk(pool, ids), device, reps)
        t_scatter = timed(lambda: ops.scatter_chunk(pool, ids, chunk), device, reps)
        copy = nbytes / t_copy / 1e9
        res[name] = {"blocks": k, "bytes": nbytes, "copy_GBps": copy,
                     "gather_GBps": nbytes / t_gather / 1e9,
                     "scatter_GBps": nbytes / t_scatter / 1e9,
                     "gather_ratio": t_copy / t_gather, "scatter_ratio": t_copy / t_scatter}
        del src, dst, chunk
    res["ratio"] = min(res["bulk"]["gather_ratio"], res["bulk"]["scatter_ratio"])
    return {"ok": True, **res}


def _store_tiers(device: torch.device, nbytes: int, page_bytes: int):
    """A GPU tier on ``device`` over a CPU tier (pinned under CUDA), each of ``nbytes``."""
    from kvstore.tiers.cpu import CpuTier
    from kvstore.tiers.gpu import GpuTier
    return GpuTier(nbytes, page_bytes, device), CpuTier(nbytes, page_bytes)


def host_copy_bandwidth(device: str | torch.device, quick: bool = False, reps: int = 5) -> dict:
    """Device <-> pinned host GB/s of the store's path vs plain copies (module docstring).

    ``num_chunks`` chunks of 256 tokens (5.9 MB each at float16) are put into a GPU tier, then
    spilled to the CPU tier (``cpu.put_from(key, gpu)``, all issued, then waited for) and loaded
    back (``gpu.put_from(key, cpu)``); the baseline copies one tensor of the same bytes between
    the device and a pinned host buffer with ``tensor.copy_``. ``path`` says which ran: the
    tiers' copy stream, or plain copies only when the tiers have no ``put_from`` (older store).
    """
    from kvstore.keys import ChunkKey
    device = torch.device(device)
    num_chunks, page_bytes = (4 if quick else 32), 4096
    shape = (LAYERS, 2, CHUNK_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM)   # one chunk
    chunks = [torch.empty(shape, dtype=torch.float16, device=device).normal_()
              for _ in range(num_chunks)]
    chunk_bytes = chunks[0].numel() * 2
    nbytes = num_chunks * chunk_bytes
    pin = device.type == "cuda"
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    t_d2h = timed(lambda: host_buf.copy_(dev_buf), device, reps)
    t_h2d = timed(lambda: dev_buf.copy_(host_buf), device, reps)
    res: dict = {"pinned": pin, "num_chunks": num_chunks, "bytes": nbytes,
                 "plain_d2h_GBps": nbytes / t_d2h / 1e9, "plain_h2d_GBps": nbytes / t_h2d / 1e9}
    gpu, cpu = _store_tiers(device, nbytes + num_chunks * page_bytes, page_bytes)
    try:
        if not hasattr(cpu, "put_from"):
            res.update(path="plain tensor.copy_ only (these tiers have no pool-to-pool copy)",
                       ok=True)
            return res
        keys = [ChunkKey(b"gpu-check-ns!!!!", hashlib.sha256(bytes([i])).digest())
                for i in range(num_chunks)]
        for k, c in zip(keys, chunks):
            gpu.put(k, c, None)
        ok = True

        def move(dst, src) -> None:
            handles = [dst.put_from(k, src, None) for k in keys]
            for h in handles:
                h.wait()

        def spill() -> None:
            move(cpu, gpu)
            for k in keys:
                cpu.delete(k)

        def load() -> None:
            move(gpu, cpu)

        t_spill = timed(spill, device, reps)
        move(cpu, gpu)                                   # the CPU tier holds them now
        for k, c in zip(keys, chunks):
            ok &= torch.equal(cpu.read(k, "cpu").view(torch.int16), c.cpu().view(torch.int16))
            gpu.delete(k)

        def load_and_free() -> None:
            load()
            for k in keys:
                gpu.delete(k)

        t_load = timed(load_and_free, device, reps)
        load()
        for k, c in zip(keys, chunks):
            ok &= torch.equal(gpu.read(k, device).view(torch.int16), c.view(torch.int16))
        res.update(path=f"store tiers, put_from on {type(gpu.copy_stream).__name__}",
                   store_d2h_GBps=nbytes / t_spill / 1e9, store_h2d_GBps=nbytes / t_load / 1e9,
                   d2h_ratio=t_d2h / t_spill, h2d_ratio=t_h2d / t_load, bit_exact=bool(ok))
        res["ratio"] = min(res["d2h_ratio"], res["h2d_ratio"])
        res["ok"] = bool(ok)
        return res
    finally:
        gpu.close()
        cpu.close()

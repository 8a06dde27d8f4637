"""Spill ordering check: chunks spilled from the GPU tier to the CPU tier, and promoted back,
read back bit-exact right after each move, while the copies run on the GPU tier's stream.

``spill_roundtrip_check(device, n)`` is the same code on every device: on CUDA the copies run
on a side stream (``kvstore.tiers.copy_stream.CudaCopyStream``) while new KV is written on the
current stream and freed pages are reused at once; on CPU they run inline, or, with a
``ManualCopyStream``, complete only when the check says (a random number per step), so many
spills and promotes are in flight while pages are deleted, reused and read.
"""
from __future__ import annotations

import hashlib
import random
import time

import torch

from kvstore.keys import ChunkKey
from kvstore.metrics import StoreMetrics
from kvstore.movement import TierMover
from kvstore.tiers.copy_stream import CopyStream, ManualCopyStream
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.gpu import GpuTier

_NS_ID = b"spill-check-ns!!"  # 16 bytes


def _key(i: int) -> ChunkKey:
    return ChunkKey(_NS_ID, hashlib.sha256(i.to_bytes(8, "little")).digest())


def spill_roundtrip_check(device: str | torch.device = "cpu", n: int = 1000, *,
                          stream: CopyStream | None = None, seed: int = 0,
                          page_bytes: int = 4096, max_chunk_bytes: int = 64 << 10,
                          gpu_bytes: int = 1 << 20, cpu_bytes: int = 4 << 20) -> dict:
    """Put ``n`` chunks of random sizes (1 .. ``max_chunk_bytes``, fp16, written on
    ``device`` just before the put) into a GPU tier of ``gpu_bytes`` over a CPU tier of
    ``cpu_bytes``; each put spills older chunks (one put in five spills its own chunk at
    once, while the copy that wrote it may still run), and every chunk spilled is read back
    from the CPU tier at once and compared with what was put. One step in five also promotes a
    random CPU-only chunk back and reads it from the GPU tier at once. Both tiers'
    ``check_integrity`` runs after every step.

    Args:
        device: the GPU tier's device (``"cuda"``, ``"cpu"``).
        stream: the GPU tier's copy stream (None: ``make_copy_stream(device)``); a
            ``ManualCopyStream`` has 0-3 batches completed per step.

    Returns:
        ``{"ok", "mismatches", "checked", "spills", "promotes", "seconds", "device"}``: ``ok``
        when no read differed and at least one spill and one promote were checked.

    Raises:
        RuntimeError: a CUDA device without CUDA.
    """
    rng = random.Random(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gpu = GpuTier(gpu_bytes, page_bytes, device)
    cpu = CpuTier(cpu_bytes, page_bytes)
    if stream is not None:
        gpu.copy_stream = stream
    mover = TierMover([gpu, cpu], StoreMetrics(), evictable=lambda k: True)
    ref: dict[ChunkKey, torch.Tensor] = {}  # key -> the chunk as put, on the host
    counts = {"mismatches": 0, "checked": 0, "spills": 0, "promotes": 0}

    def check(tier, key) -> None:
        got = tier.read(key, "cpu")
        counts["checked"] += 1
        if got is None or not torch.equal(got.view(torch.int16), ref[key].view(torch.int16)):
            counts["mismatches"] += 1

    t0 = time.perf_counter()
    try:
        for i in range(n):
            numel = rng.randint(1, max_chunk_bytes // 2)
            host = torch.randn(numel, generator=gen).to(torch.float16)  # [numel]
            kv = host.to(device) * 1  # written by a kernel on the current stream
            key = _key(i)
            in_cpu = set(cpu.keys())
            ref[key] = host
            mover.insert(0, key, kv, None, owned=True)
            if rng.random() < 0.2 and gpu.contains(key):
                mover.evict(0, key)  # spilled right after the kernels that wrote it
            for k in set(cpu.keys()) - in_cpu:  # spilled by this put: read back at once
                counts["spills"] += 1
                check(cpu, k)
            if rng.random() < 0.2:
                cands = [k for k in cpu.keys() if not gpu.contains(k)]
                if cands:
                    k = rng.choice(cands)
                    mover.promote([(k, cpu)], [ref[k]], set())
                    if gpu.contains(k):
                        counts["promotes"] += 1
                        check(gpu, k)
            if isinstance(stream, ManualCopyStream):
                stream.complete(rng.randint(0, 3))
            for k in [k for k in ref if not gpu.contains(k) and not cpu.contains(k)]:
                del ref[k]
            gpu.check_integrity()
            cpu.check_integrity()
    finally:
        gpu.close()
        cpu.close()
    ok = counts["mismatches"] == 0 and counts["spills"] > 0 and counts["promotes"] > 0
    return {"ok": ok, **counts, "seconds": time.perf_counter() - t0, "device": str(device)}

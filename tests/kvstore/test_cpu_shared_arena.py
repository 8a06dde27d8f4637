"""The shared CPU arena (``CpuTier(shared=True)``, ``StoreConfig.cpu_shared``): a sealed memfd
this process writes and others may only read; borrowed chunks say where they lie in it.

Tiny layout: 2 layers, 1 KV head, head_dim 8, fp16, chunk_size 4 -> 256-byte chunks in
256-byte pages (one page per chunk).
"""
import errno
import fcntl
import mmap
import os

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from kvstore.tiers.cpu import ARENA_SEALS, CpuTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
NS = Namespace("tiny-model", LAYOUT)
KEYS = NS.chunk_keys(list(range(4 * 4)))  # 4 chained chunk keys


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16)  # [2, 2, 4, 1, 8]


def test_shared_tier_is_a_sealed_memfd_writable_only_by_its_mapping():
    tier = CpuTier(8 * 256, 256, shared=True)
    fd = tier.shared_fd
    assert fd is not None and os.fstat(fd).st_size == 8 * 256
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == ARENA_SEALS
    kv = chunk(1)
    tier.put(KEYS[0], kv, None)
    off, n = tier.entry_runs(KEYS[0])[0]
    # another mapping of the same memory sees the bytes the tier wrote
    ro = mmap.mmap(fd, 8 * 256, prot=mmap.PROT_READ)
    assert ro[off:off + n] == kv.view(torch.uint8).numpy().tobytes()
    with pytest.raises(PermissionError):
        mmap.mmap(fd, 8 * 256)  # a new writable shared mapping: refused by the seal
    with pytest.raises(PermissionError):
        os.write(fd, b"x")
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 16 * 256)
    ro.close()
    tier.check_integrity()
    tier.close()
    assert tier.shared_fd is None
    with pytest.raises(OSError) as e:
        os.fstat(fd)
    assert e.value.errno == errno.EBADF


def test_private_tier_has_no_fd():
    tier = CpuTier(4 * 256, 256)
    assert tier.shared_fd is None
    tier.close()


def test_cpu_shared_needs_a_cpu_tier_and_a_bool():
    with pytest.raises(ValueError, match="cpu_shared"):
        StoreConfig(cpu_bytes=0, disk_bytes=1 << 20, disk_path="/tmp/x", cpu_shared=True)
    with pytest.raises(ValueError, match="cpu_shared"):
        StoreConfig(cpu_shared="yes")


def test_store_shared_arena_and_borrowed_runs():
    store = ChunkStore(StoreConfig(cpu_bytes=8 * 256, page_bytes=256, cpu_shared=True))
    fd, nbytes, page_bytes = store.shared_arena()
    assert (nbytes, page_bytes) == (8 * 256, 256) and fd == store.tiers[0].shared_fd
    kvs = [chunk(i) for i in range(3)]
    assert store.put_chunks(NS, KEYS[:3], kvs) == 3
    ro = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    with store.borrow_chunks(NS, KEYS) as b:
        assert b.runs[3] is None and b.parts[3] is None  # a miss
        for i in range(3):
            assert b.runs[i] == store.tiers[0].entry_runs(KEYS[i])
            got = b"".join(ro[o:o + n] for o, n in b.runs[i])
            assert got == kvs[i].view(torch.uint8).numpy().tobytes()
            # the views handed out are the same bytes of the pool
            assert [v.data_ptr() - store.tiers[0].pool.data_ptr() for v in b.parts[i]] == \
                [o for o, _ in b.runs[i]]
    ro.close()
    store.check_integrity()
    store.close()
    assert store.tiers[0].shared_fd is None


def test_private_store_and_cpu_gpu_tier_hits_have_no_runs():
    """Without a shared arena (or for a hit in another host-memory tier) a borrowed chunk has
    views but no runs: its bytes must travel inline."""
    store = ChunkStore(StoreConfig(cpu_bytes=8 * 256, page_bytes=256))
    assert store.shared_arena() is None
    store.put_chunks(NS, KEYS[:1], [chunk(0)])
    with store.borrow_chunks(NS, KEYS[:1]) as b:
        assert b.runs == [None] and b.parts[0] is not None
    store.close()
    store = ChunkStore(StoreConfig(gpu_bytes=8 * 256, device="cpu", cpu_bytes=8 * 256,
                                   page_bytes=256, cpu_shared=True))
    store.put_chunks(NS, KEYS[:1], [chunk(0)])  # lands in the (CPU-backed) GPU tier
    with store.borrow_chunks(NS, KEYS[:1]) as b:
        assert b.plan[0][1].name == "gpu" and b.runs == [None] and b.parts[0] is not None
    store.close()

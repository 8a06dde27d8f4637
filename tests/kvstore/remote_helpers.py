"""Shared pieces of the remote-tier tests (``test_remote_*``): a tiny layout, deterministic
chunks, stores and tiers pointed at a real Redis (``tests.redis_fixtures``), and readers of
the metrics and of what Redis holds.

Layout: 2 layers, 2 KV heads, head_dim 8, fp16, chunk_size 4 -> 512 bytes per chunk; the CPU
tier uses 512-byte pages, so one chunk is one page.
"""
from __future__ import annotations

import functools

import torch

from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from kvstore.tiers.remote import RemoteTier
from tests.kvstore.daemon.shm_helpers import wait_until

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_size=4)
CB = LAY.chunk_bytes  # 512
NS = Namespace("remote-test-model", LAY)
PREFIX = "kvstore"


def chunk(seed: int) -> torch.Tensor:
    """A distinct chunk per seed: [2, 2, 4, 2, 8] fp16 (num_layers, k/v, chunk_size, heads,
    head_dim)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAY.shape(), generator=g).to(torch.float16)


def tokens(i: int, n_chunks: int) -> list[int]:
    """Token ids of prompt ``i``: ``n_chunks`` full chunks, distinct across prompts."""
    return [100_000 * (i + 1) + j for j in range(LAY.chunk_size * n_chunks)]


def prompt(ns: Namespace, i: int, n_chunks: int) -> tuple[list[ChunkKey], list[torch.Tensor]]:
    """Keys and chunks of prompt ``i`` of ``ns`` (chunks seeded by prompt and position)."""
    return ns.chunk_keys(tokens(i, n_chunks)), [chunk(1000 * i + j) for j in range(n_chunks)]


def make_store(url: str, ns: Namespace = NS, cpu_chunks: int = 64, **remote) -> ChunkStore:
    """A ChunkStore with its own CPU tier (``cpu_chunks`` chunks) over the Redis at ``url``;
    ``remote`` are more StoreConfig fields (``remote_key_prefix=...``)."""
    cfg = StoreConfig(cpu_bytes=cpu_chunks * CB, page_bytes=CB, remote_url=url, **remote)
    return ChunkStore(cfg, [ns])


def make_tier(url: str, **kw) -> RemoteTier:
    """A RemoteTier on its own (short breaker pause by default)."""
    kw.setdefault("breaker_reset_s", 0.3)
    return RemoteTier(url, **kw)


def rkey(key: ChunkKey, prefix: str = PREFIX) -> bytes:
    """The Redis key of ``key``: ``<prefix>:<ns hex>:<hash hex>``."""
    return f"{prefix}:{key.ns_id.hex()}:{key.prefix_hash.hex()}".encode()


def count(tier: RemoteTier, name: str, label: str | None = None) -> int:
    return tier.metrics.count(name, label)


def sample(store: ChunkStore, name: str, labels: dict | None = None) -> float | None:
    """A sample of the store's registry (None when it was never set)."""
    return store.metrics.registry.get_sample_value(name, labels or {})


def value_bytes(client, keys) -> int:
    """Sum of ``STRLEN`` of the Redis keys of ``keys``."""
    return sum(client.strlen(rkey(k)) for k in keys)


def expect_value_size(n_chunks: int) -> tuple[int, int]:
    """Bounds of the bytes ``n_chunks`` raw values take (payload + header of each)."""
    return n_chunks * CB, n_chunks * (CB + HEADER_BYTES_MAX)


def same(got, want) -> bool:
    """Every got tensor equals its wanted one, bit for bit (None where None is wanted)."""
    return len(got) == len(want) and all(
        (g is None and w is None) or (g is not None and w is not None and torch.equal(g, w))
        for g, w in zip(got, want))


#: ``shm_helpers.wait_until`` with the remote tests' 10 s default (a Redis node restarting,
#: a cluster rejoining)
wait_for = functools.partial(wait_until, timeout=10.0)

"""Shared pieces of the ChunkStore scenario tests (``test_store_capacity_pins``,
``test_store_tiers``, ``test_store_io``).

Tiny layout: 2 layers, 1 KV head, head_dim 4, fp16, chunk_size 4 -> 128 bytes per chunk; memory
tiers use 128-byte pages so one chunk = one page and byte figures are exact multiples of 128.
"""

import torch

from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore


LAY = KVLayout(2, 1, 4, "float16", 4)
CB = LAY.chunk_bytes  # 128
NS = Namespace("tiny", LAY)


def kv_for(tokens):
    """Deterministic KV for a token list: [2, 2, len(tokens), 1, 4] fp16."""
    t = torch.tensor(tokens, dtype=torch.float16).view(1, 1, -1, 1, 1)
    return (t + torch.arange(4, dtype=torch.float16).view(1, 1, 1, 1, 4)
            + 1000 * torch.arange(2, dtype=torch.float16).view(2, 1, 1, 1, 1)
            + 500 * torch.arange(2, dtype=torch.float16).view(1, 2, 1, 1, 1))


def make(tmp_path=None, cpu=10, gpu=0, disk=0, **kw):
    cfg = StoreConfig(gpu_bytes=gpu * CB, cpu_bytes=cpu * CB, disk_bytes=disk,
                      disk_path=str(tmp_path / "db") if disk else None, page_bytes=CB, **kw)
    return ChunkStore(cfg, [NS])


def prompt(i, n_chunks=1):
    """Token ids of prompt i: n_chunks distinct chunks."""
    return [10_000 * (i + 1) + j for j in range(4 * n_chunks)]


def put(store, toks):
    return PrefixStore(store, NS).put(toks, kv_for(toks))


def gauge(store, name, tier):
    return store.metrics.registry.get_sample_value(name, {"tier": tier})

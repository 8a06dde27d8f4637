"""10,000 put/evict cycles leave process RSS flat (no per-chunk leak in tiers, policies, pins)."""
import psutil

from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
import torch

LAY = KVLayout(1, 1, 4, "float16", 4)  # 64-byte chunks
NS = Namespace("rss", LAY)


def test_10000_put_evict_cycles_rss_growth_under_5_percent():
    store = ChunkStore(StoreConfig(cpu_bytes=16 * 64, page_bytes=64), [NS])
    ps = PrefixStore(store, NS)
    kv = torch.ones(LAY.shape(8), dtype=torch.float16)  # 2 chunks per put

    def cycles(start, n):
        for i in range(start, start + n):
            ps.put([i, i + 1, i + 2, i + 3, 7, 7, 7, 7], kv)
            ps.get([i, i + 1, i + 2, i + 3], 4)

    cycles(0, 1000)  # warm-up: allocator caches, metric children, interned objects
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    cycles(1000, 10_000)
    rss1 = proc.memory_info().rss
    st = store.stats()
    assert st["stored_chunks"] == 22_000 and st["evictions"] == 22_000 - 16
    assert st["tiers"]["cpu"]["num_chunks"] == 16
    store.check_integrity()
    assert (rss1 - rss0) / rss0 < 0.05, f"RSS grew {rss0} -> {rss1}"

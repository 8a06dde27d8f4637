"""One long prompt through small tiers: the exact outcome of a 4,096-chunk chain put into a
256-chunk CPU tier (alone, and over a disk tier that takes every chunk), through both put
paths a daemon uses: ``put_chunks`` in requests of 64 chunks, and ``reserve_chunks`` one
chunk at a time with ``commit_chunks`` per request of 64. Chunks are 128 bytes (``LAY``).

Placement cost no longer depends on the chain's length (``bench/prefix_eviction.py --long``
prints it); these tests pin down what is stored, not how fast.
"""
import pytest
import torch

from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.direct import Reservation
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAY = KVLayout(1, 1, 4, "float32", 4)  # [1, 2, 4, 1, 4] float32 = 128 bytes per chunk
NS = Namespace("long-chain", LAY)
CHUNK = 128
N, CPU, BATCH = 4096, 256, 64
KEYS = NS.chunk_keys(list(range(4 * N)))


def kv_of(i: int) -> torch.Tensor:
    return torch.full(LAY.shape(), float(i))  # [1, 2, 4, 1, 4], chunk i filled with i


def put_chain(store: ChunkStore, path: str) -> None:
    """The chain in requests of ``BATCH`` chunks, each naming the previous chunk as parent."""
    for lo in range(0, N, BATCH):
        keys = KEYS[lo:lo + BATCH]
        parents = [KEYS[i - 1] if i else None for i in range(lo, lo + len(keys))]
        kvs = [kv_of(i) for i in range(lo, lo + len(keys))]
        if path == "put":
            store.put_chunks(NS, keys, kvs, parents)
            continue
        items = []
        for k, p, kv in zip(keys, parents, kvs):
            (it,) = store.reserve_chunks(NS, [k], [p])
            if isinstance(it, Reservation):
                it.views[0].copy_(kv.reshape(-1).view(torch.uint8))
                items.append(it)
            else:  # no room in the CPU tier: the tensor goes to a lower tier, if any
                items.append(kv)
        store.commit_chunks(NS, keys, items, parents)


def bits(store: ChunkStore, keys) -> str:
    return "".join("1" if e else "0" for e in store.exists(NS, keys))


@pytest.mark.parametrize("path", ["put", "reserve"])
def test_a_4096_chunk_chain_into_a_256_chunk_cpu_tier_keeps_its_256_head_chunks(path):
    store = ChunkStore(StoreConfig(cpu_bytes=CPU * CHUNK, page_bytes=CHUNK), [NS])
    put_chain(store, path)
    assert bits(store, KEYS) == "1" * CPU + "0" * (N - CPU)
    assert store.lookup_keys(NS, KEYS).num_hit_chunks == CPU
    st = store.stats()
    assert st["stored_chunks"] == CPU
    assert st["rejected_chunks"] == N - CPU  # 3840: no room without evicting the chain's head
    assert st.get("evictions", 0) == 0
    assert st["unreachable_bytes"] == 0
    got = store.get_chunks(NS, KEYS[CPU - 2:CPU])
    assert [float(g.flatten()[0]) for g in got] == [CPU - 2, CPU - 1]
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("path", ["put", "reserve"])
def test_a_4096_chunk_chain_through_a_256_chunk_cpu_tier_over_disk_keeps_every_chunk(path, tmp_path):
    store = ChunkStore(StoreConfig(cpu_bytes=CPU * CHUNK, page_bytes=CHUNK,
                                   disk_bytes=N * (CHUNK + HEADER_BYTES_MAX),
                                   disk_path=str(tmp_path)), [NS])
    put_chain(store, path)
    store.flush()
    assert store.lookup_keys(NS, KEYS).num_hit_chunks == N
    # the CPU tier keeps the newest 256 chunks; each older one was spilled to disk once
    assert set(store.tiers[0].keys()) == set(KEYS[N - CPU:])
    assert set(store.tiers[1].keys()) == set(KEYS[:N - CPU])
    st = store.stats()
    assert (st["stored_chunks"], st["rejected_chunks"]) == (N, 0)
    assert st["spills_by_tier"] == {"cpu": N - CPU}
    assert st["evictions_by_tier"] == {"cpu": N - CPU}
    got = store.get_chunks(NS, [KEYS[0], KEYS[N - CPU - 1], KEYS[N - 1]])
    assert [float(g.flatten()[0]) for g in got] == [0, N - CPU - 1, N - 1]
    assert st["unreachable_bytes"] == 0
    store.check_integrity()
    store.close()

"""A put of a tensor without data (``device="meta"``) is refused with a ValueError naming the
device, before anything is stored, on every put path (``PrefixStore.put``,
``ChunkStore.put_chunks``, the daemon client's checks); and ``PutResult.stored`` reads what its
repr prints."""
from __future__ import annotations

import pytest
import torch

from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.daemon.call_checks import check_put
from kvstore.daemon.put_result import PutResult
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

# SmolLM2-135M's fp16 KV, as a user hands it over: 30 layers, 3 KV heads of 64
LAY = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16", chunk_size=256)
NS = Namespace("m", LAY)


@pytest.fixture
def store():
    s = ChunkStore(StoreConfig(cpu_bytes=64 << 20))
    yield s
    s.close()


def test_prefix_put_of_a_meta_tensor_names_the_device(store):
    prefix = PrefixStore(store, NS)
    tokens = list(range(600))
    with pytest.raises(ValueError, match="device meta"):
        prefix.put(tokens, torch.empty(30, 2, 600, 3, 64, dtype=torch.float16, device="meta"))
    assert store.stored_keys() == set()
    # the same tensor with data is stored (2 full chunks of 256 of the 600 tokens)
    assert prefix.put(tokens, torch.zeros(30, 2, 600, 3, 64, dtype=torch.float16)) == 2


def test_put_chunks_of_a_meta_tensor_stores_nothing(store):
    keys = NS.chunk_keys(list(range(512)))
    good = torch.zeros(LAY.shape(), dtype=torch.float16)
    meta = torch.empty(LAY.shape(), dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="device meta"):
        store.put_chunks(NS, keys, [good, meta])
    assert store.stored_keys() == set()   # the chunk before the bad one is not stored either
    with pytest.raises(ValueError, match="device meta"):
        check_put(NS, keys[:1], [meta], None)   # the daemon client checks before sending


def test_put_result_stored_is_the_count_its_repr_prints():
    r = PutResult(3, num_chunks=4, already_stored=0, refused=1,
                  first_refused={"index": 3, "key": "00", "reason": "no_room"})
    assert r.stored == int(r) == 3 and type(r.stored) is int
    assert repr(r).startswith("PutResult(stored=3, num_chunks=4,")
    with pytest.raises(AttributeError):
        r.stored = 5                       # read-only: the count is the value itself
    assert r.shifted(2).stored == 3
    assert PutResult.combine([PutResult(1, 1, 0, 0), PutResult(2, 2, 0, 0)]).stored == 3

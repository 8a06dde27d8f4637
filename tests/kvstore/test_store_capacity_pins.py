"""ChunkStore scenarios, with exact values: chained keys and namespaces, shape checks, capacity and
eviction gauges, reader pins and leases.

Tiny layout of ``store_helpers``: 128-byte chunks, one page each.
"""
import time

import pytest
import torch

from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

from tests.kvstore.store_helpers import CB, LAY, NS, gauge, kv_for, make, prompt, put


def test_chained_keys_hit_only_the_first_chunk():
    s = make()
    ps = PrefixStore(s, NS)
    assert ps.put([1, 2, 3, 4], kv_for([1, 2, 3, 4])) == 1
    r = ps.lookup([1, 2, 3, 4, 1, 2, 3, 4])
    assert (r.num_hit_tokens, r.num_hit_chunks, r.num_requested_chunks, r.tiers) == (4, 1, 2, ("cpu",))
    assert torch.equal(ps.get([1, 2, 3, 4, 1, 2, 3, 4], 4), kv_for([1, 2, 3, 4]))
    assert ps.get([1, 2, 3, 4, 1, 2, 3, 4], 8) is None
    st = s.stats()
    assert (st["lookups"], st["requested_tokens"], st["hit_tokens"]) == (1, 8, 4)
    assert (st["hits"], st["misses"]) == (2, 1)  # get of 4 tokens: 1 hit; get of 8: 1 hit + 1 miss


@pytest.mark.parametrize("other", [
    Namespace("other-model", LAY), Namespace("tiny", LAY, revision="v2"),
    Namespace("tiny", KVLayout(2, 1, 4, "bfloat16", 4)), Namespace("tiny", KVLayout(2, 1, 8, "float16", 4)),
    Namespace("tiny", LAY, cache_salt="tenant-b")])
def test_other_namespace_gets_zero_hits(other):
    s = make()
    toks = prompt(0, 3)
    put(s, toks)
    assert PrefixStore(s, other).lookup(toks).num_hit_tokens == 0
    assert PrefixStore(s, NS).lookup(toks).num_hit_tokens == 12
    with pytest.raises(ValueError, match="belongs to namespace"):
        s.lookup_keys(other, NS.chunk_keys(toks))


def test_wrong_shape_or_dtype_names_expected_and_got_and_stores_nothing():
    s = make()
    keys = NS.chunk_keys(prompt(0, 2))
    good = kv_for(prompt(0, 1))
    with pytest.raises(ValueError, match=r"expected \[2, 2, 4, 1, 4\], got \[2, 2, 4, 1, 8\]"):
        s.put_chunks(NS, keys, [good, torch.zeros(2, 2, 4, 1, 8, dtype=torch.float16)])
    with pytest.raises(ValueError, match="expected torch.float16, got torch.float32"):
        s.put_chunks(NS, keys, [good, good.float()])
    with pytest.raises(ValueError, match="2 keys but 1 tensors"):
        s.put_chunks(NS, keys, [good])
    assert s.stats()["tiers"]["cpu"]["num_chunks"] == 0
    s.check_integrity()


def test_capacity_smaller_than_one_chunk_fails_at_configuration(tmp_path):
    big = Namespace("big", KVLayout(30, 3, 64, "float16", 256))  # 5898240-byte chunks
    with pytest.raises(ValueError, match=r"cpu tier capacity 4194304 bytes \(4MiB\) is smaller than one "
                                         r"chunk \(5898240 bytes"):
        ChunkStore(StoreConfig(cpu_bytes="4MiB"), [big])
    with pytest.raises(ValueError, match="disk tier capacity 1000 bytes"):
        ChunkStore(StoreConfig(cpu_bytes="8MiB", disk_bytes=1000, disk_path=str(tmp_path / "d")), [big])
    with pytest.raises(ValueError, match="cpu_bytes=100 is smaller than one page"):
        StoreConfig(cpu_bytes=100, page_bytes=128)
    s = ChunkStore(StoreConfig(cpu_bytes="4MiB"))
    with pytest.raises(ValueError, match="smaller than one chunk"):  # checked on first use too
        s.lookup_keys(big, big.chunk_keys(list(range(256))))


def test_capacity_exact_eviction_and_gauges():
    s = make(cpu=10)
    for i in range(9):
        put(s, prompt(i))
    assert s.stats()["evictions"] == 0
    put(s, prompt(9))
    put(s, prompt(10))  # 11th chunk into a 10-chunk tier
    st = s.stats()
    assert st["evictions"] == 1 and st["tiers"]["cpu"]["num_chunks"] == 10
    assert not s.exists(NS, NS.chunk_keys(prompt(0)))[0]  # LRU: the oldest went
    assert gauge(s, "kvstore_used_bytes", "cpu") == 10 * CB == gauge(s, "kvstore_capacity_bytes", "cpu")
    removed = sum(PrefixStore(s, NS).remove(prompt(i)) for i in (1, 2, 3, 4))
    assert removed == 4
    assert gauge(s, "kvstore_used_bytes", "cpu") == 6 * CB and gauge(s, "kvstore_chunks", "cpu") == 6
    for i in range(11, 15):
        assert put(s, prompt(i)) == 1
    st = s.stats()
    assert st["evictions"] == 1 and st["tiers"]["cpu"]["used_bytes"] == 10 * CB
    assert gauge(s, "kvstore_used_bytes", "cpu") == 10 * CB and gauge(s, "kvstore_chunks", "cpu") == 10
    assert s.metrics.registry.get_sample_value("kvstore_evictions_total", {"tier": "cpu"}) == 1
    assert s.metrics.registry.get_sample_value("kvstore_stored_chunks_total") == 15
    s.check_integrity()


def test_used_bytes_never_exceed_capacity():
    s = make(cpu=5, gpu=3)
    for i in range(40):
        put(s, prompt(i, 1 + i % 3))
        for t in s.stats()["tiers"].values():
            assert t["used_bytes"] <= t["capacity_bytes"]
        s.check_integrity()


def test_chunk_pinned_by_two_readers_survives_first_unpin():
    s = make(cpu=2)
    a = NS.chunk_keys(prompt(0))
    put(s, prompt(0))
    assert s.pin(NS, a) == 1 and s.pin(NS, a) == 1 and s.pin_count(a[0]) == 2
    assert s.unpin(NS, a) == 1 and s.pin_count(a[0]) == 1
    for i in range(1, 6):  # churn: prompt 0 is the LRU head every time
        put(s, prompt(i))
    assert s.exists(NS, a) == [True]
    assert torch.equal(s.get_chunks(NS, a)[0], kv_for(prompt(0)))
    assert s.unpin(NS, a) == 1 and s.unpin(NS, a) == 0 and s.pin_count(a[0]) == 0
    put(s, prompt(6))
    put(s, prompt(7))
    assert s.exists(NS, a) == [False]
    s.check_integrity()


def test_remove_while_pinned_frees_at_last_unpin_and_lease_expires():
    s = make(cpu=4)
    a = NS.chunk_keys(prompt(0))
    put(s, prompt(0))
    s.pin(NS, a)
    assert s.remove(NS, a) == 1
    assert s.exists(NS, a) == [False] and s.stats()["tiers"]["cpu"]["num_chunks"] == 1
    assert s.stats()["num_removed_pinned_chunks"] == 1
    s.check_integrity()
    s.unpin(NS, a)
    assert s.stats()["tiers"]["cpu"]["num_chunks"] == 0
    b = NS.chunk_keys(prompt(1))
    put(s, prompt(1))
    assert s.pin(NS, b, lease_s=0.05) == 1 and s.pin_count(b[0]) == 1
    time.sleep(0.06)
    assert s.pin_count(b[0]) == 0
    with pytest.raises(ValueError, match="lease_s must be > 0"):
        s.pin(NS, b, lease_s=0)
    s.check_integrity()


def test_nan_lease_is_refused_and_cannot_block_other_leases():
    s = make(cpu=2)
    a, b = NS.chunk_keys(prompt(0)), NS.chunk_keys(prompt(1))
    put(s, prompt(0))
    put(s, prompt(1))
    with pytest.raises(ValueError, match="lease_s must be > 0, got nan"):
        s.pin(NS, a, lease_s=float("nan"))  # a NaN expiry would never end
    assert s.pin_count(a[0]) == 0
    assert s.pin(NS, b, lease_s=0.05) == 1
    time.sleep(0.06)
    assert s.pin_count(b[0]) == 0  # a NaN at the top of the lease heap used to keep this at 1
    s.check_integrity()


def test_reader_pin_blocks_eviction_during_copy():
    s = make(cpu=1)
    a = NS.chunk_keys(prompt(0))
    put(s, prompt(0))
    tier = s.tiers[0]
    real_read = tier.read
    seen = {}

    def slow_read(key, device="cpu"):
        seen["pins"] = s.pin_count(key)
        seen["put"] = put(s, prompt(1))  # no room: the only chunk is pinned by this reader
        return real_read(key, device)

    tier.read = slow_read
    out = s.get_chunks(NS, a)
    tier.read = real_read
    assert seen == {"pins": 1, "put": 0} and torch.equal(out[0], kv_for(prompt(0)))
    assert s.stats()["rejected_chunks"] == 1 and s.pin_count(a[0]) == 0
    s.check_integrity()

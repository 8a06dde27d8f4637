"""ChunkStore scenarios, with exact values: hits from the GPU, CPU and disk tiers, promotion,
restart on the same disk, disk damage, eviction order, metrics and clear.

Tiny layout of ``store_helpers``: 128-byte chunks, one page each.
"""

import lmdb
import pytest
import torch

from kvstore.api import PrefixStore
from kvstore.config import StoreConfig

from tests.kvstore.store_helpers import CB, NS, kv_for, make, prompt, put


def test_gpu_and_cpu_full_disk_hit_is_bit_exact(tmp_path):
    s = make(tmp_path, gpu=2, cpu=2, disk=10**6, promote_on_hit=False)
    assert [t.name for t in s.tiers] == ["gpu", "cpu", "disk"]
    for i in range(6):
        put(s, prompt(i))
    r = [PrefixStore(s, NS).lookup(prompt(i)).tiers for i in range(6)]
    assert r == [("disk",), ("disk",), ("cpu",), ("cpu",), ("gpu",), ("gpu",)]
    st = s.stats()
    assert st["spills_by_tier"] == {"gpu": 4, "cpu": 2} and st["evictions_by_tier"] == {"gpu": 4, "cpu": 2}
    assert torch.equal(PrefixStore(s, NS).get(prompt(0), 4), kv_for(prompt(0)))
    s.flush()
    assert torch.equal(PrefixStore(s, NS).get(prompt(1), 4), kv_for(prompt(1)))
    assert s.stats()["hits_by_tier"] == {"disk": 2}
    s.check_integrity()
    s.close()


def test_disk_hit_is_promoted(tmp_path):
    s = make(tmp_path, cpu=2, disk=10**6)
    for i in range(3):
        put(s, prompt(i))
    ps = PrefixStore(s, NS)
    assert ps.lookup(prompt(0)).tiers == ("disk",)
    assert torch.equal(ps.get(prompt(0), 4), kv_for(prompt(0)))
    assert ps.lookup(prompt(0)).tiers == ("cpu",)
    st = s.stats()
    assert st["promotions_by_tier"] == {"disk": 1} and st["spills_by_tier"] == {"cpu": 2}
    s.close()


def test_restart_all_disk_chunks_hit_bit_exact(tmp_path):
    s = make(tmp_path, cpu=2, disk=10**6)
    prompts = [prompt(i, 3) for i in range(4)]
    for p in prompts:
        put(s, p)
    # 12 chunks, 2 in the CPU tier. Putting prompt 3 (A <- B <- C) into a full 2-chunk tier:
    # A evicts prompt 2's tail, B evicts prompt 2's head, C evicts B (the tail of the stored
    # chain A <- B, tails go before heads). So the CPU tier ends with A and C, disk with the rest.
    cpu_keys = set(s.tiers[0].keys())
    k3 = NS.chunk_keys(prompts[3])
    assert cpu_keys == {k3[0], k3[2]} and s.stats()["tiers"]["disk"]["num_chunks"] == 10
    s.close()
    s.close()  # idempotent
    s = make(tmp_path, cpu=2, disk=10**6)
    ps = PrefixStore(s, NS)
    assert [ps.lookup(p).num_hit_tokens for p in prompts] == [12, 12, 12, 0]  # prompt 3's A was in RAM
    for p in prompts[:3]:
        assert torch.equal(ps.get(p, 12), kv_for(p))
    assert s.exists(NS, k3) == [False, True, False]
    assert torch.equal(s.get_chunks(NS, k3[1:2])[0], kv_for(prompts[3][4:8]))
    assert s.stats()["tiers"]["disk"]["num_chunks"] == 10
    s.check_integrity()
    s.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_disk_damage_through_the_store_is_a_miss_and_counted(tmp_path, damage):
    s = make(tmp_path, cpu=1, disk=10**6)
    put(s, prompt(0))
    put(s, prompt(1))
    put(s, prompt(2))
    s.close()  # prompts 0 and 1 are on disk only; 2 was in the CPU tier and is gone
    a, b = (bytes(NS.chunk_keys(prompt(i))[0]) for i in (0, 1))
    env = lmdb.open(str(tmp_path / "db"))
    with env.begin(write=True) as txn:
        va, vb = txn.get(a), txn.get(b)
        if damage == "flip":
            txn.put(a, va[:-9] + bytes([va[-9] ^ 4]) + va[-8:])
        elif damage == "truncate":
            txn.put(a, va[:60])
        else:
            txn.put(a, vb)
            txn.put(b, va)
    env.close()
    s = make(tmp_path, cpu=1, disk=10**6)
    ps = PrefixStore(s, NS)
    assert ps.get(prompt(0), 4) is None
    assert ps.lookup(prompt(0)).num_hit_tokens == 0  # deleted once found bad
    expect_corrupt = 2 if damage == "swap" else 1
    assert s.stats()["corruptions"] == expect_corrupt
    if damage != "swap":
        assert torch.equal(ps.get(prompt(1), 4), kv_for(prompt(1)))
    s.check_integrity()
    s.close()


def test_unreachable_bytes_and_tails_evicted_before_heads():
    s = make(cpu=4)
    put(s, prompt(0, 3))  # chain A <- B <- C
    put(s, prompt(1))     # X
    put(s, prompt(2))     # Y: evicts one chunk; LRU head is A, but C (a tail) goes
    ps = PrefixStore(s, NS)
    assert ps.lookup(prompt(0, 3)).num_hit_chunks == 2 and s.stats()["unreachable_bytes"] == 0
    keys = NS.chunk_keys(prompt(0, 3))
    s.remove(NS, keys[:1])  # drop the head: B is stored but unreachable
    assert s.stats()["unreachable_bytes"] == CB
    s.check_integrity()


def test_exception_inside_eviction_never_kills_the_store():
    s = make(cpu=3)
    tier = s.tiers[0]
    for i in range(3):
        put(s, prompt(i))

    def boom(*a, **k):
        raise RuntimeError("policy bug")

    tier.policy.next_victim = boom
    assert put(s, prompt(3)) == 1  # fallback victim, policy rebuilt
    tier.policy.on_access = boom
    assert PrefixStore(s, NS).get(prompt(3), 4) is not None
    st = s.stats()
    assert st["errors_by_tier"] == {"cpu": 2} and st["tiers"]["cpu"]["num_chunks"] == 3
    assert put(s, prompt(4)) == 1 and s.stats()["evictions"] == 2
    s.check_integrity()


def test_metrics_registry_per_store():
    s1, s2 = make(), make()
    put(s1, prompt(0))
    PrefixStore(s1, NS).lookup(prompt(0))
    assert s1.metrics.registry.get_sample_value("kvstore_lookups_total") == 1
    assert s2.metrics.registry.get_sample_value("kvstore_lookups_total") == 0
    text = s1.metrics.exposition().decode()
    for name in ("kvstore_hit_tokens_total", "kvstore_requested_tokens_total", 'kvstore_used_bytes{tier="cpu"}',
                 "kvstore_op_latency_seconds_bucket", "kvstore_evictions_total"):
        assert name in text


def test_clear_and_policies_by_name(tmp_path):
    for policy in ("lru", "lfu", "fifo", "s3fifo"):
        s = make(cpu=3, cpu_policy=policy)
        for i in range(6):
            put(s, prompt(i))
            s.check_integrity()
        assert s.stats()["tiers"]["cpu"]["policy"] == policy and s.stats()["evictions"] == 3
        assert s.clear(NS) == 3 and s.clear() == 0
    with pytest.raises(ValueError, match="unknown cpu_policy 'mru'"):
        StoreConfig(cpu_policy="mru")

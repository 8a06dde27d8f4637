"""ChunkStore scenarios from issue 2, with exact values.

Tiny layout: 2 layers, 1 KV head, head_dim 4, fp16, chunk_size 4 -> 128 bytes per chunk; memory
tiers use 128-byte pages so one chunk = one page and byte figures are exact multiples of 128.
"""
import threading
import time

import lmdb
import pytest
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


def test_threads_put_and_get_concurrently(tmp_path):
    s = make(tmp_path, cpu=8, disk=10**6)
    errors = []

    def worker(w):
        try:
            ps = PrefixStore(s, NS)
            for i in range(30):
                p = prompt(100 * w + i % 10, 2)
                ps.put(p, kv_for(p))
                got = ps.get(p, 8)
                assert got is None or torch.equal(got, kv_for(p))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s.flush()
    s.check_integrity()
    s.close()


def test_persist_writes_through_to_disk_and_waits_for_the_commit(tmp_path):
    s = make(tmp_path, cpu=10, disk=64 << 10)
    assert s.has_disk_tier
    toks = prompt(0, 2)
    ps = PrefixStore(s, NS)
    keys = ps.keys(toks)
    kvs = [kv_for(toks[:4]), kv_for(toks[4:])]
    assert s.put_chunks(NS, keys, kvs) == 2
    disk = s.tiers[-1]
    assert not any(disk.contains(k) for k in keys)  # put writes to the top tier only
    assert s.persist(NS, keys, kvs) == 2
    assert all(disk.contains(k) and not disk.is_pending(k) for k in keys)
    assert disk.parent_of(keys[1]) == keys[0]
    assert torch.equal(disk.read(keys[1]), kvs[1])
    assert s.persist(NS, keys, kvs) == 2  # already durable: nothing written twice
    assert disk.num_chunks == 2
    s.close()
    s2 = make(tmp_path, cpu=10, disk=64 << 10)  # reopen: both chunks hit from disk
    assert s2.lookup_keys(NS, keys).tiers == ("disk", "disk")
    assert torch.equal(s2.get_chunks(NS, keys)[0], kvs[0])
    s2.check_integrity()
    s2.close()


def test_persist_without_disk_tier_is_a_clear_error_and_bad_input_writes_nothing(tmp_path):
    s = make(cpu=10)
    assert not s.has_disk_tier
    keys = PrefixStore(s, NS).keys(prompt(0))
    with pytest.raises(RuntimeError, match="persist needs a disk tier"):
        s.persist(NS, keys, [kv_for(prompt(0))])
    d = make(tmp_path, cpu=10, disk=64 << 10)
    with pytest.raises(ValueError, match="1 keys but 2 tensors"):
        d.persist(NS, keys, [kv_for(prompt(0))] * 2)
    with pytest.raises(ValueError):
        d.persist(NS, keys, [kv_for(prompt(0)).float()])
    assert d.tiers[-1].num_chunks == 0
    d.close()


def test_get_into_caller_buffers_returns_them_bit_exact_and_checks_them(tmp_path):
    s = make(tmp_path, cpu=1, disk=64 << 10)
    a, b = prompt(0), prompt(1)
    put(s, a)
    put(s, b)  # a spills to disk
    ka, kb = PrefixStore(s, NS).keys(a)[0], PrefixStore(s, NS).keys(b)[0]
    bufs = [torch.full(LAY.shape(), 7.0, dtype=torch.float16) for _ in range(2)]
    got = s.get_chunks(NS, [kb, ka], out=bufs)
    assert got[0] is bufs[0] and torch.equal(bufs[0], kv_for(b))  # CPU hit lands in the buffer
    assert got[1] is not bufs[1] and torch.equal(got[1], kv_for(a))  # disk hit: a new tensor
    with pytest.raises(ValueError, match="2 keys but 1 out tensors"):
        s.get_chunks(NS, [kb, ka], out=bufs[:1])
    (in_cpu,) = s.tiers[0].keys()  # the disk hit was promoted
    with pytest.raises(ValueError, match="out must be contiguous"):
        s.get_chunks(NS, [in_cpu], out=[torch.empty(LAY.shape(), dtype=torch.float32)])
    assert s.pin_count(in_cpu) == 0  # the failed read released its reader pin
    s.check_integrity()
    s.close()


def test_try_lookup_never_waits_for_a_busy_lock():
    s = make(cpu=10)
    toks = prompt(0, 2)
    put(s, toks)
    keys = PrefixStore(s, NS).keys(toks)
    assert s.try_lookup_keys(NS, keys).num_hit_chunks == 2
    held, release = threading.Event(), threading.Event()

    def hold():
        with s._lock:
            held.set()
            release.wait(5)
    th = threading.Thread(target=hold)
    th.start()
    held.wait(5)
    t0 = time.perf_counter()
    assert s.try_lookup_keys(NS, keys) is None
    assert time.perf_counter() - t0 < 0.05
    release.set()
    th.join()
    assert s.lookup_keys(NS, keys).num_hit_chunks == 2
    assert s.stats()["lookups"] == 2  # the refused try counted nothing


def test_pin_table_counts_kinds_and_expires_leases_in_order():
    from kvstore.pins import PinTable
    a, b = PrefixStore(make(), NS).keys(prompt(0, 2))
    p = PinTable()
    p.add_reader(a)
    p.pin(a, None)
    p.pin(a, 10.0)
    p.pin(b, 5.0)
    assert (p.count(a), p.count(b), p.evictable(a)) == (3, 1, False)
    assert p.unpin(a) and p.count(a) == 2  # the explicit pin goes first
    assert p.unpin(a) and p.count(a) == 1  # then the leased one (its expiry is cancelled)
    assert not p.unpin(a)  # a reader pin is not dropped by unpin
    assert p.expire(5.0) == [b] and p.expire(10.0) == []
    p.drop_reader(a)
    assert p.pinned_keys() == set() and p.evictable(a)
    p.check_integrity()

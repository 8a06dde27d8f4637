"""ChunkStore scenarios, with exact values: concurrent puts and gets, write-through persist, gets
into caller buffers, lookups that never wait for a busy lock, and the pin table.

Tiny layout of ``store_helpers``: 128-byte chunks, one page each.
"""
import threading
import time

import pytest
import torch

from kvstore.api import PrefixStore

from tests.kvstore.store_helpers import LAY, NS, kv_for, make, prompt, put


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


def test_prefix_store_get_refuses_negative_and_non_integer_token_counts():
    """``tokens[:-chunk]`` would have returned the KV of all but the last chunk."""
    store = make()
    toks = prompt(0, 3)
    PrefixStore(store, NS).put(toks, kv_for(toks))
    p = PrefixStore(store, NS)
    assert p.get(toks, 2 * LAY.chunk_size).shape[2] == 2 * LAY.chunk_size
    with pytest.raises(ValueError, match=r"num_tokens=-\d+ must be a multiple"):
        p.get(toks, -LAY.chunk_size)
    with pytest.raises(TypeError, match="num_tokens must be an integer, got float"):
        p.get(toks, float(LAY.chunk_size))
    with pytest.raises(TypeError, match="got bool"):
        p.get(toks, True)
    store.close()


def test_prefix_store_put_shape_error_names_the_real_token_count():
    store = make()
    toks = prompt(0, 2)
    bad = kv_for(toks)[1:]  # one layer short
    with pytest.raises(ValueError, match=rf"shape mismatch: expected \[{LAY.num_layers}, 2, "
                                         rf"{2 * LAY.chunk_size},"):
        PrefixStore(store, NS).put(toks, bad)
    store.close()

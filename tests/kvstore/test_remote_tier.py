"""The remote tier on one real standalone Redis: two stores share chunks through it, bit-exact;
the values' keys, bytes and headers in Redis; exact counters; promotion; remove and clear
reaching Redis; TTL."""
import numpy as np
import pytest
import torch

from kvstore.api import LookupResult
from kvstore.codec import pack_value, unpack_header
from kvstore.layout import dtype_name
from tests.kvstore.remote_helpers import (
    CB, LAY, NS, count, make_store, prompt, rkey, same, sample, value_bytes)


def expected_value(key, parent, kv) -> bytes:
    """The value a raw-codec write stores for ``key``."""
    raw = kv.reshape(-1).view(torch.uint8).numpy()
    return pack_value(bytes(key), bytes(parent) if parent is not None else None, raw,
                      dtype_name(kv.dtype), tuple(kv.shape), "raw")


@pytest.fixture
def stores(redis_server):
    a, b = make_store(redis_server.url), make_store(redis_server.url)
    yield a, b
    a.close()
    b.close()


def test_a_chunk_put_by_one_store_is_a_bit_exact_hit_in_another(stores, redis_server):
    a, b = stores
    keys, kvs = prompt(NS, 0, 4)
    assert a.put_chunks(NS, keys, kvs) == 4
    assert a.flush(5.0)
    with redis_server.client() as r:
        assert r.dbsize() == 4
        stored = [r.get(rkey(k)) for k in keys]
        size = value_bytes(r, keys)
    # each value is exactly the self-describing raw value of its chunk, parent recorded
    parents = [None] + keys[:-1]
    assert stored == [expected_value(k, p, kv) for k, p, kv in zip(keys, parents, kvs)]
    for k, p, v in zip(keys, parents, stored):
        h = unpack_header(v)
        assert (h.key, h.parent, h.dtype, h.shape, h.codec, h.raw_nbytes) == (
            bytes(k), bytes(p) if p is not None else None, "float16", LAY.shape(), "raw", CB)
    assert (count(a.remote, "writes"), count(a.remote, "written_bytes")) == (4, size)
    assert sample(a, "kvstore_remote_writes_total") == 4.0
    assert sample(a, "kvstore_remote_written_bytes_total") == float(size)

    # B has an empty CPU tier: its lookup finds all four in Redis
    assert b.lookup_keys(NS, keys) == LookupResult(4, 4, ("remote",) * 4, 4)
    assert (count(b.remote, "lookups"), count(b.remote, "lookup_hits")) == (4, 4)
    got = b.get_chunks(NS, keys)
    assert same(got, kvs)
    assert all(g.dtype == torch.float16 and g.shape == LAY.shape() for g in got)
    assert (count(b.remote, "reads"), count(b.remote, "hits"), count(b.remote, "misses"),
            count(b.remote, "read_bytes")) == (4, 4, 0, size)
    assert sample(b, "kvstore_hits_total", {"tier": "remote"}) == 4.0
    assert sample(b, "kvstore_promotions_total", {"tier": "remote"}) == 4.0

    # promoted into B's CPU tier: B's next lookup is local and asks Redis nothing
    assert b.lookup_keys(NS, keys) == LookupResult(4, 4, ("cpu",) * 4, 4)
    assert count(b.remote, "lookups") == 4
    assert same(b.get_chunks(NS, keys), kvs) and count(b.remote, "reads") == 4
    # promotion is not a write: B wrote nothing to Redis
    assert count(b.remote, "writes") == 0 and b.flush(5.0)
    with redis_server.client() as r:
        assert r.dbsize() == 4
    a.check_integrity()
    b.check_integrity()


def test_lookup_asks_redis_only_for_keys_in_no_local_tier(stores):
    a, b = stores
    keys, kvs = prompt(NS, 1, 6)
    assert a.put_chunks(NS, keys[:4], kvs[:4]) == 4 and a.flush(5.0)
    assert b.put_chunks(NS, keys[:2], kvs[:2]) == 2  # B holds the first two itself
    res = b.lookup_keys(NS, keys)
    assert res == LookupResult(4, 4, ("cpu", "cpu", "remote", "remote"), 6)
    assert (count(b.remote, "lookups"), count(b.remote, "lookup_hits")) == (4, 2)
    assert b.exists(NS, keys) == [True] * 4 + [False] * 2
    got = b.get_chunks(NS, keys)
    assert same(got, kvs[:4] + [None, None])
    assert (count(b.remote, "reads"), count(b.remote, "hits"),
            count(b.remote, "misses")) == (4, 2, 2)
    assert sample(b, "kvstore_misses_total") == 2.0


def test_get_into_out_buffers_from_redis(stores):
    a, b = stores
    keys, kvs = prompt(NS, 2, 3)
    assert a.put_chunks(NS, keys, kvs) == 3 and a.flush(5.0)
    bufs = [torch.full(LAY.shape(), -1.0, dtype=torch.float16) for _ in range(4)]
    extra = NS.chunk_keys(list(range(16)))[3]
    got = b.get_chunks(NS, keys + [extra], out=bufs)
    assert all(g is buf for g, buf in zip(got[:3], bufs)) and got[3] is None
    assert same(bufs[:3], kvs)
    assert torch.equal(bufs[3], torch.full(LAY.shape(), -1.0, dtype=torch.float16))


def test_remove_and_clear_reach_redis(stores, redis_server):
    a, b = stores
    keys, kvs = prompt(NS, 3, 4)
    assert a.put_chunks(NS, keys, kvs) == 4 and a.flush(5.0)
    assert a.remove(NS, keys[2:]) == 2
    with redis_server.client() as r:
        assert sorted(r.keys("*")) == sorted(rkey(k) for k in keys[:2])
    assert b.lookup_keys(NS, keys) == LookupResult(2, 4, ("remote", "remote"), 4)
    # removing a chunk only Redis holds counts it
    assert b.remove(NS, keys[1:2]) == 1
    with redis_server.client() as r:
        assert r.keys("*") == [rkey(keys[0])]
    assert a.clear(NS) == 2  # keys[0] (local and Redis), keys[1] (local only)
    with redis_server.client() as r:
        assert r.dbsize() == 0
    assert b.lookup_keys(NS, keys).num_hit_chunks == 0


def test_stats_show_the_remote_tier_without_a_password(redis_server):
    with make_store(redis_server.url, remote_timeout_s=0.5) as s:
        st = s.stats()["remote"]
        assert (st["url"], st["cluster"], st["key_prefix"], st["ttl_s"], st["timeout_s"]) == (
            redis_server.url, False, "kvstore", 0.0, 0.5)
        assert st["writes"] == 0 and st["queue_capacity_bytes"] == 256 << 20
        assert "remote" in s.capabilities.tiers


def test_ttl_is_set_on_write_and_refreshed_on_read(redis_server):
    a = make_store(redis_server.url, remote_ttl_s=100)
    b = make_store(redis_server.url, remote_ttl_s=100)
    try:
        keys, kvs = prompt(NS, 4, 2)
        assert a.put_chunks(NS, keys, kvs) == 2 and a.flush(5.0)
        with redis_server.client() as r:
            ttls = [r.ttl(rkey(k)) for k in keys]
            assert all(0 < t <= 100 for t in ttls), ttls
            r.expire(rkey(keys[0]), 10)
        assert same(b.get_chunks(NS, keys), kvs)  # GETEX puts the TTL back to 100 s
        with redis_server.client() as r:
            assert 10 < r.ttl(rkey(keys[0])) <= 100
    finally:
        a.close()
        b.close()


def test_no_ttl_by_default(stores, redis_server):
    a, _ = stores
    keys, kvs = prompt(NS, 5, 1)
    assert a.put_chunks(NS, keys, kvs) == 1 and a.flush(5.0)
    with redis_server.client() as r:
        assert r.ttl(rkey(keys[0])) == -1


def test_compressed_codec_round_trips(redis_server):
    a = make_store(redis_server.url, remote_codec="shuffle-lz4")
    b = make_store(redis_server.url)
    try:
        keys = NS.chunk_keys(list(range(8)))
        kvs = [torch.zeros(LAY.shape(), dtype=torch.float16),
               torch.arange(np.prod(LAY.shape()), dtype=torch.float16).view(LAY.shape())]
        assert a.put_chunks(NS, keys, kvs) == 2 and a.flush(5.0)
        with redis_server.client() as r:
            assert unpack_header(r.get(rkey(keys[0]))).codec == "shuffle-lz4"
            assert r.strlen(rkey(keys[0])) < CB  # zeros compress
        assert same(b.get_chunks(NS, keys), kvs)
    finally:
        a.close()
        b.close()


def test_try_lookup_answers_inline_only_when_redis_need_not_be_asked(stores):
    a, b = stores
    keys, kvs = prompt(NS, 6, 3)
    assert a.put_chunks(NS, keys, kvs) == 3 and a.flush(5.0)
    assert a.try_lookup_keys(NS, keys) == LookupResult(3, 4, ("cpu",) * 3, 3)
    assert b.try_lookup_keys(NS, keys) is None  # Redis would need asking: caller uses a thread
    assert count(b.remote, "lookups") == 0
    longer, _ = prompt(NS, 6, 4)
    assert a.try_lookup_keys(NS, longer) is None  # the 4th chunk may be in Redis
    assert same(b.get_chunks(NS, keys[:1]), kvs[:1])
    assert b.try_lookup_keys(NS, keys[:1]) == LookupResult(1, 4, ("cpu",), 1)

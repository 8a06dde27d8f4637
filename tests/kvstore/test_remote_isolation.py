"""Isolation in a shared Redis: namespaces differing only in ``cache_salt``, two models, and
two deployments (key prefixes) on one cluster never see each other's chunks; their Redis keys
differ; ``clear(ns)`` deletes exactly that namespace's keys on every master."""
from collections import Counter

import pytest

from kvstore.api import LookupResult
from kvstore.keys import Namespace
from tests.kvstore.remote_helpers import LAY, NS, count, make_store, prompt, rkey, same

N = 12
TENANT_A = Namespace("remote-test-model", LAY, cache_salt="tenant-a")
TENANT_B = Namespace("remote-test-model", LAY, cache_salt="tenant-b")
MODEL_X = Namespace("model-x", LAY)
MODEL_Y = Namespace("model-y", LAY)


def redis_keys(cluster) -> set[bytes]:
    out = set()
    for node in cluster.nodes:
        with node.client() as r:
            out |= set(r.keys("*"))
    return out


@pytest.mark.parametrize("ns_a, ns_b", [(TENANT_A, TENANT_B), (MODEL_X, MODEL_Y)],
                         ids=["cache_salt", "model"])
def test_namespaces_never_share_chunks(shared_redis_cluster, ns_a, ns_b):
    """Same token ids in both namespaces: each store sees only its own namespace's chunks."""
    a = make_store(shared_redis_cluster.url, ns=ns_a)
    b = make_store(shared_redis_cluster.url, ns=ns_b)
    reader = make_store(shared_redis_cluster.url, ns=ns_a)
    reader.register(ns_b)
    try:
        keys_a, kvs_a = prompt(ns_a, 0, N)
        keys_b, _ = prompt(ns_b, 0, N)
        kvs_b = [kv + 1 for kv in kvs_a]  # other values for the same tokens
        assert ns_a.ns_id != ns_b.ns_id
        assert a.put_chunks(ns_a, keys_a, kvs_a) == N and a.flush(5.0)
        # b's namespace has nothing yet, though the tokens are the same
        assert b.lookup_keys(ns_b, keys_b) == LookupResult(0, 4, (), N)
        assert b.get_chunks(ns_b, keys_b) == [None] * N
        assert b.put_chunks(ns_b, keys_b, kvs_b) == N and b.flush(5.0)
        assert redis_keys(shared_redis_cluster) == {rkey(k) for k in keys_a + keys_b}
        assert not {rkey(k) for k in keys_a} & {rkey(k) for k in keys_b}
        # a reader with both namespaces gets each one's own values
        assert reader.lookup_keys(ns_a, keys_a).tiers == ("remote",) * N
        assert same(reader.get_chunks(ns_a, keys_a), kvs_a)
        assert same(reader.get_chunks(ns_b, keys_b), kvs_b)
        assert count(reader.remote, "validation_failures") == 0
        # a key of one namespace cannot be asked under the other
        with pytest.raises(ValueError):
            reader.get_chunks(ns_b, keys_a)
    finally:
        for s in (a, b, reader):
            s.close()


def test_key_prefixes_keep_deployments_apart(shared_redis_cluster):
    a = make_store(shared_redis_cluster.url, remote_key_prefix="dep-a")
    b = make_store(shared_redis_cluster.url, remote_key_prefix="dep-b")
    try:
        keys, kvs = prompt(NS, 0, N)
        assert a.put_chunks(NS, keys, kvs) == N and a.flush(5.0)
        assert b.lookup_keys(NS, keys).num_hit_chunks == 0
        assert b.get_chunks(NS, keys) == [None] * N
        other = [kv * 2 for kv in kvs]
        assert b.put_chunks(NS, keys, other) == N and b.flush(5.0)
        assert redis_keys(shared_redis_cluster) == (
            {rkey(k, "dep-a") for k in keys} | {rkey(k, "dep-b") for k in keys})
        fresh_a = make_store(shared_redis_cluster.url, remote_key_prefix="dep-a")
        try:
            assert same(fresh_a.get_chunks(NS, keys), kvs)
        finally:
            fresh_a.close()
        # clearing one deployment (every namespace) leaves the other's keys
        assert b.clear() == N
        assert redis_keys(shared_redis_cluster) == {rkey(k, "dep-a") for k in keys}
    finally:
        a.close()
        b.close()


def test_clear_of_a_namespace_deletes_exactly_its_keys_on_every_master(
        shared_redis_cluster):
    a = make_store(shared_redis_cluster.url, ns=TENANT_A, cpu_chunks=128)
    a.register(TENANT_B)
    try:
        keys_a, kvs_a = prompt(TENANT_A, 0, 30)
        keys_b, kvs_b = prompt(TENANT_B, 0, 30)
        assert a.put_chunks(TENANT_A, keys_a, kvs_a) == 30
        assert a.put_chunks(TENANT_B, keys_b, kvs_b) == 30
        assert a.flush(5.0)
        node_of = shared_redis_cluster.node_for_key
        on_a = Counter(node_of(rkey(k)) for k in keys_a)
        on_b = Counter(node_of(rkey(k)) for k in keys_b)
        assert all(on_a[i] > 0 and on_b[i] > 0 for i in range(3))
        sizes = []
        for node in shared_redis_cluster.nodes:
            with node.client() as r:
                sizes.append(r.dbsize())
        assert sizes == [on_a[i] + on_b[i] for i in range(3)]
        assert a.clear(TENANT_A) == 30
        sizes = []
        for node in shared_redis_cluster.nodes:
            with node.client() as r:
                sizes.append(r.dbsize())
        assert sizes == [on_b[i] for i in range(3)]
        assert redis_keys(shared_redis_cluster) == {rkey(k) for k in keys_b}
        assert count(a.remote, "deleted") == 30
        assert a.lookup_keys(TENANT_A, keys_a).num_hit_chunks == 0
        assert a.lookup_keys(TENANT_B, keys_b).num_hit_chunks == 30
    finally:
        a.close()

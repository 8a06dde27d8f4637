"""The remote tier on a real 3-master Redis Cluster: a prompt's chunks spread over every master;
a lookup or get sends one pipeline per master holding keys (counted by Redis's own
``INFO commandstats`` and by wrapping ``RedisNodes._call``); a killed master costs misses for
its keys only, and puts to the other masters still land; a hung master costs at most the
deadline while the others answer."""
import os
import signal
import time
from collections import Counter

import pytest

from tests.kvstore.remote_helpers import NS, count, make_store, make_tier, prompt, rkey, same

N = 24  # chunks per prompt: enough that every master holds several


def node_counts(cluster, keys) -> Counter:
    """Keys per master index."""
    return Counter(cluster.node_for_key(rkey(k)) for k in keys)


def dbsizes(cluster) -> list[int]:
    out = []
    for node in cluster.nodes:
        with node.client() as r:
            out.append(r.dbsize())
    return out


def calls(cluster, cmd: str) -> list[int]:
    """``cmdstat_<cmd>`` calls on each master since its last ``CONFIG RESETSTAT``."""
    out = []
    for node in cluster.nodes:
        with node.client() as r:
            out.append(r.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))
    return out


def reset_stats(cluster) -> None:
    for node in cluster.nodes:
        with node.client() as r:
            r.config_resetstat()


class CallCounter:
    """Wraps ``RedisNodes._call``: records (node, number of commands) of every pipeline."""

    def __init__(self, nodes):
        self.calls: list[tuple[str, int]] = []
        self._inner = nodes._call
        nodes._call = self

    def __call__(self, node, cmds, post=None):
        self.calls.append((node, len(cmds)))
        return self._inner(node, cmds, post)


@pytest.fixture
def stores(shared_redis_cluster):
    a, b = make_store(shared_redis_cluster.url), make_store(shared_redis_cluster.url)
    yield a, b
    a.close()
    b.close()


def test_a_prompt_spreads_over_every_master(stores, shared_redis_cluster):
    a, _ = stores
    assert a.remote.nodes.cluster is True
    keys, kvs = prompt(NS, 0, N)
    per_node = node_counts(shared_redis_cluster, keys)
    assert sorted(per_node) == [0, 1, 2] and min(per_node.values()) >= 2
    assert a.put_chunks(NS, keys, kvs) == N and a.flush(5.0)
    assert dbsizes(shared_redis_cluster) == [per_node[i] for i in range(3)]
    assert count(a.remote, "writes") == N
    # the tier routes each key to the master the cluster assigned its slot to
    names = [f"{n.host}:{n.port}" for n in shared_redis_cluster.nodes]
    assert [a.remote.nodes.node_of(rkey(k)) for k in keys] == [
        names[shared_redis_cluster.node_for_key(rkey(k))] for k in keys]


def test_lookup_and_get_send_one_pipeline_per_master(stores, shared_redis_cluster):
    a, b = stores
    keys, kvs = prompt(NS, 1, N)
    per_node = node_counts(shared_redis_cluster, keys)
    names = [f"{n.host}:{n.port}" for n in shared_redis_cluster.nodes]
    want = sorted((names[i], per_node[i]) for i in range(3))
    assert a.put_chunks(NS, keys, kvs) == N and a.flush(5.0)
    counter = CallCounter(b.remote.nodes)
    reset_stats(shared_redis_cluster)
    assert b.lookup_keys(NS, keys).tiers == ("remote",) * N
    assert sorted(counter.calls) == want  # one pipeline per master, all its keys in it
    assert calls(shared_redis_cluster, "exists") == [per_node[i] for i in range(3)]
    counter.calls.clear()
    assert same(b.get_chunks(NS, keys), kvs)
    assert sorted(counter.calls) == want
    assert calls(shared_redis_cluster, "get") == [per_node[i] for i in range(3)]
    # a prompt of one master's keys only calls that master
    one = [k for k in keys if shared_redis_cluster.node_for_key(rkey(k)) == 0]
    c = make_store(shared_redis_cluster.url)
    try:
        counter = CallCounter(c.remote.nodes)
        assert c.exists(NS, one) == [True] * len(one)
        assert counter.calls == [(names[0], len(one))]
    finally:
        c.close()


def test_a_killed_master_costs_only_its_keys_and_comes_back_empty(redis_cluster):
    # (no restart checks: A would write its chunks to the restarted master again,
    # test_remote_republish covers that)
    a = make_store(redis_cluster.url, remote_restart_check_s=0)
    # a 1 s read deadline: the live masters' answers must not miss it on a loaded host (with
    # the default 0.25 s a loaded CI run once saw every node late, so every key False)
    b = make_store(redis_cluster.url, promote_on_hit=False, remote_timeout_s=1.0,
                   remote_restart_check_s=0)
    t = make_tier(redis_cluster.url, breaker_reset_s=0.3)
    try:
        keys, kvs = prompt(NS, 2, N)
        assert a.put_chunks(NS, keys, kvs) == N and a.flush(5.0)
        dead = 1
        redis_cluster.kill_node(dead)
        alive = [redis_cluster.node_for_key(rkey(k)) != dead for k in keys]
        assert 0 < sum(alive) < N
        for _ in range(4):  # before and after the dead master's breaker opens
            t0 = time.monotonic()
            assert b.exists(NS, keys) == alive
            got = b.get_chunks(NS, keys)
            assert time.monotonic() - t0 < 2 * 1.0 + 0.5
            assert same(got, [kv if ok else None for kv, ok in zip(kvs, alive)])
        dead_name = "%s:%d" % redis_cluster.startup_nodes[dead]
        assert b.remote.nodes.breaker_states()[dead_name] == "open"
        assert count(b.remote, "breaker_opens", dead_name) == 1
        # new puts: the live masters take theirs, the dead master's are dropped as unavailable
        more, more_kvs = prompt(NS, 3, N)
        more_alive = [redis_cluster.node_for_key(rkey(k)) != dead for k in more]
        assert a.put_chunks(NS, more, more_kvs) == N and a.flush(10.0)
        assert count(a.remote, "writes") == N + sum(more_alive)
        assert count(a.remote, "dropped_writes", "unavailable") == N - sum(more_alive)
        assert b.exists(NS, more) == more_alive
        assert same(b.get_chunks(NS, more), [kv if ok else None
                                             for kv, ok in zip(more_kvs, more_alive)])
        # the master comes back empty with its slots: once its breaker lets a call through,
        # a tier writes to it again (ChunkStore's breaker pause is 5 s; ``t`` has 0.3 s)
        assert t.lookup(keys) == alive
        redis_cluster.nodes[dead].restart()
        redis_cluster.wait_ready()
        time.sleep(0.3)
        assert t.lookup(keys) == alive  # its old keys are gone
        assert t.nodes.breaker_states()[dead_name] == "closed"
        again = [k for k, ok in zip(keys, alive) if not ok]
        assert all(t.put_behind(k, kvs[keys.index(k)], None) for k in again) and t.flush(5.0)
        assert count(t, "writes") == len(again) and count(t, "dropped_writes") == 0
        assert t.lookup(keys) == [True] * N
        with redis_cluster.nodes[dead].client() as r:
            assert r.dbsize() == len(again)
    finally:
        a.close()
        b.close()
        t.close()


def test_a_hung_master_costs_at_most_the_deadline(shared_redis_cluster):
    a = make_store(shared_redis_cluster.url)
    b = make_store(shared_redis_cluster.url, promote_on_hit=False, remote_timeout_s=0.25)
    hung = shared_redis_cluster.nodes[2]
    try:
        keys, kvs = prompt(NS, 4, N)
        assert a.put_chunks(NS, keys, kvs) == N and a.flush(5.0)
        alive = [shared_redis_cluster.node_for_key(rkey(k)) != 2 for k in keys]
        os.kill(hung.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert b.exists(NS, keys) == alive
            assert time.monotonic() - t0 < 0.25 + 0.3
            t0 = time.monotonic()
            got = b.get_chunks(NS, keys)
            # a get's deadline adds 4 s per GiB asked: 24 * 512 bytes adds ~0.05 ms
            assert time.monotonic() - t0 < 0.25 + 0.3
            assert same(got, [kv if ok else None for kv, ok in zip(kvs, alive)])
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
    finally:
        a.close()
        b.close()
    shared_redis_cluster.wait_ready()

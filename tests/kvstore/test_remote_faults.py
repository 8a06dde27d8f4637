"""The remote tier when Redis misbehaves: full (``noeviction``), a write queue too small,
restarted empty, wrong or missing password, down at startup, killed at runtime, hung
(SIGSTOP). The store never raises on the data path: Redis's trouble costs misses and counted
drops, bounded in time by ``remote_timeout_s`` and then by the breaker."""
import os
import signal
import socket
import time

import pytest

from bench.redis_servers import RedisServer
from kvstore.api import LookupResult
from kvstore.config import StoreConfig
from kvstore.store import ChunkStore
from kvstore.tiers.redis_nodes import RemoteConfigError
from tests.kvstore.remote_helpers import (
    CB, LAY, NS, count, make_store, make_tier, prompt, same)
from tests.redis_fixtures import require_redis


def put_all(tier, keys, kvs) -> list[bool]:
    return [tier.put_behind(k, kv, p) for k, kv, p in zip(keys, kvs, [None] + keys[:-1])]


def test_full_redis_refuses_writes_counted_as_full_while_local_puts_succeed(tmp_path):
    require_redis()
    N = 400
    with RedisServer(tmp_path, maxmemory_policy="noeviction") as srv:
        with srv.client() as r:
            used = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory", used + 100 * 1024)  # a pipeline's query buffer counts too
        with make_store(srv.url, cpu_chunks=N) as s:
            keys, kvs = prompt(NS, 0, N)
            assert s.put_chunks(NS, keys, kvs) == N  # local puts never fail for Redis
            assert s.flush(10.0)
            with srv.client() as r:
                in_redis = r.dbsize()
            full = count(s.remote, "dropped_writes", "full")
            assert 0 < in_redis < N
            assert full == N - in_redis
            assert count(s.remote, "writes") == in_redis
            assert count(s.remote, "dropped_writes") == full  # no other reason
            assert s.lookup_keys(NS, keys) == LookupResult(N, 4, ("cpu",) * N, N)
            assert same(s.get_chunks(NS, keys), kvs)


def test_a_chunk_larger_than_the_queue_is_dropped_as_queue_full(redis_server):
    with make_store(redis_server.url, remote_queue_bytes=CB - 1) as s:
        keys, kvs = prompt(NS, 0, 5)
        assert s.put_chunks(NS, keys, kvs) == 5
        assert s.flush(5.0)
        assert count(s.remote, "dropped_writes", "queue_full") == 5
        assert count(s.remote, "writes") == 0 and s.remote.queued_bytes == 0
        with redis_server.client() as r:
            assert r.dbsize() == 0
        assert s.lookup_keys(NS, keys).tiers == ("cpu",) * 5


def test_queue_bytes_bound_queued_and_in_flight_writes(redis_server):
    """With Redis hung the writer's batch is in flight and still counts against the queue,
    so exactly 3 chunks (the queue's bytes) are accepted; the other 13 are dropped at once."""
    with make_store(redis_server.url, remote_queue_bytes=3 * CB, remote_timeout_s=5.0) as s:
        keys, kvs = prompt(NS, 0, 16)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert s.put_chunks(NS, keys, kvs) == 16
            assert time.monotonic() - t0 < 1.0  # the put never waits for Redis
            assert count(s.remote, "dropped_writes", "queue_full") == 13
            assert s.remote.queued_bytes == 3 * CB
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert s.flush(10.0)
        assert count(s.remote, "writes") == 3 and count(s.remote, "dropped_writes") == 13
        with redis_server.client() as r:
            assert r.dbsize() == 3


def test_restarted_empty_redis_misses_then_takes_writes_again(redis_server):
    t = make_tier(redis_server.url)
    try:
        keys, kvs = prompt(NS, 0, 4)
        assert put_all(t, keys, kvs) == [True] * 4 and t.flush(5.0)
        assert t.lookup(keys) == [True] * 4
        redis_server.restart()  # same port, no data
        assert t.lookup(keys) == [False] * 4
        assert t.get(keys, LAY) == [None] * 4
        deadline = time.monotonic() + 5.0
        while t.nodes.breaker_states() != {f"127.0.0.1:{redis_server.port}": "closed"}:
            assert time.monotonic() < deadline
            t.lookup(keys[:1])
            time.sleep(0.05)
        assert put_all(t, keys[:2], kvs[:2]) == [True, True] and t.flush(5.0)
        assert t.lookup(keys) == [True, True, False, False]
        got = t.get(keys, LAY)
        assert same([g and g[0] for g in got], kvs[:2] + [None, None])
        assert [g and g[1] for g in got[:2]] == [None, keys[0]]
        with redis_server.client() as r:
            assert r.dbsize() == 2
    finally:
        t.close()


def test_wrong_or_missing_password_fails_at_startup_without_showing_it(tmp_path):
    require_redis()
    with RedisServer(tmp_path, password="right-pw-123") as srv:
        url = f"redis://:wrong-pw-456@127.0.0.1:{srv.port}"
        with pytest.raises(RemoteConfigError, match="refused the credentials") as e:
            ChunkStore(StoreConfig(cpu_bytes=8 * CB, page_bytes=CB, remote_url=url), [NS])
        assert "wrong-pw-456" not in str(e.value) and "right-pw-123" not in str(e.value)
        assert isinstance(e.value, ValueError)
        with pytest.raises(RemoteConfigError, match=r"needs a password \(AUTH failed\)") as e:
            make_store(f"redis://127.0.0.1:{srv.port}")  # no password at all
        assert "right-pw-123" not in str(e.value)
        # the right one, given apart from the URL, works
        with make_store(f"redis://127.0.0.1:{srv.port}", remote_password="right-pw-123") as s:
            keys, kvs = prompt(NS, 0, 1)
            assert s.put_chunks(NS, keys, kvs) == 1 and s.flush(5.0)
            assert count(s.remote, "writes") == 1
            assert "right-pw-123" not in repr(s.config) and "right-pw-123" not in str(s.stats())


def test_redis_down_at_startup_is_a_config_error():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RemoteConfigError, match="cannot reach Redis at") as e:
        make_store(f"redis://:pw-789@127.0.0.1:{port}")
    assert f"127.0.0.1:{port}" in str(e.value) and "pw-789" not in str(e.value)
    assert time.monotonic() - t0 < 6.0


def test_killed_at_runtime_lookups_miss_within_the_deadline_then_the_breaker_opens(
        redis_server):
    a, b = make_store(redis_server.url), make_store(redis_server.url, remote_timeout_s=0.25)
    try:
        keys, kvs = prompt(NS, 0, 4)
        assert a.put_chunks(NS, keys, kvs) == 4 and a.flush(5.0)
        assert b.lookup_keys(NS, keys).num_hit_chunks == 4
        node = f"127.0.0.1:{redis_server.port}"
        redis_server.kill()
        for _ in range(3):  # breaker_threshold
            t0 = time.monotonic()
            assert b.lookup_keys(NS, keys) == LookupResult(0, 4, (), 4)
            assert time.monotonic() - t0 < 0.25 + 0.5
        text = b.metrics.exposition().decode()
        assert f'kvstore_remote_breaker_state{{node="{node}"}} 1.0' in text
        assert count(b.remote, "breaker_opens", node) == 1
        t0 = time.monotonic()
        for _ in range(20):
            assert b.get_chunks(NS, keys) == [None] * 4
            assert b.lookup_keys(NS, keys).num_hit_chunks == 0
        assert time.monotonic() - t0 < 0.5  # 40 calls, none sent
        # a put still stores locally; its write is dropped as unavailable
        more, more_kvs = prompt(NS, 1, 2)
        assert b.put_chunks(NS, more, more_kvs) == 2 and b.flush(5.0)
        assert count(b.remote, "dropped_writes", "unavailable") == 2
        assert b.lookup_keys(NS, more).tiers == ("cpu", "cpu")
    finally:
        a.close()
        b.close()


def test_hung_redis_costs_one_deadline_per_call_until_the_breaker_opens(redis_server):
    t = make_tier(redis_server.url, timeout_s=0.25, breaker_reset_s=0.5)
    try:
        keys, kvs = prompt(NS, 0, 3)
        assert put_all(t, keys, kvs) == [True] * 3 and t.flush(5.0)
        node = f"127.0.0.1:{redis_server.port}"
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(3):
                t0 = time.monotonic()
                assert t.lookup(keys) == [False] * 3
                assert time.monotonic() - t0 < 0.25 + 0.3
            assert t.nodes.breaker_states() == {node: "open"}
            t0 = time.monotonic()
            assert t.lookup(keys) == [False] * 3 and t.get(keys, LAY) == [None] * 3
            assert time.monotonic() - t0 < 0.1  # refused by the breaker, nothing sent (vs 0.25 s)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        time.sleep(0.5)  # the breaker's pause
        assert t.lookup(keys) == [True] * 3  # the half-open trial succeeds
        assert t.nodes.breaker_states() == {node: "closed"}
        assert same([g[0] for g in t.get(keys, LAY)], kvs)
        assert count(t, "breaker_opens", node) == 1
    finally:
        t.close()


def test_breaker_settings_come_from_the_store_config(redis_server):
    with make_store(redis_server.url, remote_breaker_failures=1, remote_breaker_reset_s=0.3) as s:
        keys, kvs = prompt(NS, 0, 2)
        assert s.put_chunks(NS, keys, kvs) == 2 and s.flush(5.0)
        redis_server.kill()
        assert s.lookup_keys(NS, keys).num_hit_chunks == 2  # local tiers answer
        assert s.remote.lookup(keys) == [False, False]       # one failure opens the breaker
        assert s.remote.nodes.breaker_states() == {f"127.0.0.1:{redis_server.port}": "open"}
        time.sleep(0.35)
        assert s.remote.nodes.breaker_states() == {f"127.0.0.1:{redis_server.port}": "half_open"}
    with pytest.raises(ValueError, match="remote_breaker_failures"):
        StoreConfig(remote_url="redis://h:1", remote_breaker_failures=0)

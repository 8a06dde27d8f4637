"""Real Redis servers for tests (``bench.redis_servers``): a standalone server that crashes and
comes back empty, auth, ``maxmemory`` with ``noeviction``, and a 3-master Cluster whose keys
spread over every master and whose surviving masters keep serving when one is killed."""
from __future__ import annotations

import socket

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bench import redis_servers, servers
from bench.daemon_load_redis import Redis
from bench.redis_cluster import RedisClusterGroup
from bench.redis_servers import RedisNotInstalled, RedisServer, redis_binary
from tests.redis_fixtures import (redis_cluster, redis_server,  # noqa: F401
                                  require_redis, shared_redis_cluster)


def _no_retry_client(port: int, **kwargs) -> redis.Redis:
    """A client that fails at once (redis-py otherwise retries with backoff for seconds)."""
    return redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0), **kwargs)


def test_standalone_set_get_kill_restart_comes_back_empty(redis_server):
    srv = redis_server
    assert srv.url == f"redis://127.0.0.1:{srv.port}"
    with srv.client() as r:
        assert r.set(b"chunk", b"\x00\x01" * 1000)
        assert r.get(b"chunk") == b"\x00\x01" * 1000
        assert r.config_get("save") == {"save": ""}
        assert r.config_get("appendonly") == {"appendonly": "no"}
    pid, port = srv.proc.pid, srv.port
    srv.kill()  # a crash: SIGKILL
    assert not srv.alive and srv.proc.returncode == -9
    with pytest.raises(redis.exceptions.ConnectionError), srv.client() as r:
        r.get(b"chunk")
    srv.restart()
    assert srv.alive and srv.port == port and srv.proc.pid != pid
    with srv.client() as r:
        assert r.get(b"chunk") is None and r.dbsize() == 0
        r.set(b"again", b"1")
        assert r.get(b"again") == b"1"


def test_stop_ends_the_process_and_untracks_it(tmp_path):
    require_redis()
    srv = RedisServer(tmp_path).start()
    proc = srv.proc
    assert proc in servers._LIVE  # killed at interpreter exit if never stopped
    srv.stop()
    assert proc.returncode is not None and proc not in servers._LIVE
    srv.stop()  # idempotent


def test_password_required(tmp_path):
    require_redis()
    with RedisServer(tmp_path, password="s3cret/pw") as srv:
        assert srv.url == f"redis://:s3cret%2Fpw@127.0.0.1:{srv.port}"
        with srv.client() as r:
            assert r.set(b"k", b"v") and r.get(b"k") == b"v"
        with _no_retry_client(srv.port) as anon:
            with pytest.raises(redis.exceptions.AuthenticationError):
                anon.get(b"k")
        with pytest.raises(redis.exceptions.AuthenticationError):
            with _no_retry_client(srv.port, password="wrong") as bad:
                bad.get(b"k")
        srv.kill()
        srv.restart()  # the password survives a restart
        with redis.Redis.from_url(srv.url) as r:
            assert r.get(b"k") is None


def test_maxmemory_noeviction_refuses_writes_past_the_limit(tmp_path):
    require_redis()
    limit, value = 4 << 20, b"x" * (64 << 10)
    with RedisServer(tmp_path, maxmemory=limit, maxmemory_policy="noeviction") as srv, \
            srv.client() as r:
        assert r.config_get("maxmemory") == {"maxmemory": str(limit)}
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        stored = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(2 * limit // len(value)):
                r.set(f"k{i}", value)
                stored += 1
        # Every write before the refusal is kept (nothing evicted); the refusal came as soon as
        # the memory in use passed the limit (within one value's allocation).
        assert r.dbsize() == stored and stored >= 20
        assert all(r.exists(f"k{i}") for i in range(stored))
        assert limit < r.info("memory")["used_memory"] <= limit + 2 * len(value)
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            r.set(b"one-more", value)
        assert r.delete("k0", "k1", "k2") == 3  # room again: writes succeed
        assert r.set(b"one-more", value)


def test_start_failure_shows_the_log(tmp_path):
    require_redis()
    srv = RedisServer(tmp_path, extra_args=("--no-such-directive", "1"))
    with pytest.raises(RuntimeError, match="(?s)exited with 1.*no-such-directive"):
        srv.start()
    assert not srv.alive


def test_missing_binary_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisNotInstalled, match="apt-get install redis-server.*make redis"):
        redis_binary()
    assert issubclass(RedisNotInstalled, RuntimeError)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_redis()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="apt-get install redis-server"):
        require_redis()


def _cluster_info(node: RedisServer) -> dict:
    with node.client() as r:
        return r.cluster("INFO")


def test_cluster_of_three_spreads_keys_and_survives_a_killed_master(redis_cluster):
    grp = redis_cluster
    ports = [n.port for n in grp.nodes]
    assert len(set(ports)) == 3 and grp.startup_nodes == [("127.0.0.1", p) for p in ports]
    assert grp.url == "redis://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    for node in grp.nodes:
        info = _cluster_info(node)
        assert info["cluster_state"] == "ok"
        assert int(info["cluster_slots_assigned"]) == 16384
        assert int(info["cluster_known_nodes"]) == 3 and int(info["cluster_size"]) == 3
    keys = [f"doc:{i}".encode() for i in range(100)]
    with grp.client() as rc:
        for i, k in enumerate(keys):
            rc.set(k, i.to_bytes(2, "little"))
        assert [rc.get(k) for k in keys] == [i.to_bytes(2, "little") for i in range(100)]
    owners = [grp.node_for_key(k) for k in keys]
    sizes = []
    for i, node in enumerate(grp.nodes):
        with node.client() as r:
            sizes.append(r.dbsize())
            assert all(r.exists(k) for j, k in enumerate(keys) if owners[j] == i)
            foreign = next(j for j, o in enumerate(owners) if o != i)
            with pytest.raises(redis.exceptions.MovedError,
                               match=f"127.0.0.1:{grp.nodes[owners[foreign]].port}$"):
                r.get(keys[foreign])
    assert sizes == [owners.count(i) for i in range(3)] and sum(sizes) == 100
    assert min(sizes) > 0  # every master holds some

    grp.kill_node(1)
    assert not grp.nodes[1].alive and grp.nodes[0].alive and grp.nodes[2].alive
    for i in (0, 2):
        with grp.nodes[i].client() as r:
            mine = [j for j, o in enumerate(owners) if o == i]
            assert [r.get(keys[j]) for j in mine] == [j.to_bytes(2, "little") for j in mine]
            r.set(keys[mine[0]], b"new")  # still writable: full coverage is not required
            assert r.get(keys[mine[0]]) == b"new"
    with pytest.raises(redis.exceptions.ConnectionError), grp.nodes[1].client() as r:
        r.get(keys[owners.index(1)])


def test_cluster_node_restart_rejoins_empty_with_its_slots(redis_cluster):
    grp = redis_cluster
    key = b"{chunk}a"
    owner = grp.node_for_key(key)
    with grp.client() as rc:
        rc.set(key, b"v")
    grp.kill_node(owner)
    grp.nodes[owner].restart()
    grp.wait_ready()
    assert grp.node_for_key(key) == owner
    with grp.client() as rc:
        assert rc.get(key) is None
        rc.set(key, b"w")
    with grp.nodes[owner].client() as r:
        assert r.get(key) == b"w"


def test_cluster_with_password(tmp_path):
    require_redis()
    with RedisClusterGroup(tmp_path, password="pw") as grp:
        assert grp.url == "redis://:pw@" + ",".join(f"127.0.0.1:{n.port}" for n in grp.nodes)
        with grp.client() as rc:
            rc.set(b"k", b"v")
            assert rc.get(b"k") == b"v"
        with _no_retry_client(grp.nodes[0].port) as anon:
            with pytest.raises(redis.exceptions.AuthenticationError):
                anon.cluster("INFO")


def test_cluster_create_failure_shows_redis_cli_output(tmp_path):
    require_redis()
    grp = RedisClusterGroup(tmp_path)
    grp.nodes[2].cluster = False  # a node without cluster mode: redis-cli refuses to create
    with pytest.raises(RuntimeError, match="(?s)--cluster create.*not configured as a cluster"):
        grp.start()
    assert not any(n.alive for n in grp.nodes)
    with pytest.raises(ValueError, match="at least 3 masters"):
        RedisClusterGroup(tmp_path, masters=2)


_SEEN_PORTS: list[list[int]] = []


@pytest.mark.parametrize("round_", [0, 1])
def test_shared_cluster_is_reused_and_empty_for_each_test(shared_redis_cluster, round_):
    grp = shared_redis_cluster
    ports = [n.port for n in grp.nodes]
    assert all(_cluster_info(n)["cluster_state"] == "ok" for n in grp.nodes)
    with grp.client() as rc:
        assert rc.dbsize() == 0  # flushed (the other round wrote keys)
        for i in range(20):
            rc.set(f"r{round_}:{i}", b"1")
    if round_ == 1:
        grp.kill_node(0)  # the next user gets it restarted
    _SEEN_PORTS.append(ports)
    assert all(p == _SEEN_PORTS[0] for p in _SEEN_PORTS)


def test_shared_cluster_restarts_a_killed_node(shared_redis_cluster):
    grp = shared_redis_cluster
    assert all(n.alive for n in grp.nodes)
    with grp.client() as rc:
        assert rc.dbsize() == 0
        for i in range(30):
            rc.set(f"after:{i}", b"1")
        assert [rc.get(f"after:{i}") for i in range(30)] == [b"1"] * 30


def test_daemon_load_redis_baseline_server(tmp_path):
    require_redis()
    srv = Redis(str(tmp_path))
    try:
        assert srv.alive
        with srv.client() as r:
            assert r.config_get("client-query-buffer-limit") == {
                "client-query-buffer-limit": str(1 << 30)}
            assert r.config_get("proto-max-bulk-len") == {"proto-max-bulk-len": str(1 << 30)}
    finally:
        srv.stop()
    assert not srv.alive


def test_port_in_use(tmp_path, monkeypatch):
    require_redis()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} is in use"):
            RedisServer(tmp_path, port=port).start()
        # A port picked as free but taken before redis-server binds it: another is picked.
        picks = iter([port, servers.free_port()])
        monkeypatch.setattr(redis_servers, "free_port", lambda: next(picks))
        with RedisServer(tmp_path) as srv, srv.client() as r:
            assert srv.port != port and r.ping()

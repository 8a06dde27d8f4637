"""The remote tier under a user's mistakes and an operator's day: settings that cannot work,
metrics present before anything happens, Redis emptied between a lookup and a get, a tiny
``allkeys-lru`` Redis evicting parents, slots resharded under traffic, eight threads on two
stores over one cluster, ``clear`` on one host seen from another, and close while Redis hangs.

Layout and chunks: ``tests.kvstore.remote_helpers`` (512-byte chunks).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from bench.redis_servers import RedisServer
from kvstore.tiers.remote import RemoteTier
from tests.kvstore.remote_helpers import NS, make_store, make_tier, prompt, rkey, same, sample

DROP_REASONS = ("queue_full", "full", "unavailable", "error", "closed")
CHECK_REASONS = ("header", "version", "truncated", "key", "layout", "checksum")


def num_values(grp) -> int:
    """Keys held by all of a cluster's masters together."""
    return sum(n.client().dbsize() for n in grp.nodes)


# ---- settings ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(ttl_s=float("inf")), dict(timeout_s=float("inf")),
                                dict(ttl_s=float("nan")), dict(queue_bytes=0.5)])
def test_settings_that_cannot_work_are_refused_before_connecting(kw):
    # port 1 refuses connections: a ValueError about the setting, not about reaching Redis
    with pytest.raises(ValueError, match="remote tier needs") as e:
        RemoteTier("redis://:PWSECRET@127.0.0.1:1", **kw)
    assert "PWSECRET" not in str(e.value)


def test_startup_log_line_names_the_settings(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="kvstore.tiers.remote")
    for ttl, shown in ((0, "ttl none,"), (90, "ttl 90s,")):
        t = make_tier(redis_server.url, ttl_s=ttl, key_prefix="prod")
        t.close()
        line = [r.getMessage() for r in caplog.records if "key prefix" in r.getMessage()][-1]
        assert line == (f"remote tier: Redis redis://127.0.0.1:{redis_server.port}, key prefix "
                        f"'prod', {shown} deadline 0.250s")


# ---- metrics -------------------------------------------------------------------------------
def test_every_documented_series_is_exported_before_anything_happens(redis_server):
    with make_store(redis_server.url) as s:
        node = f"127.0.0.1:{redis_server.port}"
        assert sample(s, "kvstore_remote_breaker_state", {"node": node}) == 0.0
        assert sample(s, "kvstore_remote_breaker_opens_total", {"node": node}) == 0.0
        for r in DROP_REASONS:
            assert sample(s, "kvstore_remote_dropped_writes_total", {"reason": r}) == 0.0, r
        for r in CHECK_REASONS:
            assert sample(s, "kvstore_remote_validation_failures_total", {"reason": r}) == 0.0
        for name in ("lookups", "lookup_hits", "reads", "hits", "misses", "read_bytes",
                     "writes", "written_bytes", "deleted"):
            assert sample(s, f"kvstore_remote_{name}_total") == 0.0, name
        assert sample(s, "kvstore_remote_queue_bytes") == 0.0
        assert s.stats()["remote"]["breakers"] == {node: "closed"}


def test_breaker_series_exist_for_every_master_of_a_cluster(shared_redis_cluster):
    with make_store(shared_redis_cluster.url) as s:
        nodes = {f"127.0.0.1:{n.port}" for n in shared_redis_cluster.nodes}
        assert set(s.stats()["remote"]["breakers"]) == nodes
        for node in nodes:
            assert sample(s, "kvstore_remote_breaker_state", {"node": node}) == 0.0


# ---- Redis emptied between a lookup and a get ----------------------------------------------
def test_flushall_between_lookup_and_get_is_a_miss_not_an_error(shared_redis_cluster):
    keys, kvs = prompt(NS, 0, 6)
    with make_store(shared_redis_cluster.url) as a, make_store(shared_redis_cluster.url) as b:
        assert a.put_chunks(NS, keys, kvs) == 6 and a.flush(5.0)
        assert b.lookup_keys(NS, keys).tiers == ("remote",) * 6
        shared_redis_cluster.flushall()
        assert b.get_chunks(NS, keys) == [None] * 6
        st = b.stats()["remote"]
        assert (st["lookup_hits"], st["reads"], st["hits"], st["misses"]) == (6, 6, 0, 6)
        assert st["validation_failures"] == 0 and b.lookup_keys(NS, keys).num_hit_chunks == 0
        b.check_integrity()


# ---- tiny allkeys-lru Redis -----------------------------------------------------------------
def test_lru_evicting_parents_stops_the_prefix_walk_at_the_first_missing_chunk(tmp_path):
    n = 400  # ~250 KB of values (+ overhead) into a Redis allowed 400 KiB above its empty footprint
    with RedisServer(tmp_path, maxmemory=0, maxmemory_policy="allkeys-lru") as srv:
        cl = srv.client()
        base = int(cl.info("memory")["used_memory"])
        cl.config_set("maxmemory", base + 400 * 1024)
        keys, kvs = prompt(NS, 0, n)
        with make_store(srv.url, cpu_chunks=n) as a, make_store(srv.url) as b:
            assert a.put_chunks(NS, keys, kvs) == n and a.flush(10.0)
            present = [bool(cl.exists(rkey(k))) for k in keys]
            assert 0 < sum(present) < n, "Redis should hold some, not all, of the chunks"
            first_missing = present.index(False)
            res = b.lookup_keys(NS, keys)
            # (a command's own buffers may push Redis over maxmemory: it evicts on reads too)
            hit = res.num_hit_chunks
            assert hit <= first_missing and res.tiers == ("remote",) * hit
            assert cl.exists(rkey(keys[hit])) == 0   # the walk stopped at a missing chunk
            got = b.get_chunks(NS, keys)
            for i, (g, want, p) in enumerate(zip(got, kvs, present)):
                # a chunk is either absent or exactly its own KV (LRU may evict more meanwhile)
                assert g is None or torch.equal(g, want), i
                assert g is None or p, i
            assert b.stats()["remote"]["validation_failures"] == 0


# ---- resharding under traffic -------------------------------------------------------------
def _node_id(node) -> str:
    return node.client().execute_command("CLUSTER", "MYID").decode()


def _reshard(grp, src, dst, slots: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["redis-cli", "--cluster", "reshard", f"127.0.0.1:{grp.nodes[0].port}",
         "--cluster-from", _node_id(grp.nodes[src]), "--cluster-to", _node_id(grp.nodes[dst]),
         "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "20"],
        capture_output=True, text=True, timeout=120)


def test_slots_resharded_during_lookups_gets_and_puts_never_give_a_wrong_chunk(redis_cluster):
    grp = redis_cluster
    old = [prompt(NS, i, 8) for i in range(40)]           # 320 chunks, written before
    with make_store(grp.url, cpu_chunks=4096) as a, make_store(grp.url, cpu_chunks=8) as b:
        for keys, kvs in old:
            assert a.put_chunks(NS, keys, kvs) == 8
        assert a.flush(10.0)
        stop, errors, wrong = threading.Event(), [], []
        new: list = []

        def reader():
            try:
                while not stop.is_set():
                    for keys, kvs in old:
                        b.lookup_keys(NS, keys)
                        for g, w in zip(b.get_chunks(NS, keys), kvs):
                            if g is not None and not torch.equal(g, w):
                                wrong.append(1)
            except Exception as e:  # noqa: BLE001 (the test's point: none may escape)
                errors.append(e)

        def writer():
            try:
                i = 100
                while not stop.is_set() and i < 600:
                    keys, kvs = prompt(NS, i, 4)
                    a.put_chunks(NS, keys, kvs)
                    new.append((keys, kvs))
                    i += 1
                    time.sleep(0.01)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
        for t in threads:
            t.start()
        try:
            r1 = _reshard(grp, 0, 1, 1000)
            r2 = _reshard(grp, 1, 2, 1000)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
        assert errors == [] and wrong == []
        assert a.flush(10.0)
        time.sleep(1.1)  # the slot map refreshes at most once a second
        b.remote.lookup([old[0][0][0]])  # a MOVED answer refreshes it (or it is current)
        time.sleep(1.1)
        with make_store(grp.url) as c:   # a new host: every value readable where it now is
            everything = old + new
            keys = [k for ks, _ in everything for k in ks]
            kvs = [v for _, vs in everything for v in vs]
            got = [g for i in range(0, len(keys), 32) for g in c.get_chunks(NS, keys[i:i + 32])]
            assert same([g for g in got if g is not None],
                        [w for g, w in zip(got, kvs) if g is not None])
            # a miss here is a node late on a loaded machine: each such key is in Redis, and
            # read alone it is its own chunk
            cl = grp.client()
            for i in [i for i, g in enumerate(got) if g is None]:
                assert cl.exists(rkey(keys[i])) == 1, i
                assert same(c.get_chunks(NS, [keys[i]]), [kvs[i]]), i
        # every write is done or counted as dropped (a node late past its socket timeout while
        # it migrates keys on a loaded machine: `unavailable`; its SET may still have landed)
        ra = a.stats()["remote"]
        assert ra["writes"] + ra["dropped_writes"] == len(keys)
        assert set(ra["dropped_writes_by_reason"]) <= {"unavailable"}
        assert ra["dropped_writes"] <= len(keys) // 100
        assert ra["writes"] <= num_values(grp) <= len(keys)


# ---- eight threads, two stores, one cluster ------------------------------------------------
def test_eight_threads_on_two_stores_share_one_cluster_bit_exact(shared_redis_cluster):
    url = shared_redis_cluster.url
    with make_store(url, cpu_chunks=2048) as a, make_store(url, cpu_chunks=2048) as b:
        stores, errors, wrong, hits = (a, b), [], [], [0] * 8
        barrier = threading.Barrier(8)

        def work(t):
            try:
                mine, other = stores[t % 2], stores[1 - t % 2]
                for r in range(10):
                    keys, kvs = prompt(NS, 100 * t + r, 6)
                    mine.put_chunks(NS, keys, kvs)
                barrier.wait()
                mine.flush(10.0)
                barrier.wait()
                for r in range(10):  # prompts `mine` stored (thread t + 2), through `other`
                    keys, kvs = prompt(NS, 100 * ((t + 2) % 8) + r, 6)
                    for g, w in zip(other.get_chunks(NS, keys), kvs):
                        if g is None:
                            continue
                        hits[t] += 1
                        if not torch.equal(g, w):
                            wrong.append((t, r))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and wrong == []
        assert sum(hits) == 8 * 10 * 6  # every chunk found, from a local tier or from Redis
        ra, rb = a.stats()["remote"], b.stats()["remote"]
        assert ra["writes"] == rb["writes"] == 4 * 10 * 6
        assert num_values(shared_redis_cluster) == 8 * 10 * 6
        for r in (ra, rb):
            assert r["dropped_writes"] == 0 and r["validation_failures"] == 0
            assert r["reads"] == r["hits"] + r["misses"] and r["misses"] == 0
        # each thread read 60 chunks that only the other store held locally: all from Redis
        assert ra["hits"] == rb["hits"] == 4 * 10 * 6
        a.check_integrity()
        b.check_integrity()


# ---- clear on one host ---------------------------------------------------------------------
def test_clear_on_one_host_empties_redis_for_all_but_keeps_others_local_copies(
        shared_redis_cluster):
    url = shared_redis_cluster.url
    keys, kvs = prompt(NS, 0, 4)
    with make_store(url) as a, make_store(url) as b:
        assert a.put_chunks(NS, keys, kvs) == 4 and a.flush(5.0)
        assert same(b.get_chunks(NS, keys), kvs)           # b promotes them into its CPU tier
        assert a.clear(NS) == 4
        assert num_values(shared_redis_cluster) == 0
        assert b.lookup_keys(NS, keys).tiers == ("cpu",) * 4  # b's copies stay
        with make_store(url) as c:                         # a third host sees nothing
            assert c.lookup_keys(NS, keys).num_hit_chunks == 0
        more, more_kvs = prompt(NS, 0, 5)                  # b stores the 5th chunk: only
        assert b.put_chunks(NS, more, more_kvs) == 1 and b.flush(5.0)   # it is written
        assert num_values(shared_redis_cluster) == 1


# ---- close while Redis hangs ---------------------------------------------------------------
def test_close_while_redis_is_stopped_is_bounded(redis_server):
    s = make_store(redis_server.url, cpu_chunks=4096)
    keys, kvs = prompt(NS, 0, 2000)   # ~1 MB queued behind
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        assert s.put_chunks(NS, keys, kvs) == 2000
        t0 = time.monotonic()
        s.close()
        took = time.monotonic() - t0
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    st = s.remote.stats()
    assert took < 3.0, took
    assert st["writes"] == 0 and st["dropped_writes"] == 2000
    assert st["queue_bytes"] == 0


def test_close_with_one_cluster_master_stopped_is_bounded(redis_cluster):
    s = make_store(redis_cluster.url, cpu_chunks=4096)
    keys, kvs = prompt(NS, 0, 2000)
    victim = redis_cluster.nodes[1]
    on_victim = sum(redis_cluster.node_for_key(rkey(k)) == 1 for k in keys)
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        assert s.put_chunks(NS, keys, kvs) == 2000
        t0 = time.monotonic()
        s.close()
        took = time.monotonic() - t0
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    st = s.remote.stats()
    assert took < 3.0, took
    assert st["writes"] == 2000 - on_victim
    assert st["dropped_writes_by_reason"] == {"unavailable": on_victim}


# ---- no password in any log line -----------------------------------------------------------
def test_no_log_record_at_debug_level_shows_the_password(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, redis-py's included
    with RedisServer(tmp_path, password="PWSECRET-77") as srv:
        url = f"redis://:PWSECRET-77@127.0.0.1:{srv.port}"
        with make_store(url) as a, make_store(f"redis://127.0.0.1:{srv.port}",
                                              remote_password="PWSECRET-77") as b:
            keys, kvs = prompt(NS, 0, 3)
            assert a.put_chunks(NS, keys, kvs) == 3 and a.flush(5.0)
            assert same(b.get_chunks(NS, keys), kvs)
            srv.kill()                       # failures, the breaker opening, dropped writes
            more, more_kvs = prompt(NS, 1, 3)
            a.put_chunks(NS, more, more_kvs)
            for _ in range(4):
                b.lookup_keys(NS, more)
            a.flush(5.0)
            assert a.clear(NS) == 6  # local chunks; Redis's part fails and is logged
            assert "PWSECRET" not in repr(a.config) + str(a.stats()) + str(b.stats())
    with pytest.raises(ValueError) as e:
        RemoteTier(url.replace("@", "@x"))   # unreachable now: the error names the address
    text = "\n".join(r.getMessage() for r in caplog.records) + str(e.value)
    assert "breaker open" in text and "PWSECRET" not in text

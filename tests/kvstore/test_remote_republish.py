"""A Redis node that restarts empty gets the chunks a store still holds locally written again
(``kvstore.republish``, noticed by ``kvstore.tiers.remote_restart``), so other hosts hit them
again; a node that only answers again with its data is asked, not written. Real Redis."""
import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from kvstore.api import LookupResult
from kvstore.tiers.remote_restart import RestartWatch
from tests.kvstore.remote_helpers import (NS, count, make_store, prompt, rkey, same, sample,
                                          wait_for)
from tests.redis_fixtures import redis_server  # noqa: F401




def _restart_empty(srv) -> None:
    srv.kill()
    srv.restart()  # same port, no persistence: empty, a new run_id


def test_a_restarted_empty_node_gets_the_local_chunks_again(redis_server, caplog):
    a = make_store(redis_server.url, remote_restart_check_s=0.05)
    b = make_store(redis_server.url, remote_restart_check_s=0)
    try:
        keys, kvs = prompt(NS, 0, 4)
        keys2, kvs2 = prompt(NS, 1, 3)
        assert a.put_chunks(NS, keys, kvs) == 4 and a.put_chunks(NS, keys2, kvs2) == 3
        assert a.flush(5.0)
        assert wait_for(lambda: a.remote.restarts.run_ids)  # the watch has seen the node once
        with redis_server.client() as r:
            assert r.dbsize() == 7
        with caplog.at_level(logging.INFO):
            _restart_empty(redis_server)
            assert wait_for(lambda: count(a.remote, "republished") == 7)
            a._st.republisher.join(5.0)
            assert a.flush(5.0)
        node = f"127.0.0.1:{redis_server.port}"
        assert count(a.remote, "node_restarts", node) == 1
        assert sample(a, "kvstore_remote_republished_total") == 7.0
        rep = a._st.republisher.reports[-1]
        assert (rep.held, rep.present, rep.written, rep.unknown) == (7, 0, 7, 0)
        assert any(f"node {node} restarted" in r.getMessage()
                   and "queued 7 chunks" in r.getMessage() for r in caplog.records)
        with redis_server.client() as r:
            assert r.dbsize() == 7 and all(r.exists(rkey(k)) for k in keys + keys2)
        # another host, with nothing local, hits them again, bit-exact
        assert b.lookup_keys(NS, keys) == LookupResult(4, 4, ("remote",) * 4, 4)
        assert same(b.get_chunks(NS, keys), kvs) and same(b.get_chunks(NS, keys2), kvs2)
        # A's own reads stayed local: the pass asked Redis without counting lookups
        assert count(a.remote, "lookups") == 0
        a.check_integrity()
    finally:
        a.close()
        b.close()


def test_only_what_redis_lacks_is_written_and_a_node_that_kept_its_data_gets_nothing(
        redis_server):
    a = make_store(redis_server.url, remote_restart_check_s=0)  # the test checks by hand
    try:
        keys, kvs = prompt(NS, 2, 5)
        assert a.put_chunks(NS, keys, kvs) == 5 and a.flush(5.0)
        watch = a.remote.restarts
        assert watch is None
        watch = RestartWatch(a.remote.nodes.primaries, a.remote.nodes.client, 3600.0,
                             a.remote._restarted)
        try:
            assert wait_for(lambda: watch.run_ids)
            assert watch.check() == []  # the same process: no restart
            writes = count(a.remote, "writes")
            # the node restarts, then gets two values back from elsewhere before the check
            with redis_server.client() as r:
                saved = {rkey(k): r.get(rkey(k)) for k in keys[:2]}
            _restart_empty(redis_server)
            with redis_server.client() as r:
                for rk, v in saved.items():
                    r.set(rk, v)
            assert watch.check() == [f"127.0.0.1:{redis_server.port}"]
            a._st.republisher.join(5.0)
            assert a.flush(5.0)
            rep = a._st.republisher.reports[-1]
            assert (rep.held, rep.present, rep.written) == (5, 2, 3)
            assert count(a.remote, "writes") == writes + 3
            with redis_server.client() as r:
                assert all(r.exists(rkey(k)) for k in keys)
            # a check with nothing changed does nothing more
            assert watch.check() == [] and len(a._st.republisher.reports) == 1
        finally:
            watch.close()
    finally:
        a.close()


def test_a_node_that_does_not_answer_is_skipped_and_bad_intervals_are_refused(redis_server):
    calls = []

    def client(node):
        raise RedisConnectionError("refused")

    watch = RestartWatch(lambda: ["n1"], client, 3600.0, calls.append)
    try:
        assert watch.check() == [] and watch.run_ids == {} and calls == []
    finally:
        watch.close()
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="restart check interval"):
            RestartWatch(lambda: [], client, bad, calls.append)
    with pytest.raises(ValueError, match="remote_restart_check_s"):
        make_store(redis_server.url, remote_restart_check_s=-1)


def test_a_cluster_master_restarted_empty_gets_back_only_its_own_keys(redis_cluster):
    a = make_store(redis_cluster.url, remote_restart_check_s=0.05)
    b = make_store(redis_cluster.url, remote_restart_check_s=0, remote_timeout_s=1.0)
    try:
        keys, kvs = prompt(NS, 3, 12)
        assert a.put_chunks(NS, keys, kvs) == 12 and a.flush(5.0)
        assert wait_for(lambda: len(a.remote.restarts.run_ids) == 3)
        dead = 1
        on_dead = [redis_cluster.node_for_key(rkey(k)) == dead for k in keys]
        assert 0 < sum(on_dead) < 12
        # a value another master no longer has (its TTL ran out, maxmemory evicted it) is that
        # master's business: the restart of another one does not write it back
        gone = next(k for k, d in zip(keys, on_dead) if not d)
        other = redis_cluster.node_for_key(rkey(gone))
        with redis_cluster.nodes[other].client() as r:
            assert r.unlink(rkey(gone)) == 1
        redis_cluster.kill_node(dead)
        redis_cluster.nodes[dead].restart()  # empty, the same slots
        redis_cluster.wait_ready()
        assert wait_for(lambda: a._st.republisher.reports, timeout=20.0)
        a._st.republisher.join(10.0)
        assert len(a._st.republisher.reports) == 1
        assert a.flush(10.0)
        rep = a._st.republisher.reports[-1]
        # only the restarted master's keys are asked, all of them missing
        assert (rep.held, rep.written, rep.present, rep.unknown) == (sum(on_dead),) * 2 + (0, 0)
        dead_name = "%s:%d" % redis_cluster.startup_nodes[dead]
        assert count(a.remote, "node_restarts", dead_name) == 1
        assert sum(count(a.remote, "node_restarts", "%s:%d" % hp)
                   for hp in redis_cluster.startup_nodes) == 1
        with redis_cluster.nodes[dead].client() as r:
            assert r.dbsize() == sum(on_dead)
        with redis_cluster.nodes[other].client() as r:
            assert not r.exists(rkey(gone))
        got = b.get_chunks(NS, keys)
        assert same([g for g, k in zip(got, keys) if k != gone],
                    [v for v, k in zip(kvs, keys) if k != gone])
    finally:
        a.close()
        b.close()


def test_a_second_host_finds_what_the_first_wrote_again_and_writes_nothing(redis_server):
    from kvstore.republish import republish
    a = make_store(redis_server.url, remote_restart_check_s=0)
    b = make_store(redis_server.url, remote_restart_check_s=0)
    try:
        keys, kvs = prompt(NS, 4, 6)
        assert a.put_chunks(NS, keys, kvs) == 6 and b.put_chunks(NS, keys, kvs) == 6
        assert a.flush(5.0) and b.flush(5.0)
        _restart_empty(redis_server)
        assert wait_for(lambda: a.remote.exists(keys[:1]) == [False])
        first = republish(a._st, "test")
        assert a.flush(5.0)
        second = republish(b._st, "test")
        assert (first.held, first.written, first.present) == (6, 6, 0)
        assert (second.held, second.written, second.present) == (6, 0, 6)
        assert count(b.remote, "republished") == 0
    finally:
        a.close()
        b.close()


def test_a_master_with_a_maxmemory_gets_only_the_hottest_chunks_that_fit(redis_server,
                                                                         monkeypatch):
    import kvstore.republish as republish_mod
    from kvstore.codec import HEADER_BYTES_MAX
    from kvstore.republish import hot_keys, redis_room, republish
    from tests.kvstore.remote_helpers import CB
    a = make_store(redis_server.url, remote_restart_check_s=0)
    node = f"127.0.0.1:{redis_server.port}"
    try:
        keys, kvs = prompt(NS, 5, 8)
        assert a.put_chunks(NS, keys, kvs) == 8 and a.flush(5.0)
        _restart_empty(redis_server)
        assert wait_for(lambda: a.remote.exists(keys[:1]) == [False])
        # what INFO memory tells: no maxmemory -> no limit; else the bytes left under it
        assert redis_room(a.remote, [node]) == {node: None}
        with redis_server.client() as r:
            used = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory", used + 100_000)
        # (used_memory moves by tens of KB with the clients connected: a loose window)
        assert 50_000 < redis_room(a.remote, [node])[node] < 150_000
        # room for 3 values: the 3 hottest are written, the 5 colder left out unread; the
        # hottest chunk is the prompt's tail (a read touches it last), and it goes after its
        # ancestors: what is written is the prompt's head, reachable
        with a._st.lock:
            hot = hot_keys(a._st)
        assert hot == keys
        monkeypatch.setattr(republish_mod, "redis_room",
                            lambda remote, nodes: {node: 3 * (CB + HEADER_BYTES_MAX)})
        rep = republish(a._st, "test", {node})
        assert (rep.held, rep.written, rep.no_room, rep.present) == (8, 3, 5, 0)
        assert a.flush(5.0)
        with redis_server.client() as r:
            assert [bool(r.exists(rkey(k))) for k in hot] == [True] * 3 + [False] * 5
    finally:
        a.close()


def test_the_watch_outlives_any_error_asking_a_node():
    """A node name the cluster client no longer knows (a topology change between the master
    list and the call) raised AttributeError out of the check and ended the watch's thread:
    no restart was noticed after it."""
    calls, answers = [], iter([AttributeError(
        "'NoneType' object has no attribute 'redis_connection'")])

    class Node:
        def info(self, section):
            return {"run_id": "b" * 40}

    def client(node):
        err = next(answers, None)
        if err is not None:
            raise err
        return Node()

    watch = RestartWatch(lambda: ["n1"], client, 0.02, calls.append)
    try:
        assert wait_for(lambda: watch.run_ids == {"n1": "b" * 40}, timeout=5.0)
        # (it had not answered the first check: first seen later, it is asked like a restart)
        assert watch._thread.is_alive() and wait_for(lambda: calls == ["n1"], timeout=5.0)
        watch.run_ids["n1"] = "a" * 40  # as if it had restarted since
        assert wait_for(lambda: calls == ["n1", "n1"], timeout=5.0)
    finally:
        watch.close()
    assert not watch._thread.is_alive()


def test_a_node_refusing_info_is_named_once_in_a_warning(redis_server, caplog):
    """INFO refused to a running store (an ACL changed under it: NOPERM) left every restart of
    that master unnoticed without a word: the refusal was skipped like a node down. (The
    store's open asks INFO too, so a user without it is refused there, by name.)"""
    with redis_server.client() as r:
        r.execute_command("ACL", "SETUSER", "kv", "on", ">pw", "~*", "+@all")
    url = redis_server.url.replace("redis://", "redis://kv:pw@")
    a = make_store(url, remote_restart_check_s=3600.0)
    try:
        assert wait_for(lambda: a.remote.restarts.run_ids)
        with redis_server.client() as r:
            r.execute_command("ACL", "SETUSER", "kv", "-info")
        with caplog.at_level(logging.WARNING, logger="kvstore.tiers.remote"):
            assert a.remote.restarts.check() == [] and a.remote.restarts.check() == []
        keys, kvs = prompt(NS, 6, 2)
        assert a.put_chunks(NS, keys, kvs) == 2 and a.flush(5.0)
        assert count(a.remote, "writes") == 2  # its data calls still work
    finally:
        a.close()
    lines = [r.getMessage() for r in caplog.records
             if "does not tell its run_id" in r.getMessage()]
    assert len(lines) == 1 and f"127.0.0.1:{redis_server.port}" in lines[0]


def test_the_pass_keeps_each_namespaces_codec_rule(redis_server):
    """With a lossy remote codec, a namespace that accepts it gets its chunks written with it
    again, and an exact one gets them exact, as on a put (the codec byte of each value)."""
    from kvstore.codec import CODECS
    from kvstore.keys import Namespace
    from kvstore.republish import republish
    from tests.kvstore.remote_helpers import LAY
    lossy = Namespace("remote-test-model", LAY, lossy_codec="int8")
    a = make_store(redis_server.url, remote_restart_check_s=0, remote_codec="int8")
    try:
        a.register(lossy)
        kl, vl = prompt(lossy, 7, 2)
        ke, ve = prompt(NS, 7, 2)
        assert a.put_chunks(lossy, kl, vl) == 2 and a.put_chunks(NS, ke, ve) == 2
        assert a.flush(5.0)

        def codecs():
            with redis_server.client() as r:
                return [CODECS[r.get(rkey(k))[6]] for k in kl + ke]

        assert codecs() == ["int8", "int8", "raw", "raw"]
        _restart_empty(redis_server)
        assert wait_for(lambda: a.remote.exists(kl[:1]) == [False])
        rep = republish(a._st, "test")
        assert (rep.held, rep.written) == (4, 4) and a.flush(5.0)
        assert codecs() == ["int8", "int8", "raw", "raw"]
    finally:
        a.close()


def test_a_master_first_seen_after_the_first_check_is_handled_as_a_restart():
    """A master the watch had not seen answer (down when the store opened, a replica promoted,
    a node replaced at a new address) was only recorded: if it came back empty, nothing
    was written again. It now gets a pass (which writes nothing to one that has its data)."""
    masters, up, calls = ["n1", "n3"], {"n1": "a" * 40}, []

    class Node:
        def __init__(self, name):
            self.name = name

        def info(self, section):
            if self.name not in up:
                raise RedisConnectionError("refused")
            return {"run_id": up[self.name]}

    watch = RestartWatch(lambda: list(masters), Node, 3600.0, calls.append)
    try:
        assert wait_for(lambda: watch._checks == 1)  # the first check, at the open: n3 is down
        assert watch.run_ids == {"n1": "a" * 40} and calls == []
        masters.append("n2")  # a replica promoted: a new master name
        up.update(n2="b" * 40, n3="c" * 40)  # and n3 answers at last
        assert watch.check() == ["n3", "n2"] and calls == ["n3", "n2"]
        assert watch.check() == [] and calls == ["n3", "n2"]
    finally:
        watch.close()

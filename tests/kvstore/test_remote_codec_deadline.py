"""The remote tier's deadline bounds the network wait only: decoding a lossy (``kivi``) value
that came in time is not charged to it, so a lookup that said "held" is followed by a get that
serves the chunk however slow the decode. A node that is really late (a stopped
``redis-server``) costs misses that are counted (``late``, ``kvstore_remote_late_total{op}``)
and warned about once per node and cause, with one INFO line when it answers in time again."""
import logging
import os
import signal
import time
from collections import Counter

import redis
import torch

import kvstore.kv_codec as kv_codec
from kvstore.codec import unpack_header, unpack_value
from tests.kvstore.remote_helpers import LAY, NS, count, make_tier, prompt, rkey

LOGGER = "kvstore.tiers.remote"


def _lines(caplog, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == level and text in r.getMessage()]


def _kivi_tier(url: str, **kw):
    t = make_tier(url, codec="kivi", **kw)
    t.lossy_codec_of = lambda ns_id: "kivi"
    return t


def _put(t, keys, kvs) -> None:
    assert all(t.put_behind(k, kv, p) for k, kv, p in zip(keys, kvs, [None] + keys[:-1]))
    assert t.flush(10.0)


def test_a_slow_kivi_decode_is_not_charged_to_the_deadline(redis_server, monkeypatch):
    t = _kivi_tier(redis_server.url, timeout_s=0.1)
    try:
        keys, kvs = prompt(NS, 0, 3)
        _put(t, keys, kvs)
        client = redis.Redis(port=redis_server.port)
        stored = [client.get(rkey(k)) for k in keys]
        assert [unpack_header(v).codec for v in stored] == ["kivi"] * 3
        # what each value decodes to (lossy: close to the chunk written, not equal)
        want = [torch.from_numpy(unpack_value(v, bytes(k))[1].copy()).view(torch.float16)
                .view(LAY.shape()) for k, v in zip(keys, stored)]
        assert all((w.float() - kv.float()).abs().max() < 0.1 for w, kv in zip(want, kvs))
        decode, slept = kv_codec.decode, []

        def slow_decode(*args, **kw):  # each decode takes 1.5 deadlines: 4.5 for the get
            time.sleep(0.15)
            slept.append(0.15)
            return decode(*args, **kw)

        monkeypatch.setattr(kv_codec, "decode", slow_decode)
        node = f"127.0.0.1:{redis_server.port}"
        for _ in range(3):  # (3 late calls would open the breaker)
            assert t.lookup(keys) == [True] * 3
            t0 = time.monotonic()
            got = t.get(keys, LAY)
            assert [g is not None for g in got] == [True] * 3
            assert time.monotonic() - t0 >= 0.45  # the decodes ran, past the 0.1 s deadline
            assert all(torch.equal(g[0], w) for g, w in zip(got, want))
            assert [g[1] for g in got] == [None] + keys[:-1]
        assert len(slept) == 9
        assert (count(t, "hits"), count(t, "misses"), count(t, "late")) == (9, 0, 0)
        assert t.nodes.breaker_states() == {node: "closed"}
        assert t.metrics.registry.get_sample_value(
            "kvstore_remote_late_total", {"op": "get"}) == 0
    finally:
        t.close()


def test_a_stopped_redis_costs_late_keys_counted_and_warned_once(redis_server, caplog):
    t = _kivi_tier(redis_server.url, timeout_s=0.2, breaker_threshold=10)
    node = f"127.0.0.1:{redis_server.port}"
    sample = t.metrics.registry.get_sample_value
    try:
        keys, kvs = prompt(NS, 0, 3)
        _put(t, keys, kvs)
        assert sample("kvstore_remote_late_total", {"op": "get"}) == 0  # (exported at 0)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                assert t.lookup(keys) == [False] * 3
                for _ in range(2):
                    t0 = time.monotonic()
                    assert t.get(keys, LAY) == [None] * 3
                    assert time.monotonic() - t0 < 0.2 + 0.4
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
            assert count(t, "late", "lookup") == 3 and count(t, "late", "get") == 6
            assert sample("kvstore_remote_late_total", {"op": "get"}) == 6
            assert sample("kvstore_remote_late_total", {"op": "lookup"}) == 3
            assert t.stats()["late_by_op"] == {"lookup": 3, "get": 6}
            warned = _lines(caplog, logging.WARNING, "did not answer")
            assert len(warned) == 2, warned  # once per cause: the lookup's, the gets' (one)
            assert f"node {node} did not answer a get of 3 keys" in warned[1]
            assert "kvstore_remote_late_total" in warned[1]
            # it answers in time again: one INFO line, then a new lateness is warned again
            got = t.get(keys, LAY)
            assert [g is not None for g in got] == [True] * 3
            back = _lines(caplog, logging.INFO, "answers within the deadline again")
            assert back == [f"remote tier: node {node} answers within the deadline again "
                            f"(3 late calls since it last did)"]
            t.late.causes.relog_interval_s = 0.0  # (a lateness after a recovery: logged at once)
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                assert t.get(keys, LAY) == [None] * 3
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
            assert len(_lines(caplog, logging.WARNING, "did not answer a get")) == 2
            assert count(t, "late", "get") == 9 and count(t, "misses") == 9
    finally:
        t.close()


def test_in_a_cluster_only_the_stopped_masters_keys_are_late(redis_cluster, monkeypatch, caplog):
    # a 0.5 s deadline: the live masters answer well within it on a loaded host (at 0.1 s
    # their first get was late at times under nice 19)
    t = _kivi_tier(redis_cluster.url, timeout_s=0.5, breaker_threshold=10)
    try:
        keys, kvs = prompt(NS, 2, 12)
        per_node = Counter(redis_cluster.node_for_key(rkey(k)) for k in keys)
        assert sorted(per_node) == [0, 1, 2]
        _put(t, keys, kvs)
        want = [g[0].clone() for g in t.get(keys, LAY)]
        decode = kv_codec.decode

        def slow_decode(*args, **kw):  # a live master's 5 values take 2 deadlines
            time.sleep(0.2)
            return decode(*args, **kw)

        monkeypatch.setattr(kv_codec, "decode", slow_decode)
        stopped = redis_cluster.nodes[0]
        with caplog.at_level(logging.INFO, logger=LOGGER):
            os.kill(stopped.proc.pid, signal.SIGSTOP)
            try:
                got = t.get(keys, LAY)
            finally:
                os.kill(stopped.proc.pid, signal.SIGCONT)
        on_stopped = [redis_cluster.node_for_key(rkey(k)) == 0 for k in keys]
        assert [g is None for g in got] == on_stopped
        assert all(torch.equal(g[0], w) for g, w in zip(got, want) if g is not None)
        assert count(t, "late", "get") == per_node[0]
        assert count(t, "misses") == per_node[0] and count(t, "hits") == 24 - per_node[0]
        warned = _lines(caplog, logging.WARNING, "did not answer")
        assert warned and all(f"node {stopped.host}:{stopped.port} " in w for w in warned)
    finally:
        t.close()

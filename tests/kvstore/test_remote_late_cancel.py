"""A node's pipeline that had not started by a call's deadline (the remote tier's worker pool
busy with other calls) is never sent afterwards: ``RedisNodes.run`` cancels it at the deadline,
before it waits for the ``post`` (decoding) of the nodes that answered in time. It was
cancelled only after that wait, so a worker freed meanwhile sent the late node's commands
anyway, results dropped: a Redis round trip and a pool thread spent on nothing, exactly when
the pool is saturated. Real 3-master Redis Cluster (``tests.redis_fixtures``)."""
import threading
import time

from kvstore.tiers import redis_nodes
from kvstore.tiers.redis_nodes import RedisNodes
from kvstore.tiers.redis_url import parse_redis_url
from tests.redis_fixtures import shared_redis_cluster  # noqa: F401 (fixture)

POOL = 32  # RedisNodes' worker threads


def _keys_on_two_nodes(nodes: RedisNodes) -> tuple[str, str, str, str]:
    """``(node_a, key_a, node_b, key_b)``: two keys whose masters differ."""
    first = nodes.node_of(b"late-cancel-0")
    for i in range(1, 1000):
        key = f"late-cancel-{i}"
        node = nodes.node_of(key.encode())
        if node != first:
            return first, "late-cancel-0", node, key
    raise AssertionError("no two keys on different masters")


def test_a_late_node_not_started_by_the_deadline_is_never_sent(shared_redis_cluster,  # noqa: F811
                                                               monkeypatch):
    nodes = RedisNodes(parse_redis_url(shared_redis_cluster.url, env={}), timeout_s=2.0,
                       breaker_threshold=100)
    release = threading.Event()
    closed = threading.Event()
    close = redis_nodes._CallState.close

    def close_and_tell(self, pending):  # the caller decided in time / late
        out = close(self, pending)
        closed.set()
        return out

    monkeypatch.setattr(redis_nodes._CallState, "close", close_and_tell)
    try:
        node_a, key_a, node_b, key_b = _keys_on_two_nodes(nodes)
        # every worker but one busy: node_a's pipeline gets the last one, node_b's waits
        blockers = [nodes._pool.submit(release.wait, 30) for _ in range(POOL - 1)]

        def post(node, results):  # node_a's decoding, past the deadline
            assert closed.wait(30)
            time.sleep(0.5)        # (the caller has handled the late nodes by now)
            release.set()          # the busy workers are free: node_b's call would start
            time.sleep(0.5)
            return results

        late: set[str] = set()
        out = nodes.run({node_a: [("SET", key_a, b"a")], node_b: [("INCR", key_b)]},
                        time.monotonic() + 2.0, post, late=late)
        assert out[node_a] == [True] and out[node_b] is None
        assert late == {node_b}
        for f in blockers:
            f.result(30)
        time.sleep(0.5)   # (a call of node_b's started late would be done by now)
        direct = nodes.cluster_client()   # (redis-py's cluster client, not the pool)
        assert direct.get(key_a) == b"a"
        assert direct.get(key_b) is None   # node_b's INCR was never sent
    finally:
        release.set()
        nodes.close()

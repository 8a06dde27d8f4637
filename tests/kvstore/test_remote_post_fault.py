"""A fault of ours while a node's values are checked (``post`` raising something other than a
Redis error) ends that node's part of ``RedisNodes.run`` as a miss, counted against its circuit
breaker, and never escapes ``run``: the call's other nodes are still settled, and a half-open
trial that hits it gets an outcome. Before, the exception escaped ``run``; a half-open
breaker whose trial it was stayed half-open with its trial taken, so the node was skipped for
good. Real Redis (``tests.redis_fixtures``)."""
import time

from kvstore.tiers.breaker import CLOSED, OPEN
from kvstore.tiers.redis_nodes import RedisNodes
from kvstore.tiers.redis_url import parse_redis_url
from tests.redis_fixtures import redis_server  # noqa: F401 (fixture)


def _boom(node, results):
    raise RuntimeError("decoder fault")


def test_a_post_fault_is_a_miss_and_a_breaker_failure(redis_server):  # noqa: F811
    now = [0.0]
    nodes = RedisNodes(parse_redis_url(redis_server.url, env={}), timeout_s=2.0,
                       breaker_threshold=1, breaker_reset_s=5.0, clock=lambda: now[0])
    try:
        node = nodes.node_of(b"k")
        cmds = {node: [("SET", "post-fault", b"v")]}
        for deadline in (None, time.monotonic() + 2.0):   # one node alone, and the pooled path
            nodes.breaker(node).success()
            out = nodes.run(cmds, deadline, _boom)
            assert out == {node: None}
            assert nodes.breaker(node).state == OPEN          # threshold 1: opened
        now[0] += 10.0                                        # past reset_s: half-open next
        out = nodes.run(cmds, time.monotonic() + 2.0, _boom)  # the trial meets the fault
        assert out == {node: None}
        assert nodes.breaker(node).state == OPEN              # an outcome: open again
        now[0] += 10.0
        out = nodes.run(cmds, time.monotonic() + 2.0, lambda n, r: r)
        assert out == {node: [True]}                          # the next trial goes through
        assert nodes.breaker(node).state == CLOSED
    finally:
        nodes.close()

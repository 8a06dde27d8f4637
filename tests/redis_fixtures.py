"""Pytest fixtures that start real Redis servers (``bench.redis_servers``).

    from tests.redis_fixtures import redis_server, redis_cluster  # noqa: F401

- ``redis_server``: a fresh standalone server in ``tmp_path`` (~0.1 s to start).
- ``redis_cluster``: a fresh 3-master cluster (~2-3 s: ``redis-cli --cluster create`` waits
  for the nodes to join); for tests that kill or restart nodes.
- ``shared_redis_cluster``: one 3-master cluster per test module, flushed before each test;
  for tests that do not kill, restart or reconfigure nodes.

Without ``redis-server`` these skip, except under ``CI=true`` where they fail with the install
hint (``require_redis``).
"""
from __future__ import annotations

import os

import pytest

from bench.redis_servers import INSTALL_HINT, RedisClusterGroup, RedisNotInstalled, RedisServer
from bench.redis_servers import redis_binary

_SHARED_CLUSTERS: dict[str, RedisClusterGroup] = {}


def require_redis() -> None:
    """Skip the calling test when ``redis-server``/``redis-cli`` are missing; under ``CI=true``
    fail it instead, with the install hint."""
    try:
        redis_binary("redis-server")
        redis_binary("redis-cli")
    except RedisNotInstalled as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{e} (CI=true: tests that need Redis fail without it)", pytrace=False)
        pytest.skip(f"redis-server not installed: {INSTALL_HINT}")


@pytest.fixture
def redis_server(tmp_path):
    """A started standalone ``RedisServer`` (no password, no memory limit), stopped after."""
    require_redis()
    with RedisServer(tmp_path) as srv:
        yield srv


@pytest.fixture
def redis_cluster(tmp_path):
    """A started 3-master ``RedisClusterGroup`` of its own, stopped after."""
    require_redis()
    with RedisClusterGroup(tmp_path, masters=3) as grp:
        yield grp


@pytest.fixture
def shared_redis_cluster(request, tmp_path_factory):
    """The test module's 3-master ``RedisClusterGroup``, empty (FLUSHALL on every node) at the
    start of each test; started on first use, stopped when the module's tests end. A test that
    killed a node gets it restarted (empty, same slots) before the next test uses the cluster."""
    require_redis()
    module = request.node.getparent(pytest.Module)
    grp = _SHARED_CLUSTERS.get(module.nodeid)
    if grp is None:
        grp = RedisClusterGroup(tmp_path_factory.mktemp("shared-redis-cluster")).start()
        _SHARED_CLUSTERS[module.nodeid] = grp
        module.addfinalizer(lambda: _SHARED_CLUSTERS.pop(module.nodeid).stop())
    for node in grp.nodes:
        if not node.alive:
            node.restart()
    grp.wait_ready()
    grp.flushall()
    yield grp

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

from bench.redis_cluster import RedisClusterGroup
from bench.redis_servers import INSTALL_HINT, RedisNotInstalled, RedisServer
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


def make_tls_files(folder) -> dict:
    """Test certificates made with the ``openssl`` command in ``folder``: a CA (``ca``), a
    server certificate for 127.0.0.1 signed by it (``cert``, ``key``), a client certificate
    signed by it (``client_cert``, ``client_key``) and an unrelated CA (``other_ca``); paths
    as strings. Skips the calling test without ``openssl`` (fails it under ``CI=true``)."""
    import shutil
    import subprocess
    from pathlib import Path
    if shutil.which("openssl") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("openssl not found (CI=true: the TLS tests need it)", pytrace=False)
        pytest.skip("openssl not found")
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    for ca in ("ca", "other_ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out",
            f"{ca}.crt", "-days", "2", "-subj", f"/CN=kvstore-test-{ca}")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "127.0.0.1"), ("client", "kvstore-test-client")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={cn}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", "ext.cnf")
    return {"ca": str(d / "ca.crt"), "cert": str(d / "server.crt"), "key": str(d / "server.key"),
            "client_cert": str(d / "client.crt"), "client_key": str(d / "client.key"),
            "other_ca": str(d / "other_ca.crt")}


@pytest.fixture
def tls_redis_server(tmp_path):
    """A started standalone ``RedisServer`` that speaks TLS only (certificates from
    ``make_tls_files``, in ``.tls_files``), stopped after."""
    require_redis()
    files = make_tls_files(tmp_path / "tls")
    with RedisServer(tmp_path, tls=(files["cert"], files["key"], files["ca"])) as srv:
        srv.tls_files = files
        yield srv

"""``kvstore serve --host ::1`` prints and serves a usable URL, ``http://[::1]:PORT`` (it printed
``http://::1:PORT``, which no client parses); ``ThreadedServer.url`` and the "cannot listen"
error bracket an IPv6 literal too."""
from __future__ import annotations

import socket

import pytest
import torch

from kvstore.daemon import cli
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.run import http_url
from kvstore.daemon.server import ThreadedServer, create_app
from kvstore.daemon.transport import check_url
from tests.kvstore.daemon.server_helpers import KEYS, NS, chunk, make_store
from tests.kvstore.daemon.test_cli import TOKEN, Daemon


def test_http_url_brackets_ipv6_literals_only():
    assert http_url("::1", 8500) == "http://[::1]:8500"
    assert http_url("fe80::1%eth0", 1) == "http://[fe80::1%eth0]:1"
    assert http_url("127.0.0.1", 8500) == "http://127.0.0.1:8500"
    assert http_url("localhost", 80) == "http://localhost:80"


def test_kvstore_serve_on_ipv6_loopback_prints_a_url_a_client_takes(tmp_path):
    d = Daemon(tmp_path / "log", "--host", "::1", "--cpu-bytes", "1MiB", "--page-bytes", "256")
    try:
        assert d.url == f"http://[::1]:{d.port}" and check_url(d.url) == d.url
        with KVStoreClient(d.url, auth_token=TOKEN, timeout_s=10) as c:
            assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
            assert torch.equal(c.get_chunks(NS, KEYS[1:2])[0], chunk(1))
    finally:
        assert d.stop() == 0


def test_threaded_server_url_and_listen_error_bracket_ipv6(capsys):
    store = make_store()
    srv = ThreadedServer(create_app(store), host="::1")
    try:
        assert srv.url == f"http://[::1]:{srv.port}"
        with KVStoreClient(srv.url, timeout_s=10) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(3)]) == 1
        assert cli.main(["serve", "--host", "::1", "--port", str(srv.port),
                         "--cpu-bytes", "1MiB"]) == 2  # in use
        err = capsys.readouterr().err
        assert f"cannot listen on [::1]:{srv.port}: " in err, err
    finally:
        srv.stop()
        store.close()


@pytest.fixture(autouse=True)
def _needs_ipv6():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")

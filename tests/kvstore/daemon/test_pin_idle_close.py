"""A ``pin``/``unpin`` whose pooled same-host connection the daemon closes to make room at its
connection cap just after the pool found it alive: the send fails, the daemon never read the
request, and the call goes on on a fresh connection, applied once (a real ``kvstore serve``
at ``--max-connections 1``; the closing is made to happen inside ``ShmConnPool._take``, after
its ``alive()`` check). A call the daemon may have read is still not made twice."""
from __future__ import annotations

import errno
import http.client
import select
import socket
import time

import pytest

from kvstore.daemon import shm_pool
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.errors import StoreUnavailable
from tests.kvstore.daemon.hostile_helpers import metric
from tests.kvstore.daemon.serve_proc import free_port, start, stop
from tests.kvstore.daemon.server_helpers import NS, chunk

KEYS = NS.chunk_keys(list(range(4 * 2)))
EVICTED = "kvstore_server_connections_closed_total{reason=\"idle_evicted_same_host\"}"


@pytest.fixture()
def daemon(tmp_path):
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc = start(port, sock, ["--max-connections", "1"])
    try:
        yield port, sock
    finally:
        stop(proc)


def _closed_by_peer(conn, timeout: float = 10.0) -> bool:
    """Wait until the daemon has closed ``conn``'s socket (end-of-file readable)."""
    if not select.select([conn.sock], [], [], timeout)[0]:
        return False
    return conn.sock.recv(1, socket.MSG_PEEK) == b""


def _evict_after_alive(client: ShmKVStoreClient, port: int, opened: list) -> None:
    """On the client's next ``_take``: after the pool's own ``alive()`` check passed, an HTTP
    connection arrives at the full cap and the daemon closes the pooled idle one."""
    take = client._take

    def racing_take(deadline):
        conn = take(deadline)
        client._take = take  # once
        h = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        h.request("GET", "/healthz")  # keep-alive: this connection holds the one slot
        assert h.getresponse().read() is not None
        opened.append(h)
        assert _closed_by_peer(conn), "the daemon did not close the idle connection"
        return conn
    client._take = racing_take


def _pinned(client: ShmKVStoreClient) -> int:
    return client.stats()["num_pinned_chunks"]


@pytest.mark.parametrize("op", ["pin", "unpin"])
def test_a_pin_sent_on_a_just_evicted_connection_is_made_once(daemon, op):
    port, sock = daemon
    opened: list = []
    c = ShmKVStoreClient(sock, pool_size=1, timeout_s=10)
    try:
        assert c.put_chunks(NS, KEYS, [chunk(0), chunk(1)]) == 2
        if op == "unpin":
            assert c.pin(NS, KEYS[:1], lease_s=60) == 1
        assert _pinned(c) == (1 if op == "unpin" else 0)
        _evict_after_alive(c, port, opened)
        if op == "pin":
            assert c.pin(NS, KEYS, lease_s=60) == 2  # was StoreUnavailable
            assert _pinned(c) == 2
            assert c.unpin(NS, KEYS) == 2  # one pin each: the pin was made once
            assert _pinned(c) == 0
        else:
            assert c.unpin(NS, KEYS[:1]) == 1
            assert _pinned(c) == 0
        status = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        status.request("GET", "/metrics")
        assert metric(status.getresponse().read().decode(), EVICTED) >= 1
        status.close()
    finally:
        for h in opened:
            h.close()
        c.close()


class _FakeConn:
    """What ``never_read`` reads of a ``Conn``: its read-ahead bounds."""

    def __init__(self, received: int) -> None:
        self._rpos, self._rend = 0, received


def test_never_read_only_when_no_reply_byte_and_the_daemon_left_bytes_unread():
    assert shm_pool.never_read(_FakeConn(0), BrokenPipeError(errno.EPIPE, "send"))
    assert shm_pool.never_read(_FakeConn(0), ConnectionResetError(errno.ECONNRESET, "recv"))
    # end-of-file: the daemon may have read the request and acted on it
    assert not shm_pool.never_read(_FakeConn(0), ConnectionError("daemon closed"))
    # a reply had begun: the daemon read the request
    assert not shm_pool.never_read(_FakeConn(5), ConnectionResetError(errno.ECONNRESET, "x"))


def test_a_unix_socket_closed_with_bytes_unread_resets_its_peer():
    """The kernel behaviour ``never_read`` relies on: closed with our bytes unread, the peer
    reads ``ECONNRESET``; closed after reading them all, end-of-file."""
    for unread in (True, False):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        a.sendall(b"request")
        if not unread:
            assert b.recv(64) == b"request"
        b.close()
        a.settimeout(5)
        if unread:
            with pytest.raises(ConnectionResetError):
                a.recv(1)
        else:
            assert a.recv(1) == b""
        a.close()


def test_a_pin_whose_reply_never_came_is_not_retried(daemon, monkeypatch):
    """A pin the daemon read (end-of-file after the whole request went out) still raises
    ``StoreUnavailable``: it may have been applied."""
    port, sock = daemon
    c = ShmKVStoreClient(sock, pool_size=1, timeout_s=10)
    try:
        assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1
        conn = c._take(time.monotonic() + 10)

        def eof(deadline):
            raise ConnectionError("daemon closed the connection")
        monkeypatch.setattr(conn, "reply", eof)
        c._give(conn)
        with pytest.raises(StoreUnavailable, match="not retried"):
            c.pin(NS, KEYS[:1], lease_s=60)
        assert _pinned(c) == 1  # it was applied: a retry would have made it twice
        assert c.unpin(NS, KEYS[:1]) == 1
    finally:
        c.close()

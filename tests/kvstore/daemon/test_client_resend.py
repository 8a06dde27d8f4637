"""Which calls an ``http://`` ``KVStoreClient`` makes again after its discovered socket failed:
one the socket client never sent (``SocketGone`` with ``sent=False``: no socket file, or the
socket refuses) goes at once to the path the daemon offers now; one that was sent and is not
idempotent (pin) is never sent again. Real ``kvstore serve`` processes (``test_client_rediscover``
starts them) and an in-process daemon; tiny layout (``server_helpers``)."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from kvstore.daemon import shm_conn
from kvstore.daemon.client import KVStoreClient, StoreUnavailable
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_errors import SocketGone
from tests.kvstore.daemon.server_helpers import NS, chunk
from tests.kvstore.daemon.shm_helpers import shm_daemon
from tests.kvstore.daemon.test_client_rediscover import KEYS, free_port, start, stop


def spy_rediscover(monkeypatch) -> list:
    """The errors ``KVStoreClient._rediscover`` is called with, in order."""
    seen = []
    orig = KVStoreClient._rediscover

    def spy(self, failed, error, timeout_s):
        seen.append(error)
        return orig(self, failed, error, timeout_s)
    monkeypatch.setattr(KVStoreClient, "_rediscover", spy)
    return seen


def is_op(header, op: str) -> bool:
    """Whether ``Conn.request``'s ``header`` (a dict, or a frame: preamble then JSON with
    ``"op"`` first) is a request of ``op``."""
    if isinstance(header, dict):
        return header.get("op") == op
    return bytes(header[8:8 + 8 + len(op)]) == b'{"op":"%s"' % op.encode()


def requests_of(metrics: str, route: str) -> int:
    """Requests the daemon counted for ``route`` (every status), from its /metrics text."""
    return sum(int(float(n)) for n in re.findall(
        r'kvstore_server_requests_total\{route="%s",status="\d+"\} (\S+)' % re.escape(route),
        metrics))


def metrics_once(c: KVStoreClient, route: str, n: int) -> str:
    """The daemon's /metrics text once it counts ``n`` requests of ``route`` (a socket
    request is counted just after its reply is sent), or after 5 s."""
    t0 = time.monotonic()
    while True:
        text = c.metrics_text()
        if requests_of(text, route) >= n or time.monotonic() - t0 > 5:
            return text
        time.sleep(0.05)


def test_the_socket_client_says_whether_a_call_was_sent(tmp_path):
    """Nothing listens at the path: each call raises ``SocketGone`` saying nothing was sent,
    with the message users saw before; pin and unpin are not idempotent, the others are."""
    with ShmKVStoreClient(str(tmp_path / "none.sock"), timeout_s=2.0) as u:
        with pytest.raises(SocketGone) as e:
            u.exists(NS, KEYS[:1])
        assert (e.value.sent, e.value.idempotent, e.value.resendable) == (False, True, True)
        assert str(e.value) == (f"exists unix://{tmp_path}/none.sock: no such socket file "
                                "(2 tries); is the kvstore daemon running?")
        assert isinstance(e.value, StoreUnavailable)
        with pytest.raises(SocketGone) as e:
            u.pin(NS, KEYS[:1])
        assert (e.value.sent, e.value.idempotent, e.value.resendable) == (False, False, True)


def test_an_idempotent_call_sent_before_the_socket_went_says_it_was_sent(tmp_path, monkeypatch):
    """The connection breaks after a lookup was sent and the socket file is gone when the
    lookup is tried again: ``SocketGone`` says it was sent (only its idempotence lets a
    ``KVStoreClient`` make it again elsewhere)."""
    orig = shm_conn.Conn.request

    def sent_then_broken(self, header, deadline, payload=()):
        if is_op(header, "lookup"):
            orig(self, header, deadline, payload)
            os.unlink(srv.sock_path)
            raise ConnectionResetError("the connection broke after the request was sent")
        return orig(self, header, deadline, payload)
    with shm_daemon(tmp_path) as srv:
        with ShmKVStoreClient(srv.sock_path, timeout_s=2.0) as u:
            assert u.exists(NS, KEYS[:1]) == [False]
            monkeypatch.setattr(shm_conn.Conn, "request", sent_then_broken)
            with pytest.raises(SocketGone, match="no such socket file") as e:
                u.lookup_keys(NS, KEYS[:1])
            assert (e.value.sent, e.value.idempotent, e.value.resendable) == (True, True, True)


@pytest.mark.parametrize("how, why", [(signal.SIGTERM, "no such socket file"),
                                      (signal.SIGKILL, "connection refused")])
def test_a_call_that_sent_nothing_goes_over_http_at_once(tmp_path, monkeypatch, how, why):
    """Restarted without its socket (SIGKILL leaves a stale file that refuses): the first
    call after the restart is not lost, it is made over HTTP, once."""
    seen = spy_rediscover(monkeypatch)
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc = start(port, sock)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            stop(proc, how)
            proc = start(port, None)
            assert c.put_chunks(NS, KEYS[1:2], [chunk(1)]) == 1   # no StoreUnavailable
            assert c.transport == "http" and len(seen) == 1
            assert isinstance(seen[0], SocketGone) and seen[0].sent is False
            assert why in str(seen[0])
            assert c.stats()["tiers"]["cpu"]["num_chunks"] == 1   # the new daemon's put
            assert requests_of(c.metrics_text(), "/v1/put") == 1      # sent to it once
            assert torch.equal(c.get_chunks(NS, KEYS[1:2])[0], chunk(1))
    finally:
        stop(proc)


def test_a_call_that_sent_nothing_goes_to_the_new_socket_at_once(tmp_path, monkeypatch):
    seen = spy_rediscover(monkeypatch)
    port, first, second = free_port(), str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    proc = start(port, first)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            stop(proc)
            proc = start(port, second)
            assert c.pin(NS, KEYS[:1]) == 0          # not stored in the new daemon: pins none
            assert c._shm.path == second and len(seen) == 1 and seen[0].sent is False
            assert c.put_chunks(NS, KEYS[1:2], [chunk(1)]) == 1
            assert c.pin(NS, KEYS[1:2]) == 1
            metrics = metrics_once(c, "shm_pin", 2)
            assert requests_of(metrics, "shm_pin") == 2 and requests_of(metrics, "/v1/pin") == 0
    finally:
        stop(proc)


def test_a_pin_that_was_sent_is_never_sent_again(tmp_path, monkeypatch):
    """The daemon took the pin, then the connection broke before the reply was read: the
    call fails (``StoreUnavailable``, not ``SocketGone``), with no re-discovery and no second
    pin, over the socket or over HTTP."""
    seen = spy_rediscover(monkeypatch)
    orig = shm_conn.Conn.request

    def sent_then_broken(self, header, deadline, payload=()):
        out = orig(self, header, deadline, payload)
        if is_op(header, "pin"):
            # the daemon read the whole frame and took the pin, then closed without a reply:
            # an end of file (a reset would mean bytes of ours left unread: never read, retried)
            raise ConnectionError("daemon closed the connection")
        return out
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc = start(port, sock)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=5.0) as c:
            assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1 and c.transport == "unix"
            monkeypatch.setattr(shm_conn.Conn, "request", sent_then_broken)
            with pytest.raises(StoreUnavailable, match="failed after sending; not retried") as e:
                c.pin(NS, KEYS[:1])
            assert not isinstance(e.value, SocketGone) and seen == []
            monkeypatch.setattr(shm_conn.Conn, "request", orig)
            metrics = metrics_once(c, "shm_pin", 1)
            assert requests_of(metrics, "shm_pin") == 1 and requests_of(metrics, "/v1/pin") == 0
            assert c.transport == "unix" and c.pin(NS, KEYS[:1]) == 1   # the path still works
    finally:
        stop(proc)

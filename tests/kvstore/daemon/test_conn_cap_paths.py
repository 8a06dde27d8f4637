"""One connection cap for HTTP and the same-host path (``kvstore.daemon.conns``), against a real
``kvstore serve`` (``serve_proc``): idle same-host connections holding every slot no longer
lock HTTP clients out (an HTTP newcomer closes the one idle longest), a same-host connection
holding borrowed arena pages is never closed, and a same-host client whose idle connection
was closed goes on transparently on its next call, losing and duplicating nothing.
Tiny layout (``server_helpers``: 256-byte chunks, one 256-byte page each).
"""
from __future__ import annotations

import contextlib
import http.client
import time

import torch

from kvstore.daemon.shm_client import ShmKVStoreClient
from tests.kvstore.daemon.hostile_helpers import metric
from tests.kvstore.daemon.serve_proc import free_port, start, stop
from tests.kvstore.daemon.server_helpers import NS, chunk

KEYS = NS.chunk_keys(list(range(4 * 6)))  # 6 chained chunk keys
CLOSED = "kvstore_server_connections_closed_total{reason=\"%s\"}"


def http_get(port: int, path: str) -> tuple[int, str]:
    """One HTTP GET on a connection of its own (closed after the answer): status, body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def resident(port: int) -> int:
    """Chunks the daemon holds in all its tiers, from /v1/stats."""
    import json
    status, body = http_get(port, "/v1/stats")
    assert status == 200, body
    return sum(t["num_chunks"] for t in json.loads(body)["tiers"].values())


@contextlib.contextmanager
def daemon(tmp_path, cap: int):
    """A ``kvstore serve`` with the same-host path and ``--max-connections cap``: (port,
    socket path)."""
    port, sock = free_port(), str(tmp_path / "kv.sock")
    proc = start(port, sock, ["--max-connections", str(cap)])
    try:
        yield port, sock
    finally:
        stop(proc)


def client(sock: str) -> ShmKVStoreClient:
    """A same-host client keeping one idle connection."""
    return ShmKVStoreClient(sock, pool_size=1, timeout_s=10)


def settle() -> None:
    """Let deferred releases reach the daemon (``shm_release``: within milliseconds)."""
    time.sleep(0.3)


def test_idle_same_host_clients_do_not_lock_http_out(tmp_path):
    """Four same-host clients, each with an idle pooled connection, held every slot of a cap
    of 4, and every HTTP client was answered 503 until one of them closed. Now an HTTP
    client is answered 200: the same-host connection idle longest is closed (counted), and
    its client's next put and get go on, on a new connection, with no chunk lost or stored
    twice."""
    kvs = [chunk(i) for i in range(6)]
    with daemon(tmp_path, 4) as (port, sock):
        clients = [client(sock) for _ in range(4)]
        try:
            assert clients[0].put_chunks(NS, KEYS[:3], kvs[:3]) == 3  # idle longest
            for c in clients[1:]:
                assert c.lookup_keys(NS, KEYS).num_hit_chunks == 3
            settle()
            assert http_get(port, "/healthz")[0] == 200  # was 503
            status, text = http_get(port, "/metrics")
            assert status == 200
            assert metric(text, CLOSED % "idle_evicted_same_host") == 1
            assert metric(text, CLOSED % "refused_busy") == 0
            # the closed connection's client: its next calls reconnect, nothing retried twice
            assert clients[0].put_chunks(NS, KEYS[3:], kvs[3:]) == 3
            got = clients[0].get_chunks(NS, KEYS)
            assert all(torch.equal(g, kv) for g, kv in zip(got, kvs))
            settle()
            assert resident(port) == 6  # (closes the next idle longest: clients[1]'s)
            assert clients[1].lookup_keys(NS, KEYS).num_hit_chunks == 6  # reconnects too
            settle()
            status, text = http_get(port, "/metrics")  # (closes clients[2]'s)
            assert metric(text, CLOSED % "idle_evicted_same_host") == 3
            assert metric(text, CLOSED % "refused_busy") == 0
        finally:
            for c in clients:
                c.close()


def test_a_same_host_connection_holding_a_borrow_is_not_closed(tmp_path):
    """Cap 2: a same-host client holding a borrow and an idle one. An HTTP client closes the
    idle one, never the borrower (whose views still read the chunks, on a connection still
    open); with both holding borrows an HTTP client is refused 503; once a borrow is
    released, HTTP is served again."""
    kvs = [chunk(i) for i in range(2)]
    with daemon(tmp_path, 2) as (port, sock):
        a, b = client(sock), client(sock)
        try:
            assert a.put_chunks(NS, KEYS[:2], kvs) == 2
            settle()
            held = a.get_borrowed(NS, KEYS[:2])
            assert b.lookup_keys(NS, KEYS[:2]).num_hit_chunks == 2
            settle()
            assert http_get(port, "/healthz")[0] == 200  # b's idle connection made room
            assert held._conn.alive()  # a's connection is open
            assert all(torch.equal(torch.cat(p), kv.reshape(-1).view(torch.uint8))
                       for p, kv in zip(held.parts, kvs))
            other = b.get_borrowed(NS, KEYS[:1])  # b reconnects transparently
            assert torch.equal(torch.cat(other.parts[0]), kvs[0].reshape(-1).view(torch.uint8))
            assert http_get(port, "/healthz")[0] == 503  # every connection holds a borrow
            assert held._conn.alive() and other._conn.alive()
            held.release()
            assert a.exists(NS, KEYS[:1]) == [True]  # (its release goes first, same socket)
            assert http_get(port, "/healthz")[0] == 200  # a's connection is idle again
            assert torch.equal(torch.cat(other.parts[0]), kvs[0].reshape(-1).view(torch.uint8))
            other.release()
            settle()
            status, text = http_get(port, "/metrics")
            assert status == 200
            assert metric(text, CLOSED % "idle_evicted_same_host") == 2  # b's, then a's
            assert metric(text, CLOSED % "refused_busy") == 1
            assert [t.shape for t in a.get_chunks(NS, KEYS[:2])] == [kv.shape for kv in kvs]
        finally:
            a.close()
            b.close()

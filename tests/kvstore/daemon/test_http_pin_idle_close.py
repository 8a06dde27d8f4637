"""A ``pin``/``unpin`` sent over HTTP on a pooled keep-alive connection that the daemon closed
an instant before (its keep-alive timeout ran out while the client's event loop was busy, so
the client had not seen the close): the daemon never read the request, and the call is sent
once more on a new connection, applied once (a real ``kvstore serve`` at ``--idle-timeout-s
0.5``). What the retry rule decides from (``never_read``) is checked on its own: a failure on a
new connection, or after the answer's headers, is not retried."""
from __future__ import annotations

import asyncio
import errno
import http.client
import time
from types import SimpleNamespace

import aiohttp
import pytest

from kvstore.daemon.async_client import AsyncKVStoreClient
from kvstore.daemon.transport import never_read
from tests.kvstore.daemon.hostile_helpers import metric
from tests.kvstore.daemon.serve_proc import free_port, start, stop
from tests.kvstore.daemon.server_helpers import NS, chunk

KEYS = NS.chunk_keys(list(range(4 * 2)))
IDLE_S = 0.5


@pytest.fixture()
def port():
    p = free_port()
    proc = start(p, None, ["--idle-timeout-s", str(IDLE_S)])
    try:
        yield p
    finally:
        stop(proc)


def _open_connections(port: int) -> float:
    """The daemon's open connections, asked on a connection of its own (counted)."""
    h = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        h.request("GET", "/metrics")
        return metric(h.getresponse().read().decode(), "kvstore_server_connections")
    finally:
        h.close()


async def _scenario(port: int, op: str) -> list[int]:
    c = AsyncKVStoreClient(f"http://127.0.0.1:{port}", pool_size=1, timeout_s=10)
    try:
        assert await c.put_chunks(NS, KEYS, [chunk(0), chunk(1)]) == 2
        if op == "unpin":
            assert await c.pin(NS, KEYS[:1], lease_s=60) == 1
        pinned = [(await c.stats())["num_pinned_chunks"]]   # the pooled connection: idle now
        # the event loop is blocked: the daemon's keep-alive close is not seen by the client
        deadline = time.monotonic() + 10
        while _open_connections(port) != 1:   # only the asking one: the pooled one closed
            assert time.monotonic() < deadline, "the daemon did not close the idle connection"
            time.sleep(IDLE_S / 2)
        if op == "pin":
            assert await c.pin(NS, KEYS, lease_s=60) == 2   # was StoreUnavailable
        else:
            assert await c.unpin(NS, KEYS[:1]) == 1
        pinned.append((await c.stats())["num_pinned_chunks"])
        if op == "pin":
            assert await c.unpin(NS, KEYS) == 2   # one pin each: the pin was made once
            pinned.append((await c.stats())["num_pinned_chunks"])
        return pinned
    finally:
        await c.close()


@pytest.mark.parametrize("op", ["pin", "unpin"])
def test_a_pin_sent_on_a_keep_alive_connection_closed_just_before_is_made_once(port, op):
    pinned = asyncio.run(_scenario(port, op))
    assert pinned == ([0, 2, 0] if op == "pin" else [1, 0])


def test_never_read_only_on_a_reused_connection_without_an_answer():
    reused = SimpleNamespace(reused=True, answered=False)
    assert never_read(reused, aiohttp.ServerDisconnectedError())
    assert never_read(reused, aiohttp.ClientOSError(errno.ECONNRESET, "reset"))
    assert never_read(reused, aiohttp.ClientOSError(errno.EPIPE, "broken pipe"))
    assert never_read(reused, aiohttp.ClientConnectionResetError("closing transport"))
    # another failure: not the daemon's close of an idle connection
    assert not never_read(reused, aiohttp.ClientOSError(errno.ETIMEDOUT, "timed out"))
    assert not never_read(reused, aiohttp.ClientPayloadError("cut"))
    # a new connection: the daemon may have read it (then died)
    assert not never_read(SimpleNamespace(reused=False, answered=False),
                          aiohttp.ServerDisconnectedError())
    # the answer's headers came: the daemon read the request
    assert not never_read(SimpleNamespace(reused=True, answered=True),
                          aiohttp.ServerDisconnectedError())


def test_the_cap_evicts_only_a_connection_waiting_for_a_request_with_none_received():
    """A request aiohttp parsed (queued, or its handler woken) but whose middleware has not
    begun is not idle: closing then would serve it with its answer lost."""
    from collections import deque

    from prometheus_client import CollectorRegistry

    from kvstore.daemon.conns import ConnectionGuard, _Conn

    class Handler:   # what is read of aiohttp's RequestHandler
        def __init__(self, messages, waiter) -> None:
            self._messages, self._waiter = deque(messages), waiter

    async def run() -> list:
        loop = asyncio.get_running_loop()
        guard = ConnectionGuard(CollectorRegistry(), max_connections=1)
        waiting = Handler([], loop.create_future())
        woken = Handler([("request", None)], loop.create_future())
        woken._waiter.set_result(None)
        starting = Handler([], None)  # popped, its middleware not begun
        out = []
        for inner in (waiting, woken, starting):
            conn = _Conn(inner, guard)
            conn.served = 1
            guard._conns = {inner: conn}
            out.append(guard._idle_victim() is conn)
        return out
    assert asyncio.run(run()) == [True, False, False]

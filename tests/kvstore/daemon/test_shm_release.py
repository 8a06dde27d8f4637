"""Deferred releases of the same-host client (``kvstore.daemon.shm_release``): a get's
``release`` rides on the connection's next request (or its put's descriptor message), and a
connection left idle is flushed by the client's thread within its delay; the daemon's pins
always drop. Tiny layout: 256-byte chunks (``shm_helpers``)."""
from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch

from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_release import ReleaseFlusher
from tests.kvstore.daemon.shm_helpers import KEYS, NS, chunk, num_pinned, shm_daemon, wait_until


def slow_flusher(c: ShmKVStoreClient) -> None:
    """Give ``c`` a flusher that waits an hour: only requests carry releases then."""
    c._releases.close()
    c._releases = ReleaseFlusher(c._take_idle, c._give, delay_s=3600.0)


def test_release_rides_on_the_next_request(tmp_path):
    with shm_daemon(tmp_path) as srv, ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
        slow_flusher(c)
        kvs = [chunk(i) for i in range(3)]
        assert c.put_chunks(NS, KEYS[:3], kvs) == 3
        got = c.get_chunks(NS, KEYS[:3])
        assert all(torch.equal(g, kv) for g, kv in zip(got, kvs))
        conn = c._idle[-1]
        assert conn.has_pending
        time.sleep(0.2)  # the daemon got no release: its pins stay
        assert num_pinned(srv.store) == 3
        assert c.lookup_keys(NS, KEYS[:4]).num_hit_chunks == 3  # the same connection
        assert not conn.has_pending and c._idle == [conn]
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        # a borrowed get's release is deferred the same way
        with c.get_borrowed(NS, KEYS[:2]) as b:
            assert num_pinned(srv.store) == 2 and len(b.parts) == 2
        time.sleep(0.2)
        assert num_pinned(srv.store) == 2 and conn.has_pending
        c.pin(NS, [KEYS[2]])  # any request carries it
        assert wait_until(lambda: num_pinned(srv.store) == 1)  # the pin of KEYS[2] only
        srv.store.check_integrity()


def test_release_goes_ahead_of_a_staged_put(tmp_path):
    """A put through the staging area first passes a new area (a request, then its memfd in
    a message of its own): the deferred release goes ahead of both."""
    with shm_daemon(tmp_path) as srv, \
            ShmKVStoreClient(srv.sock_path, timeout_s=5.0, vm_put=False) as c:
        slow_flusher(c)
        assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1
        c.get_chunks(NS, KEYS[:1])
        conn = c._idle[-1]
        assert conn.has_pending and conn.staging is not None  # the area passed already
        conn.staging.close()  # the next put passes a new area (a descriptor message)
        conn.staging = None
        kvs = [chunk(i) for i in range(1, 4)]
        assert c.put_chunks(NS, KEYS[1:4], kvs) == 3
        assert not conn.has_pending and conn.staging is not None
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[1:4]), kvs))


def test_an_idle_connection_is_flushed_within_its_delay(tmp_path):
    with shm_daemon(tmp_path) as srv, ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
        assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
        t0 = time.monotonic()
        c.get_chunks(NS, KEYS[:2])
        assert wait_until(lambda: num_pinned(srv.store) == 0, timeout=2.0)
        assert time.monotonic() - t0 < 1.0  # default delay: 5 ms plus a wake-up
        assert len(c._idle) == 1 and not c._idle[0].has_pending  # flushed, back in the pool


def test_close_drops_deferred_pins(tmp_path):
    with shm_daemon(tmp_path) as srv:
        c = ShmKVStoreClient(srv.sock_path, timeout_s=5.0)
        slow_flusher(c)
        assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
        c.get_chunks(NS, KEYS[:2])
        assert num_pinned(srv.store) == 2
        c.close()
        assert wait_until(lambda: num_pinned(srv.store) == 0)


class FakeConn:
    def __init__(self, fail: bool = False):
        self.pending_since, self.sent, self.closed, self.fail = 0.0, 0, False, fail
        self._pending: list[bytes] = []

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def defer(self, frame: bytes) -> None:
        if not self._pending:
            self.pending_since = time.monotonic()
        self._pending.append(frame)

    def flush(self, deadline: float) -> None:
        if self.fail:
            raise ConnectionError("gone")
        self.sent += len(self._pending)
        self._pending = []

    def close(self) -> None:
        self.closed = True


def test_flusher_waits_for_the_newest_release_skips_busy_and_closes_failed():
    idle: list[FakeConn] = []
    given: list[FakeConn] = []

    def take(conn) -> bool:
        if conn in idle:
            idle.remove(conn)
            return True
        return False
    f = ReleaseFlusher(take, given.append, delay_s=0.05)
    try:
        a, busy, bad = FakeConn(), FakeConn(), FakeConn(fail=True)
        for conn in (a, busy, bad):
            conn.defer(b"r1")
        idle += [a, bad]
        for conn in (a, busy, bad):
            f.note(conn)
        time.sleep(0.03)
        a.defer(b"r2")  # not newer: pending_since stays the first one's
        assert wait_until(lambda: a.sent == 2, timeout=2.0)
        assert given == [a] and idle == []
        assert busy.has_pending and busy.sent == 0  # in use: left to its caller
        assert wait_until(lambda: bad.closed, timeout=2.0)  # (flushed after a: no order)
        assert bad not in given
        # a release deferred after a flush waits its own delay
        idle.append(a)
        a.defer(b"r3")
        f.note(a)
        assert a.sent == 2
        assert wait_until(lambda: a.sent == 3, timeout=2.0)
    finally:
        f.close()
    with pytest.raises(ValueError):
        ReleaseFlusher(take, given.append, delay_s=0)


def test_a_client_dropped_without_close_is_collected(tmp_path):
    """The flusher's thread holds the client weakly: a client dropped after a get is collected
    (its connections close, which drops any pins left) and the thread ends."""
    with shm_daemon(tmp_path) as srv:
        c = ShmKVStoreClient(srv.sock_path, timeout_s=5.0)
        assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
        c.get_chunks(NS, KEYS[:2])
        thread = c._releases._thread
        assert thread is not None and thread.is_alive()
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        ref = weakref.ref(c)
        del c
        gc.collect()
        assert ref() is None
        thread.join(2.0)
        assert not thread.is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_flushes_its_own_releases(tmp_path):
    """A child forked after the parent's flusher started has no such thread: its first deferred
    release starts one, so the daemon's pins drop while the child is still alive and idle."""
    with shm_daemon(tmp_path) as srv, ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
        assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
        c.get_chunks(NS, KEYS[:2])
        assert wait_until(lambda: num_pinned(srv.store) == 0)  # the parent's thread ran
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one get, then idle for 3 s
            code = 1
            try:
                os.close(r)
                got = c.get_chunks(NS, KEYS[:2])
                code = 0 if torch.equal(got[1], chunk(1)) else 2
                os.write(w, b"x")
                time.sleep(3.0)
            finally:
                os._exit(code)
        os.close(w)
        try:
            assert os.read(r, 1) == b"x"
            assert wait_until(lambda: num_pinned(srv.store) == 0, timeout=2.0)
        finally:
            os.close(r)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


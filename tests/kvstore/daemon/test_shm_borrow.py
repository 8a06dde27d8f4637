"""Borrowed gets of the same-host client (``ShmKVStoreClient.get_borrowed``,
``KVStoreClient.get_borrowed``): views of the daemon's read-only arena, bit-exact, reader-pinned
until released on every path (release, an exception in a ``with`` block, a failed
connection, a killed client), untouched by removal and eviction meanwhile; lower-tier chunks
inline; the HTTP path's copied borrow. Tiny layout: 256-byte chunks, 256-byte pages
(``shm_helpers``)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.shm_borrow import ArenaBorrow, CopiedBorrow
from kvstore.daemon.shm_client import ShmKVStoreClient
from tests.kvstore.daemon.shm_helpers import (CB, KEYS, NS, as_bytes, chunk, make_store,
                                              num_pinned, shm_daemon, wait_until)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
OTHER_PROMPT = NS.chunk_keys([1000 + t for t in range(4 * 16)])  # 16 keys of another prompt


def part_bytes(parts) -> bytes:
    return b"".join(p.numpy().tobytes() for p in parts)


def in_arena(c: ShmKVStoreClient, t: torch.Tensor) -> bool:
    """Whether ``t`` lies inside the client's mapping of the daemon's arena (a view, no copy)."""
    arena = c._arenas["current"].tensor()
    lo = arena.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() <= lo + arena.numel()


def test_borrowed_gets_are_arena_views_bit_exact_pinned_until_release(tmp_path):
    with shm_daemon(tmp_path) as srv, ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
        kvs = [chunk(i) for i in range(3)]
        assert c.put_chunks(NS, KEYS[:3], kvs) == 3
        b = c.get_borrowed(NS, KEYS[:4])
        assert isinstance(b, ArenaBorrow) and b.lower == [] and b.keys == KEYS[:4]
        assert [part_bytes(p) for p in b.parts[:3]] == [as_bytes(kv) for kv in kvs]
        assert b.parts[3] is None
        assert all(in_arena(c, t) for p in b.parts[:3] for t in p)
        assert num_pinned(srv.store) == 3 and srv.store.pin_count(KEYS[0]) == 1
        assert not c._arenas["current"].array.flags.writeable  # views of a PROT_READ mapping
        assert len(c._idle) == 0  # the borrow holds its connection
        b.release()
        assert b.parts == [None] * 4
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        assert len(c._idle) == 1  # back in the pool after release
        b.release()  # idempotent
        assert c.get_borrowed(NS, []).parts == []
        # the connection goes on: a plain get after the borrow
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[:3]), kvs))
        srv.store.check_integrity()


def test_an_exception_while_borrowed_releases_the_pins(tmp_path):
    with shm_daemon(tmp_path) as srv, ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
        c.put_chunks(NS, KEYS[:2], [chunk(1), chunk(2)])
        with pytest.raises(KeyError):
            with c.get_borrowed(NS, KEYS[:2]) as b:
                assert num_pinned(srv.store) == 2
                raise KeyError("scatter failed")
        assert b.released and wait_until(lambda: num_pinned(srv.store) == 0)
        # a connection broken before release: closing it drops the pins in the daemon
        b = c.get_borrowed(NS, KEYS[:2])
        assert num_pinned(srv.store) == 2
        b._conn.sock.close()
        b.release()  # never raises
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        # the release, deferred, fails on the dead connection, which leaves the pool
        assert wait_until(lambda: len(c._idle) == 0)
        srv.store.check_integrity()


def test_removal_and_eviction_during_a_borrowed_read_keep_its_bytes(tmp_path):
    """16 pages: two borrowed chunks are removed, then 16 new chunks are put (14 fit, never
    in the borrowed pages); the views still read the borrowed chunks until release."""
    with shm_daemon(tmp_path) as srv, ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c, \
            ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as other:
        kvs = [chunk(1), chunk(2)]
        c.put_chunks(NS, KEYS[:2], kvs)
        with c.get_borrowed(NS, KEYS[:2]) as b:
            assert other.remove(NS, KEYS[:2]) == 2
            assert other.exists(NS, KEYS[:2]) == [False, False]
            new = [chunk(100 + i) for i in range(16)]
            assert other.put_chunks(NS, OTHER_PROMPT, new) == 14
            assert [part_bytes(p) for p in b.parts] == [as_bytes(kv) for kv in kvs]
            got = other.get_chunks(NS, OTHER_PROMPT)
            assert sum(g is not None and torch.equal(g, kv) for g, kv in zip(got, new)) == 14
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        assert srv.store.tiers[0].used_bytes == 14 * CB  # the removed chunks' pages are free
        srv.store.check_integrity()


def test_lower_tier_chunks_arrive_inline_in_a_borrow(tmp_path):
    """A 4-chunk CPU tier over disk: of 8 chunks put, the 4 oldest are on disk and come in
    the reply (new tensors); the rest are arena views."""
    store = make_store(4 * CB, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 20)
    with shm_daemon(tmp_path, store) as srv, \
            ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
        kvs = [chunk(20 + i) for i in range(8)]
        assert c.put_chunks(NS, KEYS, kvs) == 8
        assert c.lookup_keys(NS, KEYS).hits_by_tier == {"cpu": 4, "disk": 4}
        with c.get_borrowed(NS, KEYS) as b:
            assert [part_bytes(p) for p in b.parts] == [as_bytes(kv) for kv in kvs]
            views = [all(in_arena(c, t) for t in p) for p in b.parts]
            assert 0 < sum(views) < 8  # some inline (disk), some views (cpu)
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        srv.store.check_integrity()


KILLED_BORROWER = textwrap.dedent("""
    import sys, time
    from kvstore.daemon.shm_client import ShmKVStoreClient
    from tests.kvstore.daemon.shm_helpers import KEYS, NS
    c = ShmKVStoreClient(sys.argv[1], timeout_s=5.0)
    b = c.get_borrowed(NS, KEYS[:3])
    print(sum(sum(t.numel() for t in p) for p in b.parts), flush=True)
    time.sleep(60)  # "scattering": killed here, the borrow never released
""")


def test_a_client_killed_while_borrowing_releases_its_pins(tmp_path):
    with shm_daemon(tmp_path) as srv, ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
        c.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)])
        proc = subprocess.Popen([sys.executable, "-c", KILLED_BORROWER, srv.sock_path],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": ROOT})
        try:
            assert proc.stdout.readline().split() == [str(3 * CB)]
            assert num_pinned(srv.store) == 3
        finally:
            proc.kill()
            proc.wait(10)
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        srv.store.check_integrity()


def test_kvstore_client_borrows_on_the_socket_and_copies_over_http(tmp_path):
    from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
    store = make_store()
    srv = ThreadedServer(create_app(store, ServerLimits()), unix_socket=str(tmp_path / "s"))
    try:
        kvs = [chunk(5), chunk(6)]
        with KVStoreClient(srv.url, timeout_s=5.0) as http, \
                KVStoreClient(srv.url, timeout_s=5.0, same_host=False) as forced:
            assert http.put_chunks(NS, KEYS[:2], kvs) == 2
            with http.get_borrowed(NS, KEYS[:3]) as b:  # discovers the socket: arena views
                assert http.transport == "unix" and isinstance(b, ArenaBorrow)
                assert [part_bytes(p) for p in b.parts[:2]] == [as_bytes(kv) for kv in kvs]
                assert b.parts[2] is None and num_pinned(store) == 2
            assert wait_until(lambda: num_pinned(store) == 0)
            with forced.get_borrowed(NS, KEYS[:3]) as b:  # HTTP: the chunks copied out
                assert forced.transport == "http" and isinstance(b, CopiedBorrow)
                assert [part_bytes(p) for p in b.parts[:2]] == [as_bytes(kv) for kv in kvs]
                assert b.parts[2] is None  # nothing stays pinned in the daemon:
                assert wait_until(lambda: num_pinned(store) == 0)
    finally:
        srv.stop()
        store.close()

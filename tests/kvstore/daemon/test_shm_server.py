"""The daemon's same-host path (``kvstore.daemon.shm_server``) against the contract of
``kvstore.daemon.shm_protocol``, with a minimal client of its own (``shm_helpers.RawClient``):
the arena handed over read-only and sealed, bit-exact puts and gets, lower-tier chunks inline,
pins owned by the connection, removal and eviction under a borrow, and the socket itself.

256-byte chunks in 256-byte pages; the arena is 16 pages unless a test says otherwise.
"""
import ctypes
import errno
import fcntl
import json
import mmap
import os
import stat
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from kvstore.tiers.cpu import ARENA_SEALS
from tests.kvstore.daemon.shm_helpers import (CB, KEYS, NS, RawClient, arena_array, as_bytes,
                                              chunk, make_store, num_pinned, shm_daemon,
                                              wait_until)

OTHER_PROMPT = NS.chunk_keys([1000 + t for t in range(4 * 16)])  # 16 keys of another prompt


def http_json(srv, path):
    with urllib.request.urlopen(f"{srv.url}{path}", timeout=10) as r:
        return json.loads(r.read())


def test_hello_hands_over_a_sealed_arena_that_maps_only_read_only(tmp_path):
    with shm_daemon(tmp_path) as srv:
        assert stat.S_IMODE(os.stat(srv.sock_path).st_mode) == 0o600
        c = RawClient(srv.sock_path)
        reply = c.hello()
        stats = http_json(srv, "/v1/stats")
        with urllib.request.urlopen(f"{srv.url}/healthz", timeout=10) as r:
            limits = r.headers   # the same request limits as every HTTP answer names
        assert reply == {"ok": True, "version": 3, "instance": stats["instance"],
                         "arena_bytes": 16 * CB, "page_bytes": 256,
                         "tenant": {"name": "anonymous", "role": "admin", "salt": None},
                         "vm_read": False,   # no vm_probe in this hello
                         "max_body_bytes": int(limits["X-KVStore-Max-Body-Bytes"]),
                         "max_batch_keys": int(limits["X-KVStore-Max-Batch-Keys"]),
                         "tier_codecs": stats["tier_codecs"],
                         "wire_codecs": stats["wire_codecs"]}
        assert reply["max_body_bytes"] > 0 and reply["max_batch_keys"] > 0
        assert stats["unix_socket"] == srv.sock_path and srv.unix_url == f"unix://{srv.sock_path}"
        assert fcntl.fcntl(c.arena_fd, fcntl.F_GET_SEALS) == ARENA_SEALS
        with pytest.raises(TypeError):
            c.arena[0:1] = b"x"  # the client's mapping is read-only
        with pytest.raises(PermissionError):
            mmap.mmap(c.arena_fd, 16 * CB)  # nor can it map it writable
        # nor can mprotect lift the mapping to writable (the seal took VM_MAYWRITE away)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        addr = arena_array(c).ctypes.data
        assert libc.mprotect(addr, 16 * CB, mmap.PROT_READ | mmap.PROT_WRITE) == -1
        assert ctypes.get_errno() == errno.EACCES
        # reopening the descriptor through /proc for writing gets nowhere: the seal
        fd = os.open(f"/proc/self/fd/{c.arena_fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.write(fd, b"x")
            with pytest.raises(PermissionError):
                mmap.mmap(fd, 16 * CB)
        finally:
            os.close(fd)
        c.close()


def test_put_then_get_is_bit_exact_through_the_arena(tmp_path):
    """A put over the socket lands in the arena; a get answers where it lies (runs) and the
    client's copy equals what was put, byte for byte; HTTP serves the same bytes."""
    with shm_daemon(tmp_path) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        kvs = [chunk(i) for i in range(3)]
        assert c.put(KEYS[:3], kvs) == {"ok": True, "stored": 3, "num_chunks": 3,
                                        "durable": False, "already_stored": 0, "refused": 0,
                                        "first_refused": None}
        assert c.put(KEYS[:3], kvs)["stored"] == 0  # stored already: nothing new
        assert c.keys_op("lookup", KEYS[:4]) == {"ok": True, "num_hit_chunks": 3, "chunk_size": 4,
                                                 "tiers": ["cpu"] * 3, "num_requested_chunks": 4}
        assert c.keys_op("exists", KEYS[:4]) == {"ok": True, "exists": [True] * 3 + [False]}
        reply, got = c.get(KEYS[:4])
        assert reply["borrow"] == 1 and reply["payload_bytes"] == 0
        assert [len(ch["runs"]) for ch in reply["chunks"][:3]] == [1, 1, 1]
        assert reply["chunks"][3] is None and got[3] is None
        assert got[:3] == [as_bytes(kv) for kv in kvs]
        # the runs are the tier's own
        tier = srv.store.tiers[0]
        assert [ch["runs"] for ch in reply["chunks"][:3]] == \
            [[list(r) for r in tier.entry_runs(k)] for k in KEYS[:3]]
        c.release(reply["borrow"])
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        srv.store.check_integrity()
        c.close()


def test_chunks_of_lower_tiers_come_inline(tmp_path):
    """A CPU tier of 2 chunks over a disk tier: prompt A's 2 chunks spill to disk when prompt
    B's arrive; a get of all 4 answers B's as arena runs and A's inline, bit-exact."""
    store = make_store(cpu_bytes=2 * CB, disk_bytes=1 << 20, disk_path=str(tmp_path / "disk"),
                       promote_on_hit=False)
    with shm_daemon(tmp_path, store) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        a, b = KEYS[:2], OTHER_PROMPT[:2]
        kv_a, kv_b = [chunk(1), chunk(2)], [chunk(3), chunk(4)]
        assert c.put(a, kv_a)["stored"] == 2 and c.put(b, kv_b)["stored"] == 2
        assert srv.store.flush(10)
        assert c.keys_op("lookup", a)["tiers"] == ["disk", "disk"]
        reply, got = c.get(list(a) + list(b))
        assert reply["chunks"][:2] == [{"inline": CB}, {"inline": CB}]
        assert all("runs" in ch for ch in reply["chunks"][2:])
        assert reply["payload_bytes"] == 2 * CB
        assert got == [as_bytes(kv) for kv in kv_a + kv_b]
        c.release(reply["borrow"])
        # only lower-tier chunks: nothing stays borrowed
        reply, got = c.get(a)
        assert reply["borrow"] is None and got == [as_bytes(kv) for kv in kv_a]
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        srv.store.check_integrity()
        c.close()


def test_pins_last_until_release_then_drop_to_zero(tmp_path):
    with shm_daemon(tmp_path) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        c.put(KEYS[:2], [chunk(1), chunk(2)])
        r1, _ = c.get(KEYS[:2])
        r2, _ = c.get(KEYS[:1])
        assert (r1["borrow"], r2["borrow"]) == (1, 2)
        assert num_pinned(srv.store) == 2 and srv.store.pin_count(KEYS[0]) == 2
        c.release(r1["borrow"])
        assert wait_until(lambda: srv.store.pin_count(KEYS[0]) == 1)
        assert num_pinned(srv.store) == 1
        c.release(r1["borrow"])  # twice: ignored
        c.release(12345)  # unknown: ignored (no reply), the connection goes on
        assert c.keys_op("exists", KEYS[:1])["exists"] == [True]
        assert srv.store.pin_count(KEYS[0]) == 1
        c.release(r2["borrow"])
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        # a borrow left open is released when the client disconnects
        r3, _ = c.get(KEYS[:2])
        assert num_pinned(srv.store) == 2
        c.close()
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        srv.store.check_integrity()


KILLED_CLIENT = textwrap.dedent("""
    import sys, time
    from tests.kvstore.daemon.shm_helpers import RawClient, KEYS
    c = RawClient(sys.argv[1])
    c.hello()
    reply, got = c.get(KEYS[:3])
    print(reply["borrow"], sum(len(g) for g in got), flush=True)
    time.sleep(60)  # "reading": killed here
""")


def test_client_killed_mid_read_releases_its_pins(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    with shm_daemon(tmp_path) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        c.put(KEYS[:3], [chunk(i) for i in range(3)])
        proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, srv.sock_path],
                                stdout=subprocess.PIPE, text=True, cwd=root,
                                env={**os.environ, "PYTHONPATH": root})
        try:
            assert proc.stdout.readline().split() == ["1", str(3 * CB)]
            assert num_pinned(srv.store) == 3
            proc.kill()
            proc.wait(10)
        finally:
            proc.kill()
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        srv.store.check_integrity()
        # the pages are free again: 16 fit
        c.put(KEYS[3:], [chunk(i) for i in range(3, 8)])
        assert c.put(OTHER_PROMPT[:8], [chunk(100 + i) for i in range(8)])["stored"] == 8
        c.close()


def test_removal_and_eviction_under_a_borrow_leave_its_bytes_intact(tmp_path):
    """A borrowed chunk that is removed, and an arena under put pressure, keep the borrowed
    pages: the client still reads what it was given, and the pages come back only at
    release."""
    with shm_daemon(tmp_path) as srv:
        c, other = RawClient(srv.sock_path), RawClient(srv.sock_path)
        c.hello()
        other.hello(map_arena=False)
        kvs = [chunk(1), chunk(2)]
        c.put(KEYS[:2], kvs)
        reply, got = c.get(KEYS[:2])
        assert got == [as_bytes(kv) for kv in kvs]
        assert other.keys_op("remove", KEYS[:2]) == {"ok": True, "removed": 2}
        assert other.keys_op("exists", KEYS[:2])["exists"] == [False, False]
        # 14 free pages: a put of 16 new chunks evicts what it can and drops the rest;
        # never the borrowed pages
        put = other.put(OTHER_PROMPT[:16], [chunk(100 + i) for i in range(16)])
        assert put["stored"] == 14 and put["refused"] == 2
        assert put["first_refused"] == {"index": 14, "key": OTHER_PROMPT[14].hex(),
                                        "reason": "no_room"}
        again = [b"".join(c.arena[o:o + n] for o, n in ch["runs"]) for ch in reply["chunks"]]
        assert again == [as_bytes(kv) for kv in kvs]
        c.release(reply["borrow"])
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        assert srv.store.tiers[0].used_bytes == 14 * 256  # the removed chunks' pages are free
        srv.store.check_integrity()
        c.close()
        other.close()

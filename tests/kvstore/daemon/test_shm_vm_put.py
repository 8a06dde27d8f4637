"""Puts the daemon reads straight from the client's memory (protocol version 3,
``kvstore.daemon.shm_vm``): established by ``hello``'s probe, bit-exact, refused cleanly for
bad ranges, another pid or a kernel that says no, with the client falling back to staging."""
import errno
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvstore.daemon import protocol as P
from kvstore.daemon import shm_protocol as S
from kvstore.daemon import shm_vm
from kvstore.daemon.shm_client import ShmKVStoreClient
from tests.kvstore.daemon.shm_helpers import (CB, KEYS, NS, RawClient, as_bytes, chunk,
                                              make_store, shm_daemon)

pytestmark = pytest.mark.skipif(not shm_vm.available(), reason="no process_vm_readv here")


def vm_hello(c: RawClient, probe: bytearray | None = None, **override) -> dict:
    """Hello with a ``vm_probe`` of ``probe`` (made here when None), fields overridable."""
    probe = probe if probe is not None else bytearray(os.urandom(16))
    vp = {"address": shm_vm.address_of(probe), "hex": probe.hex(), **override}
    c.send({"op": "hello", "version": 3, "token": None, "vm_probe": vp})
    reply, _ = c.recv([])
    return reply


def vm_put(c: RawClient, keys, kvs, ranges=None, **extra) -> dict:
    """A put whose bytes the daemon reads from ``kvs``' memory (``ranges`` overrides)."""
    views = [P.tensor_bytes(kv) for kv in kvs]
    vm = ranges if ranges is not None else [[shm_vm.address_of(v), v.nbytes] for v in views]
    chunks = [{"key": k.hex(), "nbytes": CB, "dtype": "float16", "shape": list(kv.shape)}
              for k, kv in zip(keys, kvs)]
    head = {"op": "put", "namespace": NS.to_dict(), "chunks": chunks, "vm": vm,
            "pid": os.getpid(), **extra}
    reply = c.call(head)[0]
    del views  # (kept alive until the reply)
    return reply


def test_a_put_is_read_from_the_clients_memory_bit_exact(tmp_path, monkeypatch):
    reads = []
    real = shm_vm.vm_read
    monkeypatch.setattr(shm_vm, "vm_read", lambda pid, l, r: reads.append(len(r)) or
                        real(pid, l, r))
    with shm_daemon(tmp_path) as d, ShmKVStoreClient(d.sock_path, timeout_s=5) as c:
        kvs = [chunk(i) for i in range(5)]
        assert c.put_chunks(NS, KEYS[:5], kvs) == 5
        conn = c._idle[0]
        assert conn.hello.version == 3 and conn.hello.vm_read
        assert conn.staging is None and not conn.vm_refused  # no staging area was made
        assert reads[0] == 1 and reads[1:] == [5]  # the probe, then the put's 5 ranges
        assert [as_bytes(g) for g in d.store.get_chunks(NS, KEYS[:5])] == \
            [as_bytes(kv) for kv in kvs]
        # a non-contiguous tensor goes from its contiguous copy, kept alive for the read
        odd = chunk(5).transpose(0, 1).contiguous().transpose(0, 1)
        assert not odd.is_contiguous()
        assert c.put_chunks(NS, [KEYS[5]], [odd]) == 1
        assert torch.equal(c.get_chunks(NS, [KEYS[5]])[0], odd)
        d.store.check_integrity()


def test_hello_establishes_reads_only_when_the_probe_reads_back(tmp_path):
    with shm_daemon(tmp_path) as d:
        for override, want in (({}, True), ({"hex": "00" * 16}, False),
                               ({"address": 8}, False), ({"hex": "zz"}, False),
                               ({"hex": "ab" * 65}, False), ({"address": -1}, False),
                               ({"address": "1"}, False)):
            c = RawClient(d.sock_path)
            reply = vm_hello(c, **override)
            assert reply["ok"] and reply["version"] == 3 and reply["vm_read"] is want, override
            c.close()
        c = RawClient(d.sock_path)  # version 2: no vm fields at all
        c.send({"op": "hello", "version": 2, "token": None, "vm_probe": {"address": 1}})
        reply, _ = c.recv([])
        assert reply["version"] == 2 and "vm_read" not in reply
        c.close()


def test_a_vm_put_without_established_reads_is_refused_and_stores_nothing(tmp_path):
    with shm_daemon(tmp_path) as d:
        c = RawClient(d.sock_path)
        c.send({"op": "hello", "version": 3, "token": None})  # no probe
        assert c.recv([])[0]["vm_read"] is False
        r = vm_put(c, KEYS[:2], [chunk(0), chunk(1)])
        assert r["status"] == 403 and "vm_read false" in r["error"]
        assert d.store.exists(NS, KEYS[:2]) == [False, False]
        assert c.keys_op("lookup", KEYS[:2])["ok"]  # the stream goes on
        c.close()


def test_bad_vm_puts_get_clear_errors_and_store_nothing(tmp_path):
    with shm_daemon(tmp_path) as d:
        c = RawClient(d.sock_path)
        assert vm_hello(c)["vm_read"]
        kv = chunk(0)
        addr = shm_vm.address_of(P.tensor_bytes(kv))
        page = os.sysconf("SC_PAGE_SIZE")
        cases = [
            ([[addr, CB - 1]], {}, 400, "bad vm range"),
            ([[addr, CB], [addr, CB]], {}, 400, "one [address, nbytes] per chunk"),
            ([[page, CB]], {}, 400, "not readable"),                  # unmapped memory
            ([[-5, CB]], {}, 400, "bad vm range"),
            ("x", {}, 400, "one [address, nbytes] per chunk"),
            (None, {"pid": os.getpid() + 1}, 403, "connected"),     # another process's
            (None, {"staging_offset": 0}, 400, "no staging_offset"),
        ]
        for ranges, extra, status, words in cases:
            r = vm_put(c, KEYS[:1], [kv], ranges=ranges, **extra)
            assert r["status"] == status and words in r["error"], (ranges, extra, r)
            assert d.store.exists(NS, KEYS[:1]) == [False]
        r = vm_put(c, KEYS[:1], [kv])  # and the connection still serves a good one
        assert r["ok"] and r["stored"] == 1
        assert as_bytes(d.store.get_chunks(NS, KEYS[:1])[0]) == as_bytes(kv)
        c.close()


def test_a_range_running_into_unreadable_memory_stores_nothing(tmp_path):
    """The read falls short (the kernel copies what it can): refused whole, no chunk of the
    batch stored, the reservations given back. The second range starts 16 bytes before a page
    made unreadable (``PROT_NONE``, kept mapped so that nothing else lands there)."""
    import ctypes
    import mmap
    page = os.sysconf("SC_PAGE_SIZE")
    mm = mmap.mmap(-1, 2 * page)
    mm.write(b"\1" * (2 * page))
    base = shm_vm.address_of(mm)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + page), ctypes.c_size_t(page), 0) == 0
    try:
        with shm_daemon(tmp_path) as d:
            c = RawClient(d.sock_path)
            assert vm_hello(c)["vm_read"]
            keep = chunk(0)
            good = [shm_vm.address_of(P.tensor_bytes(keep)), CB]
            r = vm_put(c, KEYS[:2], [keep, chunk(1)], ranges=[good, [base + page - 16, CB]])
            assert r["status"] == 400 and f"read {CB + 16} of {2 * CB} bytes" in r["error"], r
            assert d.store.exists(NS, KEYS[:2]) == [False, False]
            assert d.store.stats()["tiers"]["cpu"]["used_bytes"] == 0  # reservations given back
            d.store.check_integrity()
            c.close()
    finally:
        libc.mprotect(ctypes.c_void_p(base + page), ctypes.c_size_t(page), 3)
        mm.close()


def test_the_client_puts_from_staging_when_the_kernel_refuses_the_read(tmp_path, monkeypatch):
    with shm_daemon(tmp_path) as d, ShmKVStoreClient(d.sock_path, timeout_s=5) as c:
        assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1  # reads established and working

        def refuse(pid, local, remote):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        monkeypatch.setattr(shm_vm, "vm_read", refuse)
        kvs = [chunk(i) for i in range(1, 4)]
        assert c.put_chunks(NS, KEYS[1:4], kvs) == 3
        conn = c._idle[0]
        assert conn.vm_refused and conn.staging is not None
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[1:4]), kvs))
        assert c.put_chunks(NS, KEYS[4:5], [chunk(4)]) == 1  # staging from then on
        assert torch.equal(c.get_chunks(NS, [KEYS[4]])[0], chunk(4))


def test_a_client_in_another_process_than_the_one_that_connected_uses_staging(tmp_path):
    """A forked child holding its parent's pooled connection must not have the daemon read
    the parent's memory at the child's addresses: the client puts from staging then."""
    with shm_daemon(tmp_path) as d, ShmKVStoreClient(d.sock_path, timeout_s=5) as c:
        assert c.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1
        conn = c._idle[0]
        conn.pid = -1  # as seen from a child: the connection was made by another process
        assert c.put_chunks(NS, KEYS[1:3], [chunk(1), chunk(2)]) == 2
        assert conn.staging is not None
        assert torch.equal(c.get_chunks(NS, [KEYS[2]])[0], chunk(2))


def test_a_vm_put_with_no_room_in_memory_goes_to_the_disk_tier(tmp_path):
    store = make_store(cpu_bytes=2 * CB, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 20)
    with shm_daemon(tmp_path, store=store) as d:
        c = RawClient(d.sock_path)
        assert vm_hello(c)["vm_read"]
        assert vm_put(c, KEYS[:2], [chunk(0), chunk(1)])["stored"] == 2
        assert store.pin(NS, KEYS[:2]) == 2  # the CPU tier: all pinned
        r = vm_put(c, KEYS[2:3], [chunk(2)])
        assert r["ok"] and r["stored"] == 1
        assert store.tiers[1].contains(KEYS[2]) and not store.tiers[0].contains(KEYS[2])
        assert as_bytes(store.get_chunks(NS, KEYS[2:3])[0]) == as_bytes(chunk(2))
        store.unpin(NS, KEYS[:2])
        c.close()


def test_a_durable_vm_put_is_on_disk_when_answered(tmp_path):
    store = make_store(disk_path=str(tmp_path / "disk"), disk_bytes=1 << 20)
    with shm_daemon(tmp_path, store=store) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5) as c:
        kvs = [chunk(i) for i in range(3)]
        assert c.put_chunks(NS, KEYS[:3], kvs, durable=True) == 3
        assert c._idle[0].hello.vm_read and c._idle[0].staging is None
        assert all(store.tiers[1].contains(k) for k in KEYS[:3])
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[:3]), kvs))


def test_a_vm_put_read_into_one_array_counts_it_in_the_payload_budget(tmp_path, monkeypatch):
    """A durable vm put reads the whole put into one new array (``read_all``): that memory
    is held in the payload budget (``--max-inflight-bytes``) while the put runs and given back
    after, so N such puts cannot take N x max_body_bytes."""
    from kvstore.daemon.server import STATE_KEY
    seen = []
    real = shm_vm.read_all
    store = make_store(disk_path=str(tmp_path / "disk"), disk_bytes=1 << 20)
    with shm_daemon(tmp_path, store=store, max_inflight_bytes=64 * CB) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5) as c:
        budget = d.app[STATE_KEY].budget
        monkeypatch.setattr(shm_vm, "read_all", lambda peer, ranges: seen.append(
            budget.held) or real(peer, ranges))
        assert c.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)], durable=True) == 3
        assert seen == [3 * CB] and budget.held == 0


def test_a_client_negotiates_down_to_an_older_daemons_version(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "SHM_VERSIONS", (1, 2))  # a daemon from before version 3
    with shm_daemon(tmp_path) as d, ShmKVStoreClient(d.sock_path, timeout_s=5) as c:
        kvs = [chunk(i) for i in range(2)]
        assert c.put_chunks(NS, KEYS[:2], kvs) == 2
        conn = c._idle[0]
        assert c._version == 2 and conn.hello.version == 2 and not conn.hello.vm_read
        assert conn.staging is not None  # staged, unhashed (version 2)
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[:2]), kvs))


def test_peer_memory_sees_its_process_exit():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        peer = shm_vm.PeerMemory(p.pid)
        assert peer.alive()
        p.kill()
        p.wait()
        deadline = time.monotonic() + 5
        while peer.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not peer.alive()
        with pytest.raises(P.ProtocolError) as e:
            peer.read_into([], [])
        assert e.value.status in (403, 410)
        peer.close()
    finally:
        p.kill()


def test_a_read_finishing_after_the_client_closed_its_connection_stores_nothing(tmp_path,
                                                                             monkeypatch):
    """A client whose put call gave up (a timeout) closes the connection before returning;
    its tensors may be freed after that, so a read the daemon ends later is not committed."""
    with shm_daemon(tmp_path) as d:
        c = RawClient(d.sock_path)
        assert vm_hello(c)["vm_read"]
        real = shm_vm.vm_read

        def slow(pid, local, remote):  # the client gives up while the daemon reads
            n = real(pid, local, remote)
            c.sock.shutdown(2)
            time.sleep(0.2)
            return n
        monkeypatch.setattr(shm_vm, "vm_read", slow)
        kv = chunk(0)
        views = [P.tensor_bytes(kv)]
        c.send({"op": "put", "namespace": NS.to_dict(), "pid": os.getpid(),
                "chunks": [{"key": KEYS[0].hex(), "nbytes": CB, "dtype": "float16",
                            "shape": list(kv.shape)}],
                "vm": [[shm_vm.address_of(views[0]), CB]]})
        deadline = time.monotonic() + 5
        while d.store.stats()["tiers"]["cpu"]["used_bytes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # (reserved while the read runs)
        time.sleep(0.5)
        assert d.store.exists(NS, KEYS[:1]) == [False]
        assert d.store.stats()["tiers"]["cpu"]["used_bytes"] == 0  # reservation given back
        c.close()


def test_under_yama_scope_1_the_client_names_the_daemon_its_ptracer(tmp_path, monkeypatch):
    import socket as socketmod
    calls = []

    class Libc:
        def prctl(self, option, arg, *rest):
            calls.append((option, arg.value))
    monkeypatch.setattr(shm_vm, "_LIBC", Libc())
    a, b = socketmod.socketpair(socketmod.AF_UNIX)
    try:
        for scope, want in (("1\n", [(0x59616D61, os.getpid())]), ("0\n", []), ("2\n", []),
                            ("3\n", [])):
            calls.clear()
            (tmp_path / "scope").write_text(scope)
            monkeypatch.setattr(shm_vm, "_YAMA", str(tmp_path / "scope"))
            shm_vm.allow_daemon_to_read(a)  # the peer of a socketpair is this process
            assert calls == want, scope
        monkeypatch.setattr(shm_vm, "_YAMA", str(tmp_path / "absent"))  # no Yama: nothing
        shm_vm.allow_daemon_to_read(a)
        assert calls == []
    finally:
        a.close()
        b.close()


def test_a_read_ending_after_the_daemon_closed_the_connection_stores_nothing(tmp_path,
                                                                              monkeypatch):
    """The daemon answers 504 and closes a connection whose vm put outran its request timeout
    while the read still runs on the store pool; new connections then reuse the closed
    connection's descriptor numbers (its socket, its peer's pidfd). The read ending after
    that is dropped: the client was told its put failed and may have reused its memory."""
    gate, reading = threading.Event(), threading.Event()
    real = shm_vm.vm_read

    def held(pid, local, remote):  # the put's read (not a hello's probe) waits for the gate
        if sum(n for _, n in remote) == CB:
            reading.set()
            assert gate.wait(10)
        return real(pid, local, remote)
    monkeypatch.setattr(shm_vm, "vm_read", held)
    with shm_daemon(tmp_path, request_timeout_s=0.3) as d:
        c = RawClient(d.sock_path)
        assert vm_hello(c)["vm_read"]
        kv = chunk(0)
        try:
            reply = vm_put(c, KEYS[:1], [kv])
            assert reply["status"] == 504 and reading.is_set()
            kv.fill_(7)  # the client reuses its memory after its put failed
            c.close()
            later = [RawClient(d.sock_path) for _ in range(3)]  # the lowest free numbers
            assert all(vm_hello(o)["vm_read"] for o in later)
        finally:
            gate.set()
        time.sleep(0.5)
        assert d.store.exists(NS, KEYS[:1]) == [False]
        assert later[0].keys_op("lookup", KEYS[:1])["num_hit_chunks"] == 0
        for o in later:
            o.close()
        d.store.check_integrity()

"""Puts through the client's staging area (op ``stage``, ``put`` with ``staging_offset``):
what the daemon accepts as a staging memfd, what it stores, and the client's pipeline
(``kvstore.daemon.shm_put``): bit-exact, refused cleanly, falls back to the socket."""
import fcntl
import os
import socket
import tempfile

import numpy as np
import pytest
import torch

from kvstore.daemon import protocol as P
from kvstore.daemon import shm_protocol as S
from kvstore.daemon import shm_put
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_staging import ClientStaging
from kvstore.errors import RemoteError
from tests.kvstore.daemon.shm_helpers import (CB, KEYS, NS, RawClient, as_bytes, chunk,
                                              make_store, shm_daemon, wait_until)


def stage(c: RawClient, fd: int | None, nbytes: int) -> dict:
    """Send ``stage`` with ``fd`` on its payload byte (None: a plain byte, no descriptor)."""
    c.sock.sendall(S.encode_frame({"op": "stage", "nbytes": nbytes}, 1))
    S.send_with_fds(c.sock, b"\0", [fd] if fd is not None else [])
    return c.recv()[0]


def staged_put(c: RawClient, staging: ClientStaging, keys, kvs, offset: int = 0,
               bad: int | None = None) -> dict:
    """A put of ``kvs`` written at ``offset`` of ``staging`` (``bad``: that chunk's bytes
    changed after they were hashed)."""
    entries = []
    for i, (k, kv) in enumerate(zip(keys, kvs)):
        xxh3 = staging.write_hashed(offset + i * CB, P.tensor_bytes(kv))
        entries.append(P.ChunkEntry(k, CB, "float16", tuple(kv.shape), xxh3))
    if bad is not None:
        staging.array[offset + bad * CB + 5] ^= 0xFF
    return c.call({"op": "put", "namespace": NS.to_dict(), "chunks": [e.to_dict() for e in entries],
                   "staging_offset": offset})[0]


def test_a_staged_put_stores_the_exact_bytes_and_checks_them(tmp_path):
    with shm_daemon(tmp_path) as d:
        c = RawClient(d.sock_path)
        c.hello()
        staging = ClientStaging(8 * CB)
        assert stage(c, staging.fd, 8 * CB) == {"ok": True, "staging_bytes": 8 * CB}
        r = staged_put(c, staging, KEYS[:3], [chunk(i) for i in range(3)], offset=2 * CB)
        assert r["ok"] and r["stored"] == 3
        assert [as_bytes(g) for g in d.store.get_chunks(NS, KEYS[:3])] == \
            [as_bytes(chunk(i)) for i in range(3)]
        # bytes changed after hashing: refused whole, nothing of the batch stored
        r = staged_put(c, staging, KEYS[3:6], [chunk(i) for i in range(3, 6)], bad=1)
        assert r["status"] == 400 and "checksum mismatch" in r["error"]
        assert d.store.exists(NS, KEYS[3:6]) == [False] * 3
        # chunks past the staging area's end, or a payload too: refused, the stream goes on
        r = staged_put(c, staging, KEYS[3:4], [chunk(3)], offset=7 * CB)
        assert r["ok"] and r["stored"] == 1
        head = {"op": "put", "namespace": NS.to_dict(), "staging_offset": 7 * CB,
                "chunks": [P.entry_for(k, chunk(0))[0].to_dict() for k in KEYS[4:6]]}
        r = c.call(head)[0]
        assert r["status"] == 400 and "does not fit the staging area" in r["error"]
        r = c.call({**head, "staging_offset": -1})[0]
        assert r["status"] == 400
        assert c.keys_op("exists", KEYS[:6])["exists"] == [True] * 4 + [False] * 2
        assert d.store.stats()["num_pinned_chunks"] == 0
        c.close()
        staging.close()


def test_the_daemon_accepts_only_a_sealed_memfd_of_the_announced_size(tmp_path):
    with shm_daemon(tmp_path, max_body_bytes=64 * CB) as d:
        c = RawClient(d.sock_path)
        c.hello()
        head = {"op": "put", "namespace": NS.to_dict(), "staging_offset": 0,
                "chunks": [P.entry_for(KEYS[0], chunk(0))[0].to_dict()]}
        r = c.call(head)[0]
        assert r["status"] == 400 and "before any stage" in r["error"]
        unsealed = os.memfd_create("x", os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, 4 * CB)  # the client could shrink it under the daemon: refused
        r = stage(c, unsealed, 4 * CB)
        assert r["status"] == 400 and "F_SEAL_SHRINK" in r["error"]
        no_seals = os.memfd_create("y", 0)  # F_GET_SEALS works but sealing is impossible
        os.ftruncate(no_seals, 4 * CB)
        r = stage(c, no_seals, 4 * CB)
        assert r["status"] == 400 and "F_SEAL_SHRINK" in r["error"]
        with tempfile.TemporaryFile(dir=tmp_path) as f:  # a plain file: not a memfd
            f.truncate(4 * CB)
            r = stage(c, f.fileno(), 4 * CB)
        assert r["status"] == 400 and "sealable memfd" in r["error"]
        staging = ClientStaging(4 * CB)
        r = stage(c, staging.fd, 8 * CB)
        assert r["status"] == 400 and "less than the" in r["error"]
        r = stage(c, staging.fd, 65 * CB)
        assert r["status"] == 413
        r = stage(c, None, 4 * CB)
        assert r["status"] == 400 and "exactly one descriptor" in r["error"]
        assert c.call({"op": "stage", "nbytes": 4 * CB})[0]["status"] == 400  # no payload byte
        for fd in (unsealed, no_seals):
            os.close(fd)
        assert stage(c, staging.fd, 4 * CB)["ok"]
        assert c.keys_op("lookup", KEYS[:1])["num_hit_chunks"] == 0  # the stream is in step
        c.close()
        staging.close()


def test_the_staging_memfd_cannot_shrink_and_the_daemon_maps_it_read_only():
    staging = ClientStaging(4 * CB)
    with pytest.raises(PermissionError):
        os.ftruncate(staging.fd, CB)
    seals = fcntl.fcntl(staging.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL
    from kvstore.daemon.shm_staging import map_client_staging
    view = map_client_staging(staging.fd, 4 * CB, 1 << 20)
    assert not view.flags.writeable
    staging.array[:4] = [1, 2, 3, 4]
    assert view[:4].tolist() == [1, 2, 3, 4]  # the same memory, read-only on the daemon side
    staging.close()


def test_the_client_pipelines_staged_puts_bit_exact(tmp_path, monkeypatch):
    """Staging of 4 chunks (two halves of 2): 7 chunks go as 4 requests, 2 in flight."""
    monkeypatch.setattr(shm_put, "GROUP_BYTES", 2 * CB)
    sent = []
    orig = shm_put.encode_frame

    def spy(header, payload_bytes=0):
        if header.get("op") == "put":
            sent.append((header.get("staging_offset"), len(header["chunks"]),
                         "parent" in header["chunks"][0]))
        return orig(header, payload_bytes)
    monkeypatch.setattr(shm_put, "encode_frame", spy)
    with shm_daemon(tmp_path) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5, vm_put=False,
                             staging_bytes=4 * CB) as c:
        kvs = [chunk(i) for i in range(7)]
        assert c.put_chunks(NS, KEYS[:7], kvs) == 7
        assert sent == [(0, 2, False), (2 * CB, 2, True), (0, 2, True), (2 * CB, 1, True)]
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[:7]), kvs))
        assert d.store.stats()["stored_chunks"] == 7
        # explicit parents: a chunk continuing a chain that is not the previous key
        sent.clear()
        assert c.put_chunks(NS, [KEYS[7]], [chunk(7)], parents=[KEYS[6]]) == 1
        assert sent == [(0, 1, True)]
        assert torch.equal(c.get_chunks(NS, [KEYS[7]])[0], chunk(7))


def test_an_error_mid_pipeline_is_raised_after_every_reply_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_put, "GROUP_BYTES", CB)
    real = ClientStaging.write_hashed
    calls = []

    def bad_second(self, offset, src):
        calls.append(offset)
        h = real(self, offset, src)
        return "0" * 16 if len(calls) == 2 else h  # the 2nd request's checksum is wrong
    monkeypatch.setattr(ClientStaging, "write_hashed", bad_second)
    with shm_daemon(tmp_path) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5, vm_put=False,
                             staging_bytes=2 * CB) as c:
        c._version = 1  # staged entries carry checksums on protocol version 1 only
        with pytest.raises(RemoteError) as e:
            c.put_chunks(NS, KEYS[:4], [chunk(i) for i in range(4)])
        assert e.value.status == 400 and "checksum mismatch" in str(e.value)
        # the 1st request committed; the 3rd was not sent (the 2nd's reply came first)
        assert d.store.exists(NS, KEYS[:4]) == [True, False, False, False]
        assert len(calls) == 3 and len(c._idle) == 1  # the connection is kept: in step
        monkeypatch.setattr(ClientStaging, "write_hashed", real)
        assert c.put_chunks(NS, KEYS[:4], [chunk(i) for i in range(4)]) == 3
        assert all(torch.equal(g, chunk(i)) for i, g in enumerate(c.get_chunks(NS, KEYS[:4])))


def test_the_client_puts_over_the_socket_when_staging_is_refused(tmp_path):
    """A daemon whose body limit is below the staging size refuses it (413): the client
    remembers that for the connection and sends the bytes over the socket."""
    with shm_daemon(tmp_path, max_body_bytes=16 * CB) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5, vm_put=False,
                             staging_bytes=32 * CB) as c:
        kvs = [chunk(i) for i in range(3)]
        assert c.put_chunks(NS, KEYS[:3], kvs) == 3
        conn = c._idle[0]
        assert conn.staging is None and conn.staging_refused
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[:3]), kvs))
    with shm_daemon(_sub(tmp_path)) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5, vm_put=False,
                             staging_bytes=0) as c:
        assert c.put_chunks(NS, KEYS[:2], kvs[:2]) == 2
        assert c._idle[0].staging is None and not c._idle[0].staging_refused


def test_a_client_killed_after_staging_leaves_the_daemon_serving(tmp_path):
    """The daemon keeps its read-only mapping of a dead client's staging memfd only until the
    connection ends; other clients are served, and nothing stays pinned or reserved."""
    with shm_daemon(tmp_path) as d:
        c = RawClient(d.sock_path)
        c.hello()
        staging = ClientStaging(4 * CB)
        assert stage(c, staging.fd, 4 * CB)["ok"]
        staging.write_hashed(0, P.tensor_bytes(chunk(0)))
        c.sock.sendall(S.encode_frame({"op": "put", "namespace": NS.to_dict(),
                                       "staging_offset": 0,
                                       "chunks": [P.entry_for(KEYS[0], chunk(0))[0].to_dict()]}))
        c.sock.shutdown(socket.SHUT_RDWR)  # gone before reading the reply
        c.close()
        staging.close()
        with ShmKVStoreClient(d.sock_path, timeout_s=5) as other:
            assert other.put_chunks(NS, KEYS[1:3], [chunk(1), chunk(2)], parents=[None, KEYS[1]]) == 2
            assert torch.equal(other.get_chunks(NS, [KEYS[2]])[0], chunk(2))
        assert wait_until(lambda: d.store.stats()["num_pinned_chunks"] == 0)  # (release: no reply)


def _sub(tmp_path):
    p = tmp_path / "b"
    p.mkdir()
    return p


def test_staging_arrays_are_copied_not_aliased():
    """``write_hashed`` copies: changing the source afterwards leaves the staged bytes."""
    staging = ClientStaging(2 * CB)
    kv = chunk(1).clone()
    h = staging.write_hashed(CB, P.tensor_bytes(kv))
    assert h == P.checksum(P.tensor_bytes(chunk(1)))
    kv.zero_()
    assert staging.array[CB:2 * CB].tobytes() == as_bytes(chunk(1))
    with pytest.raises(ValueError, match="do not fit"):
        staging.write_hashed(CB + 1, P.tensor_bytes(kv))
    assert np.count_nonzero(staging.array[:CB]) == 0
    staging.close()


def test_a_larger_chunk_gets_a_larger_staging_area(tmp_path):
    """A staging area holds at least two chunks: a namespace of larger chunks replaces it
    (the daemon maps the new one) instead of falling back to the socket."""
    from kvstore.keys import Namespace
    from kvstore.layout import KVLayout
    big = Namespace("tiny-model", KVLayout(num_layers=2, num_kv_heads=1, head_dim=8,
                                           dtype="float16", chunk_size=16))  # 1 KiB chunks
    with shm_daemon(tmp_path) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5, vm_put=False,
                             staging_bytes=2 * CB) as c:
        assert c.put_chunks(NS, KEYS[:2], [chunk(0), chunk(1)]) == 2
        assert c._idle[0].staging.nbytes == 2 * CB
        g = torch.Generator().manual_seed(3)
        kvs = [torch.randn(big.layout.shape(), generator=g).half() for _ in range(3)]
        keys = big.chunk_keys(list(range(48)))
        assert c.put_chunks(big, keys, kvs) == 3
        conn = c._idle[0]
        assert conn.staging.nbytes == 2 * big.layout.chunk_bytes and not conn.staging_refused
        assert all(torch.equal(a, b) for a, b in zip(c.get_chunks(big, keys), kvs))
        assert c.put_chunks(NS, KEYS[2:4], [chunk(2), chunk(3)], parents=[KEYS[1], KEYS[2]]) == 2
        assert torch.equal(c.get_chunks(NS, [KEYS[3]])[0], chunk(3))


def test_a_staged_put_with_no_room_in_memory_goes_to_the_disk_tier(tmp_path):
    """The one-call path (reserve, copy, commit on the store pool) steps aside when the CPU
    tier has no room (every page pinned) but a disk tier does: the chunk is staged through a
    buffer and stored there, bit-exact, and nothing stays reserved."""
    store = make_store(cpu_bytes=2 * CB, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 20)
    with shm_daemon(tmp_path, store=store) as d:
        c = RawClient(d.sock_path)
        c.hello()
        staging = ClientStaging(4 * CB)
        assert stage(c, staging.fd, 4 * CB)["ok"]
        assert staged_put(c, staging, KEYS[:2], [chunk(0), chunk(1)])["stored"] == 2
        assert store.pin(NS, KEYS[:2]) == 2                  # the CPU tier: all pinned
        r = staged_put(c, staging, KEYS[2:3], [chunk(2)], offset=2 * CB)
        assert r["ok"] and r["stored"] == 1
        assert store.tiers[1].contains(KEYS[2]) and not store.tiers[0].contains(KEYS[2])
        assert as_bytes(store.get_chunks(NS, KEYS[2:3])[0]) == as_bytes(chunk(2))
        store.unpin(NS, KEYS[:2])
        assert store.stats()["num_pinned_chunks"] == 0
        c.close()
        staging.close()

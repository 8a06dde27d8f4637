"""Protocol version 2 of the same-host path: a put from the client's staging area leaves out
its entries' ``xxh3`` and the daemon copies them unhashed (``kvstore.daemon.shm_protocol``);
a version 1 connection, or a put over the socket, still needs (and checks) every checksum; a
client falls back to version 1 against a daemon that serves only that. Tiny layout
(``shm_helpers``: 256-byte chunks)."""
from __future__ import annotations

import pytest
import torch

from kvstore.daemon import shm_protocol as S
from kvstore.daemon import shm_put, shm_staging
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_staging import ClientStaging
from tests.kvstore.daemon.shm_helpers import (CB, KEYS, NS, RawClient, as_bytes, chunk,
                                              shm_daemon)
from tests.kvstore.daemon.test_shm_staging import stage


def spy(monkeypatch, owner, name) -> list:
    calls, orig = [], getattr(owner, name)

    def wrapped(*a, **kw):
        calls.append(a)
        return orig(*a, **kw)
    monkeypatch.setattr(owner, name, wrapped)
    return calls


def put_headers(monkeypatch) -> list[dict]:
    sent, orig = [], shm_put.encode_frame

    def record(header, payload_bytes=0):
        if header.get("op") == "put":
            sent.append(header)
        return orig(header, payload_bytes)
    monkeypatch.setattr(shm_put, "encode_frame", record)
    return sent


def test_a_version_2_staged_put_goes_unhashed_on_both_sides_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(shm_put, "GROUP_BYTES", 2 * CB)
    sent = put_headers(monkeypatch)
    client_hashes = spy(monkeypatch, ClientStaging, "write_hashed")
    daemon_hashes = spy(monkeypatch, shm_staging, "copy_hashed")
    with shm_daemon(tmp_path) as d, \
            ShmKVStoreClient(d.sock_path, timeout_s=5, staging_bytes=4 * CB,
                             vm_put=False) as c:
        kvs = [chunk(i) for i in range(5)]
        assert c.put_chunks(NS, KEYS[:5], kvs) == 5
        assert c.hello() and c._idle[0].hello.version == 3
        assert [len(h["chunks"]) for h in sent] == [2, 2, 1]
        assert all("xxh3" not in e and "staging_offset" in h for h in sent for e in h["chunks"])
        assert client_hashes == [] and daemon_hashes == []
        assert [as_bytes(g) for g in d.store.get_chunks(NS, KEYS[:5])] == \
            [as_bytes(kv) for kv in kvs]
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[:5]), kvs))
        d.store.check_integrity()


def unhashed_entries(staging: ClientStaging, keys, kvs) -> list[dict]:
    out = []
    for i, (k, kv) in enumerate(zip(keys, kvs)):
        staging.write(i * CB, memoryview(kv.view(torch.uint8).numpy()).cast("B"))
        out.append({"key": k.hex(), "nbytes": CB, "dtype": "float16",
                    "shape": list(kv.shape)})
    return out


@pytest.mark.parametrize("version", [1, 2])
def test_checksums_are_left_out_only_from_staging_on_version_2(tmp_path, version):
    with shm_daemon(tmp_path) as d:
        c = RawClient(d.sock_path)
        c.send({"op": "hello", "version": version, "token": None})
        assert c.recv([])[0]["version"] == version
        staging = ClientStaging(4 * CB)
        assert stage(c, staging.fd, 4 * CB)["ok"]
        kvs = [chunk(7), chunk(8)]
        head = {"op": "put", "namespace": NS.to_dict(),
                "chunks": unhashed_entries(staging, KEYS[:2], kvs)}
        r = c.call({**head, "staging_offset": 0})[0]
        if version == 1:
            assert r["status"] == 400 and "'xxh3' must be 16 hex digits" in r["error"]
            assert d.store.exists(NS, KEYS[:2]) == [False, False]
        else:
            assert r["ok"] and r["stored"] == 2
            assert [as_bytes(g) for g in d.store.get_chunks(NS, KEYS[:2])] == \
                [as_bytes(kv) for kv in kvs]
        # bytes over the socket need their checksums on every version
        r = c.call(head, b"".join(as_bytes(kv) for kv in kvs))[0]
        assert r["status"] == 400 and "'xxh3' must be 16 hex digits" in r["error"]
        # a checksum given on version 2 is still checked
        entries = unhashed_entries(staging, KEYS[2:3], [chunk(9)])
        entries[0]["xxh3"] = "0" * 16
        r = c.call({**head, "chunks": entries, "staging_offset": 0})[0]
        assert r["status"] == 400 and "checksum mismatch" in r["error"]
        c.close()


def test_a_client_falls_back_to_version_1_and_hashes(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "SHM_VERSIONS", (1,))  # a daemon of version 1 only
    client_hashes = spy(monkeypatch, ClientStaging, "write_hashed")
    with shm_daemon(tmp_path) as d, ShmKVStoreClient(d.sock_path, timeout_s=5) as c:
        kvs = [chunk(3), chunk(4)]
        assert c.put_chunks(NS, KEYS[:2], kvs) == 2
        assert c._version == 1 and len(client_hashes) == 2
        assert all(torch.equal(g, kv) for g, kv in zip(c.get_chunks(NS, KEYS[:2]), kvs))
        c2 = RawClient(d.sock_path)
        c2.send({"op": "hello", "version": 2, "token": None})
        r = c2.recv()[0]
        assert r["status"] == 400 and "unsupported shm protocol version 2; supported: 1" in \
            r["error"]
        c2.close()

"""Key requests in their compact form (``"hashes"``: the keys' prefix hashes back to back in
hex, ``kvstore.daemon.shm_protocol.parse_hashes``) and the client's non-blocking connection
(``kvstore.daemon.shm_conn.Conn``): same answers as the ``"keys"`` form, bad input refused
with the HTTP status the same mistake gets and the connection going on, a foreign key
refused before anything is sent, and a daemon that stops answering ending a call at its
deadline. Tiny layout: 256-byte chunks of 4 tokens (``shm_helpers``)."""
import socket
import threading
import time

import pytest

from kvstore.daemon import shm_protocol as S
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.protocol import ProtocolError
from kvstore.errors import RemoteError, StoreUnavailable
from kvstore.keys import Namespace
from tests.kvstore.daemon.shm_helpers import (KEYS, NS, OTHER, RawClient, as_bytes, chunk,
                                              shm_daemon)


def hashes(keys) -> str:
    return b"".join(k.prefix_hash for k in keys).hex()


def test_hashes_name_the_same_chunks_as_keys(tmp_path):
    """5 of 8 chunks stored: lookup, exists and get answer the same over both forms, and
    the get through ``hashes`` is bit-exact."""
    kvs = [chunk(i) for i in range(5)]
    with shm_daemon(tmp_path) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        assert c.put(KEYS[:5], kvs)["stored"] == 5
        head = {"namespace": NS.to_dict(), "hashes": hashes(KEYS)}
        by_hashes = c.call({"op": "lookup", **head})[0]
        assert by_hashes == c.keys_op("lookup", KEYS)
        assert (by_hashes["num_hit_chunks"], by_hashes["num_requested_chunks"]) == (5, 8)
        assert by_hashes["tiers"] == ["cpu"] * 5
        assert c.call({"op": "exists", **head})[0]["exists"] == [True] * 5 + [False] * 3
        reply, _ = c.call({"op": "get", "namespace": NS.to_dict(), "hashes": hashes(KEYS[:2])})
        got = [b"".join(c.arena[o:o + n] for o, n in e["runs"]) for e in reply["chunks"]]
        assert got == [as_bytes(kvs[0]), as_bytes(kvs[1])]
        c.release(reply["borrow"])
        assert c.call({"op": "lookup", "namespace": NS.to_dict(), "hashes": ""})[0][
            "num_requested_chunks"] == 0
        c.close()


@pytest.mark.parametrize("value, status, says", [
    (123, 400, "hex string of 32-byte"),
    ("ab" * 31, 400, "hex string of 32-byte"),      # 31 bytes: not whole hashes
    ("zz" * 32, 400, "not hex"),
    ("00" * 32 * 5, 413, "5 keys exceed the limit of 4"),
])
def test_bad_hashes_are_refused_and_the_connection_goes_on(tmp_path, value, status, says):
    with shm_daemon(tmp_path, max_batch_keys=4) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        reply = c.call({"op": "lookup", "namespace": NS.to_dict(), "hashes": value})[0]
        assert (reply["ok"], reply["status"]) == (False, status)
        assert says in reply["error"]
        ok = c.call({"op": "lookup", "namespace": NS.to_dict(), "hashes": hashes(KEYS[:4])})[0]
        assert (ok["ok"], ok["num_hit_chunks"], ok["num_requested_chunks"]) == (True, 0, 4)
        c.close()


def test_parse_hashes_makes_the_namespace_keys():
    assert S.parse_hashes(NS, hashes(KEYS), 8) == KEYS
    short = Namespace("tiny-model", NS.layout, hash_algo="xxh3_128")
    skeys = short.chunk_keys(list(range(12)))
    assert S.parse_hashes(short, hashes(skeys), 8) == skeys        # 16-byte hashes
    with pytest.raises(ProtocolError, match="16-byte"):
        S.parse_hashes(short, "00" * 40, 8)                        # 40 bytes: 2.5 hashes


def test_a_foreign_key_is_refused_as_over_http(tmp_path):
    """The compact form cannot carry a key of another namespace: the client sends the per-key
    form and the daemon refuses it with 400, the answer an HTTP client gets."""
    mixed = KEYS[:2] + OTHER.chunk_keys(list(range(4)))
    with pytest.raises(ValueError, match="is not of namespace"):
        S.hashes_frame("lookup", NS, mixed)
    with shm_daemon(tmp_path) as srv:
        with ShmKVStoreClient(srv.sock_path, timeout_s=5.0) as c:
            for call in (lambda: c.lookup_keys(NS, mixed), lambda: c.exists(NS, mixed),
                         lambda: c.get_chunks(NS, mixed)):
                with pytest.raises(RemoteError) as e:
                    call()
                assert e.value.status == 400 and "does not belong" in e.value.message
            assert c.lookup_keys(NS, KEYS[:2]).num_hit_chunks == 0   # the connection is fine
    with pytest.raises(ValueError, match="one size"):
        short = Namespace("tiny-model", NS.layout, hash_algo="xxh3_128")
        fake = [KEYS[0], type(KEYS[0])(NS.ns_id, short.chunk_keys([1, 2, 3, 4])[0].prefix_hash)]
        S.hashes_frame("lookup", NS, fake)


def test_a_daemon_that_stops_answering_ends_the_call_at_its_deadline(tmp_path):
    """A listener that greets (no arena) and then reads requests without ever answering:
    a lookup with a 0.5 s deadline raises StoreUnavailable after 0.5 s, not later."""
    path = str(tmp_path / "mute.sock")
    ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ls.bind(path)
    ls.listen(4)
    held = []

    def mute() -> None:
        conn, _ = ls.accept()
        held.append(conn)
        S.recv_frame(conn)  # hello
        conn.sendall(S.encode_frame({"ok": True, "version": S.SHM_VERSION, "instance": "mute",
                                     "arena_bytes": 0, "page_bytes": 0, "tenant": {}}))
        while conn.recv(65536):
            pass
    t = threading.Thread(target=mute, daemon=True)
    t.start()
    try:
        with ShmKVStoreClient(path, timeout_s=5.0) as c:
            assert c.hello()["instance"] == "mute"
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="no answer within 0.5 s"):
                c.lookup_keys(NS, KEYS, timeout_s=0.5)
            assert 0.45 <= time.monotonic() - t0 < 2.0
    finally:
        for conn in held:
            conn.close()
        ls.close()

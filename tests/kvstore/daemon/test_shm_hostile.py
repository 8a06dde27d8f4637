"""The same-host path under hostile or broken clients (``kvstore.daemon.shm_session``,
``kvstore.daemon.shm_reader``): frames that lie about their lengths or nest without end,
requests and replies that stall, borrows never released. After each, the daemon answers the
offending client (or closes it), serves other clients bit-exact, counts no request as in
flight and leaks no pin.
"""
import socket
import time

from kvstore.daemon import shm_protocol as S
from kvstore.daemon.server import STATE_KEY
from tests.kvstore.daemon.shm_helpers import (KEYS, NS, RawClient, as_bytes, chunk, num_pinned,
                                              shm_daemon, wait_until)


def serves_others(srv) -> bool:
    """A fresh client gets KEYS[:2] (put by ``seeded``) bit-exact and its pins go back."""
    c = RawClient(srv.sock_path)
    try:
        assert c.hello()["ok"]
        reply, got = c.get(KEYS[:2])
        assert got == [as_bytes(chunk(1)), as_bytes(chunk(2))], reply
        c.release(reply["borrow"])
    finally:
        c.close()
    return wait_until(lambda: num_pinned(srv.store) == 0)


def seeded(srv) -> None:
    c = RawClient(srv.sock_path)
    c.hello()
    assert c.put(KEYS[:2], [chunk(1), chunk(2)])["stored"] == 2
    c.close()


def reply_or_eof(c: RawClient, timeout: float = 5.0) -> dict | None:
    """The next reply's header, or None when the daemon closed the connection first."""
    c.sock.settimeout(timeout)
    try:
        return c.recv()[0]
    except (ConnectionError, OSError):
        return None


def test_a_header_nested_thousands_deep_is_answered_400(tmp_path):
    """JSON nested deeper than the decoder recurses is a malformed header: answered 400 (it
    raised RecursionError, which ended the connection without a reply and logged a
    traceback), before hello and after it."""
    with shm_daemon(tmp_path) as srv:
        seeded(srv)
        for blob in (b"[" * 100_000 + b"]" * 100_000,
                     b'{"op":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001):
            for greet in (False, True):
                c = RawClient(srv.sock_path)
                if greet:
                    c.hello()
                c.sock.sendall(S.PREAMBLE.pack(b"KVS\x01", len(blob)) + blob)
                reply = reply_or_eof(c)
                assert reply is not None and reply["status"] == 400, reply
                assert "nested too deeply" in reply["error"]
                c.close()
        assert serves_others(srv)

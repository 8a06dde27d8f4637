"""Trying to break the daemon's direct I/O with bad framing: disconnects at every interesting
offset, half-closed and over-long bodies, chunked transfer encoding, bad ``nbytes`` and duplicate
keys. After each: nothing stored, no page leaked (``direct_io_helpers.settled``).
"""
import socket
import time

import pytest
import torch

from kvstore.daemon import protocol as P

from tests.kvstore.daemon.direct_io_helpers import (
    BODY4, CB, HDR, KEYS, LAYOUT, NS, chunk, do_get, do_put, exchange, put_body, raw_post,
    read_reply, settled,
)
from tests.kvstore.daemon.direct_io_helpers import _clean, server  # noqa: F401  (fixtures)


# ---- disconnects and framing ------------------------------------------------------------------
@pytest.mark.parametrize("cut", [3, 8, HDR - 5, HDR, HDR + 1, HDR + 100, HDR + CB,
                                 HDR + CB + 1, HDR + 3 * CB, len(BODY4) - 1])
def test_disconnect_at_any_offset_stores_nothing_and_frees_the_pages(server, cut):
    s = raw_post(server, "/v1/put", f"Content-Length: {len(BODY4)}\r\n", BODY4[:cut])
    time.sleep(0.1)
    s.close()
    settled(server)
    assert server.store.tiers[0].num_chunks == 0


@pytest.mark.parametrize("cut", [HDR, HDR + CB, len(BODY4) - 1])
def test_half_closed_truncated_body_is_a_clear_error(server, cut):
    s = raw_post(server, "/v1/put", f"Content-Length: {len(BODY4)}\r\n", BODY4[:cut])
    s.shutdown(socket.SHUT_WR)
    reply = read_reply(s)
    s.close()
    settled(server)
    assert server.store.tiers[0].num_chunks == 0
    assert reply == b"" or reply.startswith(b"HTTP/1.1 4") or reply.startswith(b"HTTP/1.1 5")


def test_content_length_larger_than_the_header_declares_is_400(server):
    reply = exchange(server, "/v1/put", f"Content-Length: {len(BODY4) + 10}\r\n", BODY4 + b"x" * 10)
    assert reply.startswith(b"HTTP/1.1 400") and b"header declares" in reply
    settled(server)
    assert server.store.tiers[0].num_chunks == 0


def test_extra_bytes_after_a_complete_content_length_body_do_not_corrupt_it(server):
    """Garbage pipelined behind a complete body: aiohttp's parser refuses the whole segment
    (400, the put never runs) when both arrive at once, or answers the put (200) then 400s
    the garbage. Either way the store holds all four chunks bit-exact or none."""
    for split in (False, True):
        server.store.clear()
        s = raw_post(server, "/v1/put", f"Content-Length: {len(BODY4)}\r\n",
                     BODY4 if split else BODY4 + b"garbage\r\n\r\n")
        if split:
            time.sleep(0.2)
            s.sendall(b"garbage\r\n\r\n")
        reply = read_reply(s)
        s.close()
        settled(server)
        n = server.store.tiers[0].num_chunks
        assert n == (4 if split else 0), reply[:100]
        if n:
            status, got = do_get(server, KEYS[:4])
            assert all(torch.equal(g, chunk(i)) for i, g in enumerate(got))


def _chunked(body: bytes, piece=100) -> bytes:
    out = b""
    for i in range(0, len(body), piece):
        p = body[i:i + piece]
        out += f"{len(p):x}\r\n".encode() + p + b"\r\n"
    return out + b"0\r\n\r\n"


def test_chunked_transfer_encoding_works_and_trailing_bytes_are_refused(server):
    reply = exchange(server, "/v1/put", "Transfer-Encoding: chunked\r\n", _chunked(BODY4))
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    status, got = do_get(server, KEYS[:4])
    assert all(torch.equal(g, chunk(i)) for i, g in enumerate(got))
    server.store.clear()
    reply = exchange(server, "/v1/put", "Transfer-Encoding: chunked\r\n", _chunked(BODY4 + b"zz"))
    assert reply.startswith(b"HTTP/1.1 400") and b"trailing bytes" in reply
    settled(server)
    assert server.store.tiers[0].num_chunks == 0


def test_chunked_body_that_ends_early_stores_nothing(server):
    reply = exchange(server, "/v1/put", "Transfer-Encoding: chunked\r\n",
                 _chunked(BODY4[:HDR + CB + 7]))
    assert reply.startswith(b"HTTP/1.1 400") and b"truncated payload" in reply
    settled(server)
    assert server.store.tiers[0].num_chunks == 0


def test_huge_or_non_integer_nbytes_is_refused_before_anything_is_reserved(server):
    e, v = P.entry_for(KEYS[0], chunk(0))
    for nbytes in (1 << 40, -1, True, "256", None):
        hdr = {"namespace": NS.to_dict(), "chunks": [dict(e.to_dict(), nbytes=nbytes)]}
        status, ans = do_put(server, P.encode_preamble_and_header(hdr) + bytes(v))
        assert status in (400, 413), (nbytes, status, ans)
    settled(server)


def test_float_nbytes_is_400_even_when_the_key_is_stored_already(server):
    """nbytes 256.0 equals 256 in Python: it passed validation, and the read-and-drop path
    (a key stored already) then did range(0, 256.0, ...) -> 500 internal error."""
    assert do_put(server, put_body(KEYS[:1], [chunk(0)]))[0] == 200
    e, v = P.entry_for(KEYS[0], chunk(0))
    hdr = {"namespace": NS.to_dict(), "chunks": [dict(e.to_dict(), nbytes=float(CB))]}
    status, ans = do_put(server, P.encode_preamble_and_header(hdr) + bytes(v))
    assert status == 400 and "nbytes" in ans["error"], ans
    hdr = {"namespace": NS.to_dict(), "chunks": [dict(e.to_dict(), shape=[float(x) for x in
                                                                          LAYOUT.shape()])]}
    status, ans = do_put(server, P.encode_preamble_and_header(hdr) + bytes(v))
    assert status == 400 and "shape" in ans["error"], ans
    settled(server)


def test_duplicate_keys_in_one_batch_are_refused(server):
    status, ans = do_put(server, put_body([KEYS[0], KEYS[0]], [chunk(0), chunk(1)]))
    assert status == 400 and "duplicate key" in ans["error"]
    settled(server)
    assert server.store.tiers[0].num_chunks == 0

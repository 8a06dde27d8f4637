"""The daemon reads requests ahead (``kvstore.daemon.shm_session``): several frames that arrive
in one read are served one by one, in order; a ``stage`` request whose header and
descriptor-carrying payload byte are read together still gets its memfd; descriptors that ride
on any other byte are closed, not kept.

To have the daemon read several frames at once, the test holds the store lock: a lookup then
waits on the store pool, and everything sent meanwhile is in the socket when the daemon reads
next.
"""
import os
import select
import socket

from kvstore.daemon import shm_protocol as S
from kvstore.daemon.shm_staging import ClientStaging
from tests.kvstore.daemon.shm_helpers import (CB, KEYS, NS, RawClient, as_bytes, chunk,
                                              shm_daemon)
from tests.kvstore.daemon.test_shm_staging import staged_put


def lookup_frame(keys) -> bytes:
    return S.encode_frame({"op": "lookup", "namespace": NS.to_dict(),
                           "keys": [k.hex() for k in keys]})


def assert_staging_works(c, d, staging) -> None:
    """A put of two chunks from ``staging`` (the connection's staging area) is stored
    bit-exact: the daemon received the staging area's memfd."""
    assert staged_put(c, staging, KEYS[:2], [chunk(0), chunk(1)])["stored"] == 2
    got = d.store.get_chunks(NS, KEYS[:2])
    assert [as_bytes(t) for t in got] == [as_bytes(chunk(0)), as_bytes(chunk(1))]


def test_frames_read_together_are_answered_in_order(tmp_path):
    with shm_daemon(tmp_path) as d:
        d.store.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)])
        c = RawClient(d.sock_path)
        c.hello()
        with d.store._st.lock:  # the first lookup waits on the pool; the rest queue up
            c.sock.sendall(lookup_frame(KEYS[:4]))
            c.sock.sendall(lookup_frame(KEYS[:2])
                           + S.encode_frame({"op": "release", "borrow": 12345})  # no reply
                           + S.encode_frame({"op": "exists", "namespace": NS.to_dict(),
                                             "keys": [KEYS[2].hex(), KEYS[5].hex()]})
                           + lookup_frame(KEYS[5:6]))
        replies = [c.recv()[0] for _ in range(4)]
        assert [r.get("num_hit_chunks") for r in replies] == [3, 2, None, 0]
        assert replies[0]["tiers"] == ["cpu"] * 3 and replies[0]["num_requested_chunks"] == 4
        assert replies[2] == {"ok": True, "exists": [True, False]}
        assert c.keys_op("lookup", KEYS[:1])["num_hit_chunks"] == 1  # in step afterwards
        c.close()


def test_a_stage_read_in_one_piece_with_its_header_gets_its_memfd(tmp_path):
    with shm_daemon(tmp_path) as d:
        c = RawClient(d.sock_path)
        c.hello()
        staging = ClientStaging(4 * CB)
        try:
            with d.store._st.lock:
                c.sock.sendall(lookup_frame(KEYS[:1]))
                c.sock.sendall(S.encode_frame({"op": "stage", "nbytes": 4 * CB}, 1))
                S.send_with_fds(c.sock, b"\0", [staging.fd])  # its own message, as the client
            assert c.recv()[0]["num_hit_chunks"] == 0
            assert c.recv()[0] == {"ok": True, "staging_bytes": 4 * CB}
            assert_staging_works(c, d, staging)
        finally:
            staging.close()
            c.close()


def test_a_descriptor_on_a_request_that_takes_none_is_closed(tmp_path):
    """A pipe's write end sent on a lookup's bytes: once the daemon has served the lookup
    (and the test closed its own copy) the pipe's read end sees end of file, so the daemon
    kept no copy."""
    r, w = os.pipe()
    try:
        with shm_daemon(tmp_path) as d:
            c = RawClient(d.sock_path)
            c.hello()
            with d.store._st.lock:
                c.sock.sendall(lookup_frame(KEYS[:1]))
                c.sock.sendmsg([lookup_frame(KEYS[:2])],
                               [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                 w.to_bytes(4, "little", signed=True))])
            os.close(w)
            w = None
            assert [c.recv()[0]["num_requested_chunks"] for _ in range(2)] == [1, 2]
            assert c.keys_op("lookup", KEYS[:1])["num_hit_chunks"] == 0  # a frame later
            ready, _, _ = select.select([r], [], [], 5.0)
            assert ready and os.read(r, 1) == b""  # end of file: no writer left
            c.close()
    finally:
        os.close(r)
        if w is not None:
            os.close(w)


def test_a_stage_whose_descriptor_rides_on_a_longer_message_gets_it(tmp_path):
    """``send_with_fds`` attaches descriptors to the first byte of what it sends: a client
    may send the stage's payload byte and its next request in that one message. The read
    that takes the descriptors then ends after the next request, not at the stage's byte;
    the stage still gets its memfd, and the request after it is answered."""
    with shm_daemon(tmp_path) as d:
        c = RawClient(d.sock_path)
        c.hello()
        staging = ClientStaging(4 * CB)
        try:
            c.sock.sendall(S.encode_frame({"op": "stage", "nbytes": 4 * CB}, 1))
            S.send_with_fds(c.sock, b"\0" + lookup_frame(KEYS[:3]), [staging.fd])
            assert c.recv()[0] == {"ok": True, "staging_bytes": 4 * CB}
            assert c.recv()[0]["num_requested_chunks"] == 3
            assert_staging_works(c, d, staging)
        finally:
            staging.close()
            c.close()


def test_the_read_ahead_buffer_shrinks_back_after_a_large_header():
    """A header of up to 16 MiB grows a connection's buffer to fit it; kept, 1,000 idle
    connections that each once sent one would hold 16 GB."""
    import asyncio
    import threading
    from kvstore.daemon.shm_reader import READ_AHEAD_BYTES, SocketReader

    async def run():
        a, b = socket.socketpair()
        a.setblocking(False)
        reader = SocketReader(asyncio.get_running_loop(), a)
        big = S.encode_frame({"op": "lookup", "pad": "x" * (1 << 20)})
        small = S.encode_frame({"op": "exists"})
        sender = threading.Thread(target=b.sendall, args=(big + small,))
        sender.start()  # (more than the socket buffer holds: sent while the reader reads)
        first = await reader.read_frame()
        assert first[0]["pad"] == "x" * (1 << 20)  # (the buffer grew to hold it)
        assert (await reader.read_frame())[0] == {"op": "exists"}
        sender.join()
        assert len(reader._rbuf) == READ_AHEAD_BYTES
        b.sendall(small)  # and it still reads
        assert (await reader.read_frame())[0] == {"op": "exists"}
        reader.close()
        b.close()
    asyncio.run(run())

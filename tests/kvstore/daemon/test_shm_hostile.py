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


def serves_others(srv, pinned: int = 0, check_exists: bool = False) -> bool:
    """A fresh client gets KEYS[:2] (put by ``seeded``) bit-exact and its pins go back (to
    ``pinned``: chunks another connection holds pinned meanwhile); with ``check_exists``, an
    ``exists`` after the release finds KEYS[0]."""
    c = RawClient(srv.sock_path)
    try:
        assert c.hello()["ok"]
        reply, got = c.get(KEYS[:2])
        assert got == [as_bytes(chunk(1)), as_bytes(chunk(2))], reply
        c.release(reply["borrow"])
        if check_exists:
            assert c.keys_op("exists", KEYS[:1])["exists"] == [True]
    finally:
        c.close()
    return wait_until(lambda: num_pinned(srv.store) == pinned)


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


def test_a_declared_header_length_buys_no_memory_before_its_bytes_arrive():
    """A preamble declaring a 16 MiB header followed by a trickle: the read-ahead buffer grows
    with the bytes received (it was allocated at the declared size at once: 50 idle
    connections cost the daemon 800 MB for 450 bytes sent), and the frame still decodes once
    whole."""
    import asyncio

    from kvstore.daemon.protocol import MAX_HEADER_BYTES
    from kvstore.daemon.shm_reader import READ_AHEAD_BYTES, SocketReader

    async def run():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        reader = SocketReader(asyncio.get_running_loop(), ours)
        blob = b'{"op":"lookup","pad":"' + b"x" * (300_000 - 24) + b'"}'
        theirs.sendall(S.PREAMBLE.pack(b"KVS\x01", MAX_HEADER_BYTES) + b"{")
        task = asyncio.ensure_future(reader.read_frame())
        await asyncio.sleep(0.2)
        assert not task.done() and len(reader._rbuf) <= READ_AHEAD_BYTES
        task.cancel()
        reader.close()
        ours.close()
        theirs.close()
        # a real 300 KB header, sent in pieces: grows to fit it, decodes, shrinks back
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        reader = SocketReader(asyncio.get_running_loop(), ours)
        frame = S.PREAMBLE.pack(b"KVS\x01", len(blob)) + blob + S.encode_frame({"op": "x"})
        task = asyncio.ensure_future(reader.read_frame())
        for i in range(0, len(frame), 70_000):
            theirs.sendall(frame[i:i + 70_000])
            await asyncio.sleep(0.01)
        header, n = await asyncio.wait_for(task, 5)
        assert header["op"] == "lookup" and len(header["pad"]) == 300_000 - 24 and n == 0
        assert (await reader.read_frame())[0] == {"op": "x"}
        assert len(reader._rbuf) == READ_AHEAD_BYTES
        reader.close()
        ours.close()
        theirs.close()
    asyncio.run(run())


def test_a_frame_begun_then_stalled_times_out_504(tmp_path):
    """After hello, a connection may idle between requests as long as it likes; a frame whose
    first bytes arrived must be whole within the request timeout (it waited forever, holding
    the buffer of its declared header length): answered 504, then closed."""
    with shm_daemon(tmp_path, request_timeout_s=0.5) as srv:
        seeded(srv)
        idle = RawClient(srv.sock_path)
        idle.hello()
        for partial in (b"KV", S.PREAMBLE.pack(b"KVS\x01", 16 << 20) + b'{"op":'):
            c = RawClient(srv.sock_path)
            c.hello()
            c.sock.sendall(partial)
            t0 = time.monotonic()
            reply = reply_or_eof(c)
            assert reply is not None and reply["status"] == 504, reply
            assert "incomplete" in reply["error"] and 0.4 < time.monotonic() - t0 < 3
            assert reply_or_eof(c) is None  # closed
            c.close()
        time.sleep(0.6)
        assert idle.keys_op("lookup", KEYS[:2])["num_hit_chunks"] == 2  # idle: still served
        idle.close()
        assert serves_others(srv)


def test_a_payload_declared_but_not_sent_times_out_504_and_holds_no_request(tmp_path):
    """A request (or a release) whose payload stops short: its drain waited forever, counted
    in flight (a SIGTERM drain waited its whole timeout for it). Now 504 within the request
    timeout; with borrows held the connection stays open (counted in no request) until the
    client closes it, then its pins go."""
    with shm_daemon(tmp_path, request_timeout_s=0.5) as srv:
        seeded(srv)
        state = srv.app[STATE_KEY]
        lookup = {"op": "lookup", "namespace": NS.to_dict(), "keys": [KEYS[0].hex()]}
        for header in (lookup, {"op": "release", "borrow": 1}):
            c = RawClient(srv.sock_path)
            c.hello()
            c.sock.sendall(S.encode_frame(header, 1000) + b"x" * 10)
            reply = reply_or_eof(c)
            assert reply is not None and reply["status"] == 504, reply
            assert "990 bytes short" in reply["error"]
            assert reply_or_eof(c) is None  # closed
            assert wait_until(lambda: state.active == 0, 2)
            c.close()
        c = RawClient(srv.sock_path)
        c.hello()
        reply, got = c.get(KEYS[:2])
        assert got[0] == as_bytes(chunk(1)) and num_pinned(srv.store) == 2
        c.sock.sendall(S.encode_frame(lookup, 1000) + b"x" * 10)
        assert reply_or_eof(c)["status"] == 504
        assert wait_until(lambda: state.active == 0, 2)
        assert num_pinned(srv.store) == 2  # it may still copy its borrowed chunks
        c.sock.settimeout(0.3)
        try:
            assert c.sock.recv(1) == b""  # the daemon sends nothing more
        except socket.timeout:
            pass
        c.close()
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        assert serves_others(srv)


def test_a_client_that_reads_no_reply_does_not_hold_a_request_in_flight(tmp_path):
    """A client that sends requests and never reads: the daemon stops reading it once its
    replies fill the socket (nothing buffered beyond), and the send that waits gives up after
    the request timeout (it waited forever, counted in flight). Other clients are served all
    along; the client's borrow stays until it closes."""
    with shm_daemon(tmp_path, request_timeout_s=0.5) as srv:
        seeded(srv)
        state = srv.app[STATE_KEY]
        c = RawClient(srv.sock_path)
        c.hello()
        reply, _ = c.get(KEYS[:2])
        assert reply["borrow"] is not None
        c.sock.setblocking(False)
        frame, sent = S.encode_frame({"op": "stats"}), 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the daemon stops taking requests
            try:
                c.sock.send(frame * 64)
                sent += 64
            except BlockingIOError:
                time.sleep(0.2)
                try:
                    c.sock.send(frame)
                except BlockingIOError:
                    break
        assert time.monotonic() < deadline and sent > 64
        assert serves_others_pinned(srv, 2)
        # (the requests the socket held are served first: a few seconds on a loaded host)
        assert wait_until(lambda: state.active == 0, 20)
        assert num_pinned(srv.store) == 2
        c.close()
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        assert serves_others(srv)


def serves_others_pinned(srv, pinned: int) -> bool:
    """As ``serves_others`` while another connection holds ``pinned`` chunks pinned."""
    return serves_others(srv, pinned, check_exists=True)


def test_a_connection_holds_at_most_max_borrows(tmp_path, monkeypatch):
    """Gets never released grew the daemon without bound (100 000 of them: +110 MB); a get
    beyond ``MAX_BORROWS`` unreleased is answered 429, pins nothing, and the connection goes
    on; a release makes room."""
    from kvstore.daemon import shm_session
    monkeypatch.setattr(shm_session, "MAX_BORROWS", 3)
    with shm_daemon(tmp_path) as srv:
        seeded(srv)
        c = RawClient(srv.sock_path)
        c.hello()
        borrows = [c.get(KEYS[:2])[0]["borrow"] for _ in range(3)]
        assert None not in borrows and len(set(borrows)) == 3
        refused, _ = c.get(KEYS[:1])
        assert refused["status"] == 429 and "release some" in refused["error"]
        missing, _ = c.get(NS.chunk_keys(list(range(400, 404))))
        assert missing["status"] == 429
        c.release(borrows[0])
        reply, got = c.get(KEYS[:2])
        assert reply["ok"] and got == [as_bytes(chunk(1)), as_bytes(chunk(2))]
        assert c.keys_op("lookup", KEYS[:2])["num_hit_chunks"] == 2
        c.close()
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        assert serves_others(srv)


def test_integers_past_a_floats_range_are_not_internal_errors(tmp_path):
    """A pin's ``lease_s`` of 10**400 (capped like any lease over ``max_lease_s``) and a
    layout whose chunk size is 10**400 (400: it fits no tier) were 500s with a traceback
    logged (``OverflowError`` converting them to float), over the socket and over HTTP."""
    import http.client
    import json

    with shm_daemon(tmp_path, max_lease_s=7.0) as srv:
        seeded(srv)
        huge = {**NS.to_dict(), "layout": {**NS.to_dict()["layout"], "chunk_size": 10 ** 400}}
        c = RawClient(srv.sock_path)
        c.hello()
        assert c.keys_op("pin", KEYS[:1], lease_s=10 ** 400) == {"ok": True, "pinned": 1,
                                                                "lease_s": 7.0}
        assert c.keys_op("unpin", KEYS[:1])["unpinned"] == 1
        reply = c.call({"op": "lookup", "namespace": huge, "keys": []})[0]
        assert reply["status"] == 400 and "smaller than one chunk" in reply["error"], reply
        c.close()
        for path, body in (("/v1/pin", {"namespace": NS.to_dict(), "keys": [KEYS[1].hex()],
                                         "lease_s": 10 ** 400}),
                           ("/v1/lookup", {"namespace": huge, "keys": []})):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
            conn.request("POST", path, body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = json.loads(resp.read())
            conn.close()
            if path == "/v1/pin":
                assert resp.status == 200 and answer["lease_s"] == 7.0, answer
            else:
                assert resp.status == 400 and "smaller than one chunk" in answer["error"]
        assert serves_others_pinned(srv, 1)  # KEYS[1]'s lease of 7 s

"""The same-host path's guards (``kvstore.daemon.shm_server``): who may connect (file mode,
``SO_PEERCRED`` uid, token, tenant salt and role), what a bad request gets (malformed frames,
unknown ops, too many keys, a bad checksum, a stalled upload, a draining daemon) and that the
daemon goes on serving; the socket file's life (stale one replaced, live one refused, unlinked
at stop); metrics by ``shm_*`` route.
"""
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from kvstore.daemon import protocol as P
from kvstore.daemon import shm_protocol as S
from kvstore.daemon.server import STATE_KEY, ThreadedServer, create_app
from kvstore.daemon.state import ServerLimits
from kvstore.daemon.tenants import Tenant, TenantTable
from tests.kvstore.daemon.shm_helpers import (CB, KEYS, NS, OTHER, RawClient, as_bytes, chunk,
                                              make_store, num_pinned, shm_daemon, wait_until)

ALICE, READER, ADMIN = "alice-token-0123456789", "reader-token-0123456789", "admin-token-01234567"
TENANTS = TenantTable([Tenant("alice", "tenant", "tenant-b", ALICE),
                       Tenant("dash", "reader", "tenant-b", READER),
                       Tenant("ops", "admin", None, ADMIN)])
OTHER_KEYS = OTHER.chunk_keys(list(range(4 * 4)))


def closed(c: RawClient) -> bool:
    """Whether the daemon closed the connection (EOF on the next read)."""
    c.sock.settimeout(5)
    try:
        return c.sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_hello_needs_the_right_token_and_ops_check_salt_and_role(tmp_path):
    with shm_daemon(tmp_path, tenants=TENANTS) as srv:
        for token in (None, "wrong-token-0123456789", " " + ALICE, 7):
            c = RawClient(srv.sock_path)
            assert c.hello(token) == {"ok": False, "status": 401,
                                      "error": "missing or wrong token"}
            assert c.arena_fd is None and closed(c)
            c.close()
        alice = RawClient(srv.sock_path)
        assert alice.hello(ALICE)["tenant"] == {"name": "alice", "role": "tenant",
                                                "salt": "tenant-b"}
        assert alice.put(OTHER_KEYS[:2], [chunk(1), chunk(2)], ns=OTHER)["stored"] == 2
        # another tenant's namespace: 403 for every op, and the connection goes on
        for reply in (alice.keys_op("lookup", KEYS[:1]), alice.keys_op("get", KEYS[:1]),
                      alice.put(KEYS[:1], [chunk(1)]), alice.keys_op("remove", KEYS[:1])):
            assert reply["ok"] is False and reply["status"] == 403, reply
        assert alice.call({"op": "clear", "namespace": None})[0]["status"] == 403
        assert alice.call({"op": "stats"})[0]["status"] == 403
        assert alice.keys_op("exists", OTHER_KEYS[:2], ns=OTHER)["exists"] == [True, True]
        reader = RawClient(srv.sock_path)
        reader.hello(READER)
        reply, got = reader.get(OTHER_KEYS[:2], ns=OTHER)
        assert reply["ok"] and got[0] is not None
        reader.release(reply["borrow"])
        assert reader.put(OTHER_KEYS[2:3], [chunk(3)], ns=OTHER)["status"] == 403  # read-only
        assert reader.keys_op("pin", OTHER_KEYS[:1], ns=OTHER)["status"] == 403
        admin = RawClient(srv.sock_path)
        admin.hello(ADMIN)
        assert admin.call({"op": "stats"})[0]["unix_socket"] == srv.sock_path
        assert admin.call({"op": "clear", "namespace": None})[0] == {"ok": True, "removed": 2}
        for c in (alice, reader, admin):
            c.close()
        assert wait_until(lambda: num_pinned(srv.store) == 0)


def test_malformed_frames_and_unknown_ops_get_errors_and_the_daemon_goes_on(tmp_path):
    with shm_daemon(tmp_path, max_batch_keys=4, max_body_bytes=64 * CB) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        c.put(KEYS[:2], [chunk(1), chunk(2)])
        used = srv.store.tiers[0].used_bytes
        # errors the stream survives: answered, then the next request is served
        assert c.call({"op": "frobnicate"})[0]["status"] == 404
        assert c.call({"op": 3})[0]["status"] == 404
        assert c.call({"nope": 1})[0]["status"] == 404
        assert c.call({"op": "hello", "version": 1})[0]["status"] == 400
        assert c.call({"op": "lookup", "namespace": {"x": 1}, "keys": []})[0]["status"] == 400
        assert c.call({"op": "lookup", "namespace": NS.to_dict(), "keys": ["zz"]})[0]["status"] == 400
        assert c.keys_op("get", [])["status"] == 400
        assert c.call({"op": "lookup", "namespace": NS.to_dict(), "keys": []},
                      b"x" * 1000)[0]["status"] == 400  # a payload no lookup reads: drained
        assert c.keys_op("lookup", KEYS[:5])["status"] == 413  # max_batch_keys
        too_many = c.put(KEYS[:5], [chunk(i) for i in range(5)])
        assert too_many["status"] == 413 and "5 chunks exceed" in too_many["error"]
        bad = c.put(KEYS[2:4], [chunk(3), chunk(4)], corrupt=0)
        assert bad["status"] == 400 and "checksum mismatch" in bad["error"]
        header = {"op": "put", "namespace": NS.to_dict(),
                  "chunks": [{"key": KEYS[2].hex(), "nbytes": CB, "dtype": "float16",
                              "shape": [2, 2, 4, 1, 8], "xxh3": "0" * 16}]}
        assert c.call(header, b"\0" * (CB - 1))[0]["status"] == 400  # payload size mismatch
        assert c.keys_op("exists", KEYS[:4])["exists"] == [True, True, False, False]
        assert srv.store.tiers[0].used_bytes == used  # nothing reserved was leaked
        assert c.keys_op("lookup", KEYS[:2])["num_hit_chunks"] == 2
        # errors that lose the stream's framing: answered, then closed
        c.sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        reply, _ = c.recv()
        assert reply["status"] == 400 and "magic" in reply["error"] and closed(c)
        c.close()
        c = RawClient(srv.sock_path)
        c.hello()
        c.sock.sendall(S.PREAMBLE.pack(b"KVS\x01", 5) + b"{nope")
        reply, _ = c.recv()
        assert reply["status"] == 400 and "not JSON" in reply["error"] and closed(c)
        c.close()
        c = RawClient(srv.sock_path)
        c.hello()
        c.send({"op": "put"}, b"")
        c.sock.sendall(S.encode_frame({"op": "put", "payload_bytes": 65 * CB}))
        c.recv()  # the first (empty put) is a 400
        reply, _ = c.recv()
        assert reply["status"] == 413 and closed(c)
        c.close()
        # a first request that is not hello
        c = RawClient(srv.sock_path)
        reply, _ = c.call({"op": "lookup"})
        assert reply["status"] == 400 and "hello" in reply["error"] and closed(c)
        c.close()
        c = RawClient(srv.sock_path)
        assert c.hello()["ok"] and c.keys_op("lookup", KEYS[:2])["num_hit_chunks"] == 2
        c.close()
        srv.store.check_integrity()


def test_a_layout_field_the_daemon_does_not_know_is_400_naming_it_on_the_socket(tmp_path):
    """The same-host path parses namespaces as HTTP does: a layout with ``hed_dim`` (a typo,
    beside or instead of ``head_dim``) is refused naming it, for lookup, put and clear; the
    connection goes on and nothing is stored."""
    with shm_daemon(tmp_path) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        typo = {**NS.to_dict(), "layout": {**NS.layout.to_dict(), "hed_dim": 8}}
        reply = c.call({"op": "lookup", "namespace": typo, "keys": [KEYS[0].hex()]})[0]
        assert reply["status"] == 400 and reply["error"] == (
            "bad namespace: unknown namespace layout field 'hed_dim'; a layout has chunk_size, "
            "dtype, head_dim, num_kv_heads, num_layers (a newer client than this daemon?)"), reply
        del typo["layout"]["head_dim"]
        reply = c.call({"op": "clear", "namespace": typo})[0]
        assert reply["status"] == 400 and "unknown namespace layout field 'hed_dim'" in reply["error"]
        entry, view = P.entry_for(KEYS[0], chunk(1))
        reply = c.call({"op": "put", "namespace": typo, "chunks": [entry.to_dict()]},
                       bytes(view))[0]
        assert reply["status"] == 400 and "unknown namespace layout field 'hed_dim'" in reply["error"]
        assert c.keys_op("exists", KEYS[:1])["exists"] == [False]   # served, nothing stored
        assert c.put(KEYS[:1], [chunk(1)])["ok"] is True
        c.close()


def test_a_stalled_upload_times_out_and_gives_its_pages_back(tmp_path):
    with shm_daemon(tmp_path, request_timeout_s=0.5) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        header = {"op": "put", "namespace": NS.to_dict(), "chunks": [
            {"key": KEYS[0].hex(), "nbytes": CB, "dtype": "float16",
             "shape": [2, 2, 4, 1, 8], "xxh3": "0" * 16}]}
        c.sock.sendall(S.encode_frame(header, CB) + b"\0" * 100)  # then nothing
        t0 = time.monotonic()
        reply, _ = c.recv()
        assert reply["status"] == 504 and 0.4 < time.monotonic() - t0 < 3 and closed(c)
        assert wait_until(lambda: srv.store.tiers[0].used_bytes == 0)
        srv.store.check_integrity()
        c.close()


def test_draining_answers_503_but_still_takes_releases(tmp_path):
    with shm_daemon(tmp_path) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        c.put(KEYS[:1], [chunk(1)])
        reply, _ = c.get(KEYS[:1])
        srv.app[STATE_KEY].ready = False
        assert c.keys_op("lookup", KEYS[:1])["status"] == 503
        c.release(reply["borrow"])
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        srv.app[STATE_KEY].ready = True
        assert c.keys_op("lookup", KEYS[:1])["num_hit_chunks"] == 1
        c.close()


def test_requests_are_counted_by_shm_route(tmp_path):
    with shm_daemon(tmp_path) as srv:
        requests = srv.app[STATE_KEY].requests
        c = RawClient(srv.sock_path)
        c.hello()
        c.put(KEYS[:1], [chunk(1)])
        reply, _ = c.get(KEYS[:1])
        c.release(reply["borrow"])
        c.keys_op("lookup", KEYS[:1])
        c.call({"op": "frobnicate"})
        c.keys_op("lookup", KEYS[:1])
        # (counted once the reply is sent: the client may read it first)
        assert wait_until(lambda: requests.labels("shm_lookup", "200")._value.get() == 2)
        assert requests.labels("shm_get", "200")._value.get() == 1
        assert requests.labels("shm_put", "200")._value.get() == 1
        assert requests.labels("shm_unknown", "404")._value.get() == 1
        c.close()


OTHER_UID_CLIENT = textwrap.dedent("""
    import os, socket, sys, json
    from kvstore.daemon import shm_protocol as S  # (before setuid: nobody may not read the venv)
    os.setgid(65534)
    os.setuid(65534)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(sys.argv[1])
    except PermissionError:
        print("EACCES")
        sys.exit(0)
    s.sendall(S.encode_frame({"op": "hello", "version": 1, "token": None}))
    fds = []
    reply, _ = S.recv_frame(s, fds)
    try:
        eof = s.recv(1) == b""
    except ConnectionResetError:  # (closed with our hello unread)
        eof = True
    print(json.dumps([reply, len(fds), eof]))
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_a_client_of_another_uid_is_refused(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    base = tempfile.mkdtemp(dir="/tmp")  # (pytest's tmp dirs are 0700: nobody could reach them)
    os.chmod(base, 0o755)
    path = os.path.join(base, "kv.sock")
    store = make_store()
    srv = ThreadedServer(create_app(store, ServerLimits()), unix_socket=path)

    def run_other():
        out = subprocess.run([sys.executable, "-c", OTHER_UID_CLIENT, path], cwd=root,
                             env={**os.environ, "PYTHONPATH": root}, capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()
    try:
        assert run_other() == "EACCES"  # the file's mode 0600 stops it first
        os.chmod(path, 0o666)  # even if the file were opened up, the uid check refuses it
        reply, num_fds, eof = json.loads(run_other())
        assert reply == {"ok": False, "status": 403, "error": "uid 65534 may not use this socket"}
        assert num_fds == 0 and eof
        c = RawClient(path)
        assert c.hello()["ok"]  # root (the daemon's own uid) is served
        c.close()
    finally:
        srv.stop()
        store.close()
        os.rmdir(base)


def test_socket_file_stale_replaced_live_refused_unlinked_at_stop(tmp_path):
    path = str(tmp_path / "kv.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a socket file nobody listens on (a daemon killed -9)
    store = make_store()
    srv = ThreadedServer(create_app(store, ServerLimits()), unix_socket=path)
    try:
        c = RawClient(path)
        assert c.hello()["ok"]
        c.close()
        store2 = make_store()
        with pytest.raises(ValueError, match="another process is listening"):
            ThreadedServer(create_app(store2, ServerLimits()), unix_socket=path)
        store2.close()
        c = RawClient(path)  # the first daemon still serves
        assert c.hello()["ok"]
        c.close()
    finally:
        srv.stop()
        store.close()
    assert not os.path.exists(path)
    open(path, "w").close()
    store = make_store()
    with pytest.raises(ValueError, match="not a socket"):
        ThreadedServer(create_app(store, ServerLimits()), unix_socket=path)
    store.close()
    assert os.path.exists(path)  # a file that is not a socket is never removed


def test_connections_beyond_the_cap_are_answered_503_and_closed(tmp_path):
    """``max_connections`` caps the Unix socket's connections too: with every connection
    busy (each holding a borrow) one more is refused with 503; once one is idle (its borrow
    released), a new client closes it and is served."""
    store = make_store()
    sock = str(tmp_path / "kv.sock")
    srv = ThreadedServer(create_app(store), max_connections=2, unix_socket=sock)
    try:
        a, b = RawClient(sock), RawClient(sock)
        assert a.hello()["ok"] and b.hello()["ok"]
        assert a.put(KEYS[:1], [chunk(1)])["stored"] == 1
        borrows = [x.get(KEYS[:1])[0]["borrow"] for x in (a, b)]
        c = RawClient(sock)
        r = c.hello(map_arena=False)
        assert r["ok"] is False and r["status"] == 503 and "cap 2" in r["error"]
        assert closed(c)
        assert a.keys_op("lookup", KEYS[:1])["ok"]  # the others go on
        a.release(borrows[0])
        assert a.keys_op("exists", KEYS[:1])["exists"] == [True]  # (release read first)
        d = RawClient(sock)
        assert d.hello()["ok"] and d.keys_op("exists", KEYS[:1])["exists"] == [True]
        assert closed(a) and b.keys_op("exists", KEYS[:1])["exists"] == [True]
        b.release(borrows[1])
        for x in (a, b, c, d):
            x.close()
    finally:
        srv.stop()
        store.close()


def test_a_get_refused_503_for_budget_gives_back_only_what_it_took(tmp_path):
    """A get of disk-tier chunks waits for payload budget; one that gets 503 (still no room
    after the wait) took none, so it gives none back: the budget's ``held`` is exactly what
    the other requests hold, and later requests still wait for room."""
    store = make_store(cpu_bytes=2 * CB, disk_bytes=1 << 20, disk_path=str(tmp_path / "disk"),
                       promote_on_hit=False)
    with shm_daemon(tmp_path, store, max_inflight_bytes=CB, request_timeout_s=0.3) as srv:
        c = RawClient(srv.sock_path)
        c.hello()
        assert c.put(KEYS[:2], [chunk(1), chunk(2)])["stored"] == 2
        other = NS.chunk_keys(list(range(100, 108)))  # another prompt: KEYS' chunks spill
        assert c.put(other, [chunk(3), chunk(4)])["stored"] == 2
        assert srv.store.flush(10)
        assert c.keys_op("lookup", KEYS[:1])["tiers"] == ["disk"]
        budget, loop = srv.app[STATE_KEY].budget, srv._loop
        run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(5)  # noqa: E731

        async def hold():  # another request's payload bytes in flight
            await budget.acquire(CB, 1)
        run(hold())
        reply = c.call({"op": "get", "namespace": NS.to_dict(), "keys": [KEYS[0].hex()]})[0]
        assert reply["status"] == 503 and "server busy" in reply["error"]
        assert wait_until(lambda: num_pinned(srv.store) == 0)
        assert budget.held == CB  # (was 0: the refused get gave back what it never took)

        async def release():
            budget.release(CB)
        run(release())
        reply, got = c.get(KEYS[:1])
        assert reply["ok"] and got == [as_bytes(chunk(1))]
        assert wait_until(lambda: budget.held == 0)  # given back just after the reply
        c.close()

"""The same-host path's connections under hostile clients (``kvstore.daemon.shm_server``,
``kvstore.daemon.shm_session``, ``kvstore.daemon.shm_reader``): one connection cap with HTTP,
a client that keeps its socket full, descriptors attached to request bytes, and a real
``kvstore serve`` with both paths at the cap. After each, the daemon serves others.
"""
import socket
import time

from kvstore.daemon import shm_protocol as S
from kvstore.daemon.server import STATE_KEY
from tests.kvstore.daemon.shm_helpers import KEYS, NS, RawClient, shm_daemon, wait_until
from tests.kvstore.daemon.test_shm_hostile import seeded, serves_others



def test_http_and_same_host_connections_share_one_cap(tmp_path):
    """Each path had a cap of its own, so the two together could hold twice the descriptors
    the cap leaves (at RLIMIT_NOFILE 256: 128 idle same-host clients and 128 idle HTTP ones
    left /v1/stats unanswered for 10 s and no new client accepted). Now one cap covers
    both: a same-host client at the cap closes the oldest idle HTTP connection, and with
    every slot held by idle same-host clients an HTTP client closes the one idle longest
    (it was refused 503: local processes could lock HTTP clients out)."""
    import http.client

    from kvstore.daemon.server import ThreadedServer, create_app
    from tests.kvstore.daemon.shm_helpers import make_store

    def http_status() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        try:
            conn.request("GET", "/healthz", headers={"Connection": "close"})
            return conn.getresponse().status
        finally:
            conn.close()

    def eof(s: socket.socket) -> bool:
        s.settimeout(5)
        try:
            return s.recv(1) == b""
        except ConnectionResetError:
            return True

    store = make_store()
    sock = str(tmp_path / "kv.sock")
    srv = ThreadedServer(create_app(store), max_connections=4, unix_socket=sock)
    guard = srv.app[STATE_KEY].conns
    clients = []
    try:
        idle_http = [socket.create_connection(("127.0.0.1", srv.port), timeout=5)
                     for _ in range(2)]
        assert wait_until(lambda: guard.open == 2)
        for _ in range(3):  # the third finds the cap: the oldest idle HTTP one goes
            clients.append(RawClient(sock))
            assert clients[-1].hello()["ok"]
        assert eof(idle_http[0]) and guard.open == 1
        clients.append(RawClient(sock))
        assert clients[-1].hello()["ok"] and eof(idle_http[1])
        for c in clients[1:]:  # clients[0] is now the one idle longest
            assert c.keys_op("exists", KEYS[:1])["exists"] == [False]
        assert http_status() == 200  # all 4 slots held by idle same-host clients
        assert eof(clients[0].sock) and len(srv.shm._conns) == 3
        assert guard.closed.labels("idle_evicted_same_host")._value.get() == 1
        assert guard.closed.labels("idle_evicted")._value.get() == 2
        assert clients[1].keys_op("exists", KEYS[:1])["exists"] == [False]
        for s in idle_http:
            s.close()
    finally:
        for c in clients:
            c.close()
        srv.stop()
        store.close()


def test_a_client_that_keeps_its_socket_full_does_not_hold_the_event_loop(tmp_path):
    """Pipelined requests that the daemon answers inline (lookups here) were served without a
    single wait as long as the socket held more: one client sending without pause held the
    event loop, and neither HTTP nor another same-host client was answered (a /v1/stats
    timed out after 30 s). Each connection now hands the loop over every ``TURN_S``."""
    import http.client
    import threading

    with shm_daemon(tmp_path) as srv:
        seeded(srv)
        flood = RawClient(srv.sock_path)
        flood.hello()
        frame = S.encode_frame({"op": "lookup", "namespace": NS.to_dict(),
                                "keys": [KEYS[0].hex()]})
        stop, answered = threading.Event(), [0]

        def send():
            try:
                while not stop.is_set():
                    flood.sock.sendall(frame * 2000)
            except OSError:
                pass

        def read():
            try:
                while not stop.is_set():
                    answered[0] += len(flood.sock.recv(1 << 20))
            except OSError:
                pass
        threads = [threading.Thread(target=send, daemon=True),
                   threading.Thread(target=read, daemon=True)]
        for t in threads:
            t.start()
        other = RawClient(srv.sock_path, timeout=5)
        try:
            assert wait_until(lambda: answered[0] > 100_000, 10)  # the flood is served
            assert other.hello()["ok"]
            for _ in range(3):
                t0 = time.monotonic()
                assert other.keys_op("lookup", KEYS[:2])["num_hit_chunks"] == 2
                conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
                conn.request("GET", "/healthz")
                assert conn.getresponse().status == 200
                conn.close()
                assert time.monotonic() - t0 < 4
            assert not stop.is_set() and threads[0].is_alive()  # still flooding meanwhile
        finally:
            stop.set()
            flood.sock.shutdown(socket.SHUT_RDWR)
            for t in threads:
                t.join(10)
            flood.close()
            other.close()
        assert serves_others(srv)


def test_kvstore_serve_keeps_answering_with_both_paths_full(tmp_path):
    """A real ``kvstore serve`` at RLIMIT_NOFILE 256 (cap 128): 200 same-host clients (at the
    cap each newcomer closes the one idle longest), then 200 idle HTTP connections. /healthz
    is answered at once (the idle ones make room, or it is refused 503), never left hanging
    for lack of descriptors, and a new same-host client is served."""
    import resource

    from tests.kvstore.daemon.hostile_helpers import Serve, raw_request

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    path = str(tmp_path / "kv.sock")
    srv = Serve(tmp_path, 256, "--unix-socket", path, "--page-bytes", "256")
    held, idle_http = [], []
    try:
        srv.proc.stdout.readline()  # the same-host path's line
        while len(held) < 200:
            c = RawClient(path)
            if not c.hello(map_arena=False)["ok"]:
                c.close()
                break
            held.append(c)
        assert len(held) == 200  # none refused: each closed an idle one at the cap
        idle_http = [socket.create_connection(("127.0.0.1", srv.port), timeout=5)
                     for _ in range(200)]
        time.sleep(0.5)
        t0 = time.monotonic()
        status, _ = raw_request(srv.port, b"GET /healthz HTTP/1.1\r\nHost: x", timeout_s=5)
        assert status in (200, 503) and time.monotonic() - t0 < 3
        c = RawClient(path)
        assert c.hello(map_arena=False)["ok"] and c.keys_op("exists", KEYS[:1])["exists"] == [False]
        held.append(c)
    finally:
        for s in idle_http:
            s.close()
        for c in held:
            c.close()
        log = srv.stop()
    assert "Traceback" not in log and log.count("accept") <= 2, log[-2000:]


def test_descriptors_attached_to_request_bytes_are_not_hoarded(tmp_path):
    """Only ``stage`` passes a descriptor, on its payload byte; a client that attaches 16 to
    each byte of a frame it sends one byte at a time had every one kept by the read-ahead
    until the frame ended (5,000 bytes filled a daemon's table of 1024: HTTP hung). At most
    ``MAX_HELD_FDS`` are kept; the frame is still served, and nothing stays open."""
    import array
    import os

    from kvstore.daemon import shm_reader

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with shm_daemon(tmp_path) as srv:
        seeded(srv)
        c = RawClient(srv.sock_path)
        c.hello()
        base = open_fds()
        r, w = os.pipe()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r] * 16).tobytes())]
        frame = S.encode_frame({"op": "lookup", "namespace": NS.to_dict(),
                                "keys": [KEYS[0].hex()]})
        for i in range(40):  # one byte per message, each carrying 16 descriptors
            c.sock.sendmsg([frame[i:i + 1]], anc)
        time.sleep(0.3)
        held = open_fds() - base - 2  # (the pipe's two ends are this test's)
        assert held <= getattr(shm_reader, "MAX_HELD_FDS", 16), held  # (was 640)
        c.sock.sendall(frame[40:])
        assert c.recv()[0]["num_hit_chunks"] == 1
        c.close()
        os.close(r)
        os.close(w)
        assert wait_until(lambda: open_fds() <= base)
        assert serves_others(srv)

"""Trying to break the daemon's direct I/O (``kvstore serve`` over a CPU-tier ChunkStore) with bad
clients: disconnects at every interesting offset, wrong framing, stalled readers, races with
remove/clear, full arenas, and request timeouts that land while a store call is running.

After every scenario: nothing torn is visible, the server answers /healthz, the store passes
``check_integrity()``, the CPU tier's used bytes are exactly its chunks' pages (no leaked
reservation) and no reader pin is left.

Tiny layout: 2 layers, 1 KV head, head_dim 8, fp16, chunk_size 4 -> 256-byte chunks, 256-byte
pages (one page per chunk).
"""
import http.client
import json
import socket
import threading
import time

import pytest
import torch

from kvstore.daemon import protocol as P
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import STATE_KEY, ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import parse_get_body

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
CB = LAYOUT.chunk_bytes  # 256
NS = Namespace("tiny-model", LAYOUT)
KEYS = NS.chunk_keys(list(range(4 * 8)))  # 8 chained chunk keys
TOKEN = "t0k"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16)  # [2, 2, 4, 1, 8]


def put_body(keys, kvs, durable=False):
    parts = [P.entry_for(k, kv) for k, kv in zip(keys, kvs)]
    return P.put_header(NS, [e for e, _ in parts], durable) + b"".join(bytes(v) for _, v in parts)


def request(srv, method, path, body=None, headers=None, timeout=10):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    hdrs = dict(AUTH)
    hdrs.update(headers or {})
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def do_put(srv, body):
    status, data = request(srv, "POST", "/v1/put", body, {"Content-Type": P.BINARY_CONTENT_TYPE})
    return status, json.loads(data)


def do_get(srv, keys):
    status, data = request(srv, "POST", "/v1/get", P.key_request(NS, keys),
                           {"Content-Type": "application/json"})
    if status != 200:
        return status, json.loads(data)
    return status, parse_get_body(data, NS, keys)


def raw_post(srv, path, head_extra: str, body: bytes) -> socket.socket:
    s = socket.create_connection((srv.host, srv.port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
              f"{head_extra}\r\n".encode() + body)
    return s


def exchange(srv, path, head_extra: str, body: bytes) -> bytes:
    """``raw_post`` a whole request, read the reply, close."""
    s = raw_post(srv, path, head_extra, body)
    reply = read_reply(s)
    s.close()
    return reply


def read_reply(s: socket.socket, timeout=5.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            got = s.recv(65536)
            if not got:
                break
            out += got
            if b"\r\n\r\n" in out:
                head, _, rest = out.partition(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        if len(rest) >= int(line.split(b":")[1]):
                            return out
    except (socket.timeout, ConnectionResetError):
        pass
    return out


def settled(srv, timeout=3.0):
    """Wait for the server to go idle, then check every invariant of the brief."""
    store, state = srv.store, srv.app[STATE_KEY]
    deadline = time.monotonic() + timeout
    while (state.active or store._pins.pinned_keys() or store.tiers[0]._reserved) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    store.check_integrity()
    cpu = store.tiers[0]
    assert cpu._reserved == {}, "leaked reservation"
    assert cpu.used_bytes == sum(cpu.nbytes_of(k) for k in cpu.keys()), "pages not accounted"
    assert store._pins.pinned_keys() == set(), "leftover pins"
    assert state.budget.held == 0, "leaked payload budget"
    assert request(srv, "GET", "/healthz")[0] == 200


def make_server(cpu_chunks=8, disk=None, **limits):
    store = ChunkStore(StoreConfig(cpu_bytes=cpu_chunks * CB, page_bytes=CB,
                                   disk_path=disk, disk_bytes=(64 << 20) if disk else 0,
                                   promote_on_hit=False))
    srv = ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN, **limits)))
    srv.store = store
    return srv


@pytest.fixture(scope="module")
def server():
    srv = make_server(request_timeout_s=2.0)
    yield srv
    srv.stop()
    srv.store.close()


@pytest.fixture(autouse=True)
def _clean(request):
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        srv.store.clear()
        yield
        settled(srv)
    else:
        yield


# ---- disconnects and framing ------------------------------------------------------------------
BODY4 = put_body(KEYS[:4], [chunk(i) for i in range(4)])
HDR = len(BODY4) - 4 * CB  # preamble + header


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


# ---- request timeouts landing while a store call runs -----------------------------------------
def _hold_store_lock(store, seconds):
    """Hold the store lock from another thread (as a long clear/spill would)."""
    held = threading.Event()

    def run():
        with store._lock:
            held.set()
            time.sleep(seconds)
    t = threading.Thread(target=run)
    t.start()
    held.wait()
    return t


def test_put_timing_out_while_reserve_waits_for_the_store_lock_leaks_no_pages():
    """The 504 cancels the handler while reserve_chunks runs on the pool; its reservations
    must still be given back when it returns."""
    srv = make_server(request_timeout_s=0.3)
    try:
        t = _hold_store_lock(srv.store, 0.8)
        status, ans = do_put(srv, BODY4)
        t.join()
        assert status == 504, ans
        time.sleep(0.3)  # reserve_chunks runs once the lock is free, after the 504
        settled(srv)
        assert srv.store.tiers[0].used_bytes == 0 and srv.store.tiers[0].num_chunks == 0
        assert do_put(srv, BODY4)[1]["stored"] == 4  # the arena is whole again
        settled(srv)
    finally:
        srv.stop()
        srv.store.close()


def test_get_timing_out_while_borrow_waits_for_the_store_lock_leaks_no_pins():
    srv = make_server(request_timeout_s=0.3)
    try:
        assert do_put(srv, BODY4)[1]["stored"] == 4
        t = _hold_store_lock(srv.store, 0.8)
        status, ans = do_get(srv, KEYS[:4])
        t.join()
        assert status == 504, ans
        time.sleep(0.3)  # borrow_chunks runs once the lock is free, after the 504
        settled(srv)
        srv.store.remove(NS, KEYS[:4])  # unpinned: gone at once, pages back
        assert srv.store.tiers[0].used_bytes == 0
        settled(srv)
    finally:
        srv.stop()
        srv.store.close()


# ---- stalled readers, removal mid-send -------------------------------------------------------
BIG = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16", chunk_size=64)
BIG_NS = Namespace("big-model", BIG)  # 512 KiB chunks
BIG_KEYS = BIG_NS.chunk_keys(list(range(64 * 24)))


def big_chunk(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BIG.shape(), generator=g).to(torch.float16)


def test_a_get_whose_client_stops_reading_is_aborted_and_its_pins_dropped():
    store = ChunkStore(StoreConfig(cpu_bytes=24 * BIG.chunk_bytes, page_bytes=BIG.chunk_bytes,
                                   promote_on_hit=False))
    srv = ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN, request_timeout_s=0.5,
                                                        max_body_bytes=64 << 20)))
    srv.store = store
    try:
        kvs = [big_chunk(i) for i in range(24)]
        parts = [P.entry_for(k, kv) for k, kv in zip(BIG_KEYS, kvs)]
        body = P.put_header(BIG_NS, [e for e, _ in parts]) + b"".join(bytes(v) for _, v in parts)
        assert do_put(srv, body)[1]["stored"] == 24
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((srv.host, srv.port))
        req = P.key_request(BIG_NS, BIG_KEYS[:24])
        s.sendall(f"POST /v1/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  f"Content-Length: {len(req)}\r\n\r\n".encode() + req)
        time.sleep(0.2)
        assert store.pin_count(BIG_KEYS[0]) == 1  # being sent
        store.remove(BIG_NS, BIG_KEYS[:24])  # removed mid-send: invisible now, freed at unpin
        assert store.exists(BIG_NS, BIG_KEYS[:1]) == [False]
        deadline = time.monotonic() + 5
        while store._pins.pinned_keys() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store._pins.pinned_keys() == set()
        assert store.tiers[0].used_bytes == 0 and store.tiers[0].num_chunks == 0
        # the stalled connection was aborted: draining it yields a truncated body, then EOF
        s.settimeout(2)
        got = b""
        try:
            while True:
                d = s.recv(1 << 20)
                if not d:
                    break
                got += d
        except (ConnectionResetError, socket.timeout):
            pass
        s.close()
        assert len(got) < 24 * BIG.chunk_bytes
        store.check_integrity()
        assert request(srv, "GET", "/healthz")[0] == 200
    finally:
        srv.stop()
        store.close()


def test_concurrent_puts_gets_removes_and_clears_never_show_a_torn_chunk(server):
    stop = time.monotonic() + 1.5
    errors = []

    def putter():
        while time.monotonic() < stop:
            st, ans = do_put(server, BODY4)
            if st != 200:
                errors.append(("put", st, ans))

    def getter():
        while time.monotonic() < stop:
            st, got = do_get(server, KEYS[:4])
            if st == 200:
                for i, g in enumerate(got):
                    if g is not None and not torch.equal(g, chunk(i)):
                        errors.append(("torn", i))
            elif st != 404:
                errors.append(("get", st, got))

    def remover():
        i = 0
        while time.monotonic() < stop:
            i += 1
            if i % 2:
                request(server, "POST", "/v1/clear", json.dumps({"all": True}).encode(),
                        {"Content-Type": "application/json"})
            else:
                request(server, "POST", "/v1/remove", P.key_request(NS, KEYS[1:3]),
                        {"Content-Type": "application/json"})
            time.sleep(0.005)
    ts = [threading.Thread(target=f) for f in (putter, putter, getter, getter, remover)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


def test_staged_put_timing_out_in_its_commit_does_not_lend_its_buffer_to_the_next_put(tmp_path):
    """Durable puts are staged in pooled buffers. A 504 landing while the store call waits
    for the lock gave the buffer back to the pool at once; the next put read its payload into
    that same buffer, and the first commit then stored the second put's bytes under the first
    put's key (no checksum saw it)."""
    srv = make_server(disk=str(tmp_path / "db"), request_timeout_s=0.3)
    try:
        t = _hold_store_lock(srv.store, 1.2)
        a, b = chunk(100), chunk(200)
        status, _ = do_put(srv, put_body(KEYS[:1], [a], durable=True))
        assert status == 504
        status, _ = do_put(srv, put_body(KEYS[5:6], [b], durable=True))
        assert status == 504
        t.join()
        time.sleep(0.5)  # both commits run now
        srv.store.flush(10)
        got = srv.store.get_chunks(NS, [KEYS[0], KEYS[5]])
        assert got[0] is None or torch.equal(got[0], a)
        assert got[1] is None or torch.equal(got[1], b)
        settled(srv)
    finally:
        srv.stop()
        srv.store.close()


# ---- full arenas, durable puts ---------------------------------------------------------------
def test_put_below_an_arena_full_of_pinned_chunks_goes_to_disk_bit_exact(tmp_path):
    srv = make_server(cpu_chunks=2, disk=str(tmp_path / "db"))
    try:
        store = srv.store
        assert do_put(srv, put_body(KEYS[:2], [chunk(0), chunk(1)]))[1]["stored"] == 2
        assert store.pin(NS, KEYS[:2]) == 2
        status, ans = do_put(srv, put_body(KEYS[:5], [chunk(i) for i in range(5)]))
        assert status == 200 and ans["stored"] == 3
        store.flush(10)
        assert all(store.tiers[1].contains(k) for k in KEYS[2:5])
        assert not any(store.tiers[0].contains(k) for k in KEYS[2:5])
        # a get of pinned CPU chunks and disk chunks at once, while the arena stays pinned
        status, got = do_get(srv, KEYS[:5])
        assert status == 200 and all(torch.equal(g, chunk(i)) for i, g in enumerate(got))
        assert store.stats()["rejected_chunks"] == 0
        store.unpin(NS, KEYS[:2])
        settled(srv)
        # a checksum failure in the staged path gives the budget and the pages back too
        e, v = P.entry_for(KEYS[6], chunk(6))
        bad = P.ChunkEntry(e.key, e.nbytes, e.dtype, e.shape, "0" * 16)
        store.pin(NS, store.tiers[0].keys())
        status, ans = do_put(srv, P.put_header(NS, [bad]) + bytes(v))
        assert status == 400 and "checksum" in ans["error"]
        store.unpin(NS, store.tiers[0].keys())
        settled(srv)
        assert store.exists(NS, KEYS[6:7]) == [False]
    finally:
        srv.stop()
        srv.store.close()


def test_durable_put_over_direct_io_commits_to_disk_and_its_cpu_copy_is_exact(tmp_path):
    srv = make_server(disk=str(tmp_path / "db"))
    try:
        status, ans = do_put(srv, put_body(KEYS[:3], [chunk(i) for i in range(3)], durable=True))
        assert status == 200 and ans == {"stored": 3, "num_chunks": 3, "durable": True}
        disk = srv.store.tiers[1]
        assert all(disk.contains(k) and not disk.is_pending(k) for k in KEYS[:3])
        # a durable re-put of stored keys: nothing new, still durable, same bytes
        status, ans = do_put(srv, put_body(KEYS[:3], [chunk(i) for i in range(3)], durable=True))
        assert status == 200 and ans["stored"] == 0 and ans["durable"]
        status, got = do_get(srv, KEYS[:3])
        assert all(torch.equal(g, chunk(i)) for i, g in enumerate(got))
        settled(srv)
    finally:
        srv.stop()
        srv.store.close()


# ---- the real CLI: SIGTERM during uploads, restart on the same disk path ----------------------
def _start_cli(tmp_path, *extra):
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.daemon.cli", "serve", "--port", "0",
                             "--cpu-bytes", "1MiB", "--disk-path", str(tmp_path / "db"),
                             "--disk-bytes", "64MiB", "--auth-token", TOKEN, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    host, port = line.strip().rsplit("//", 1)[1].split(":")

    class Srv:
        pass
    srv = Srv()
    srv.host, srv.port, srv.proc = host, int(port), proc
    return srv


def test_sigterm_mid_upload_lets_it_finish_flushes_and_a_restart_serves_it(tmp_path):
    import signal
    srv = _start_cli(tmp_path)
    try:
        kvs = [chunk(300 + i) for i in range(4)]
        body = put_body(KEYS[:4], kvs, durable=True)  # only disk-tier chunks outlive a restart
        cut = len(body) - 3 * CB + 10  # inside the second payload
        s = raw_post(srv, "/v1/put", f"Content-Length: {len(body)}\r\n", body[:cut])
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        s.sendall(body[cut:])
        reply = read_reply(s)
        s.close()
        assert reply.startswith(b"HTTP/1.1 200") and b'"stored": 4' in reply, reply[-200:]
        assert srv.proc.wait(20) == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    srv = _start_cli(tmp_path)  # restart on the same disk path: the chunks were flushed
    try:
        status, got = do_get(srv, KEYS[:5])
        assert status == 200 and got[4] is None
        assert all(torch.equal(g, kv) for g, kv in zip(got, kvs))
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0


def test_sigterm_with_an_upload_that_never_finishes_exits_after_the_drain_timeout(tmp_path):
    import signal
    srv = _start_cli(tmp_path, "--shutdown-timeout-s", "1")
    try:
        assert do_put(srv, put_body(KEYS[:2], [chunk(0), chunk(1)], durable=True))[0] == 200
        body = put_body(KEYS[2:4], [chunk(2), chunk(3)], durable=True)
        s = raw_post(srv, "/v1/put", f"Content-Length: {len(body)}\r\n", body[:-7])
        time.sleep(0.2)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0
        s.close()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    srv = _start_cli(tmp_path)
    try:
        status, got = do_get(srv, KEYS[:4])
        assert status == 200 and got[2] is None and got[3] is None  # nothing torn
        assert torch.equal(got[0], chunk(0)) and torch.equal(got[1], chunk(1))
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0


def test_a_stalled_or_vanished_uploader_evicts_at_most_one_chunk():
    """Reserving every chunk of a put when its header arrived evicted the whole arena for a
    ~1 KB header: a client that then stalled or vanished left an empty cache (no disk tier:
    the 8 evicted chunks were lost). Pages are now reserved as each payload is about to
    arrive."""
    srv = make_server(cpu_chunks=8)
    try:
        kvs = [chunk(i) for i in range(8)]
        assert do_put(srv, put_body(KEYS[:8], kvs))[1]["stored"] == 8
        other = Namespace("tiny-model", LAYOUT, cache_salt="b")
        okeys = other.chunk_keys(list(range(32)))
        parts = [P.entry_for(k, chunk(50 + i)) for i, k in enumerate(okeys)]
        body = P.put_header(other, [e for e, _ in parts]) + bytes(parts[0][1])[:100]
        s = raw_post(srv, "/v1/put", f"Content-Length: {len(body) - 100 + 8 * CB}\r\n", body)
        time.sleep(0.3)
        assert srv.store.tiers[0].num_chunks == 7  # was 0: all 8 evicted for the header
        s.close()
        settled(srv)
        assert sum(srv.store.exists(NS, KEYS[:8])) == 7  # the policy's one victim only
        assert srv.store.exists(other, okeys[:8]) == [False] * 8
        status, got = do_get(srv, KEYS[:8])
        assert sum(g is None for g in got) == 1
        assert all(torch.equal(g, kv) for g, kv in zip(got, kvs) if g is not None)
    finally:
        srv.stop()
        srv.store.close()

"""Trying to break the daemon's direct I/O with timing: request timeouts that land while a store
call runs, stalled readers, removes and clears racing puts and gets, and staged puts timing out in
their commit. After each: nothing torn visible, no page or pin leaked.
"""
import json
import socket
import threading
import time

import torch

from kvstore.daemon import protocol as P
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore

from tests.kvstore.daemon.direct_io_helpers import (
    BODY4, KEYS, NS, TOKEN, chunk, do_get, do_put, make_server, put_body, request, settled,
)
from tests.kvstore.daemon.direct_io_helpers import _clean, server  # noqa: F401  (fixtures)


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

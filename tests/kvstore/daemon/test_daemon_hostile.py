"""``kvstore serve`` against hostile or buggy clients: each hostile input, with its exact
status and effect.

* idle and trickling connections under a 256-descriptor limit (a real ``kvstore serve`` with
  ``RLIMIT_NOFILE`` lowered): the cap holds, a lookup is answered, idle sockets are closed,
  ``accept()`` failures are logged once per interval;
* inputs that used to get 500: a 4,301-digit integer, ``Infinity`` in a layout field, a
  non-UTF-8 byte in ``Authorization``;
* 1,000 malformed HTTP requests: a quiet log and a metric that counts 1,000;
* keys of the wrong length for the namespace's hash, ``Transfer-Encoding: gzip, chunked``;
* per-namespace state bounded by ``max_namespaces``, evictions counted.
"""
import gzip
import json
import logging
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvstore.daemon import protocol as P
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.config import default_max_connections
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore

ROOT = Path(__file__).resolve().parents[3]
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
NS = Namespace("tiny-model", LAYOUT)
XXH_NS = Namespace("tiny-model", LAYOUT, hash_algo="xxh3_128")
TOKEN = "hostile-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEYS = NS.chunk_keys(list(range(4 * 3)))
JSON_ROUTES = ("lookup", "exists", "get", "remove", "pin", "unpin")
PROTECTED_GET = ("/metrics", "/v1/stats")


# ---- helpers ----------------------------------------------------------------------------------
def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16)  # [2, 2, 4, 1, 8]


def put_body(ns: Namespace, keys, header_edit=None) -> bytes:
    """A put body of ``keys`` (random chunks); ``header_edit(header_dict)`` may change the
    header before it is encoded."""
    entries, views = zip(*[P.entry_for(k, chunk(i)) for i, k in enumerate(keys)])
    header = {"namespace": ns.to_dict(), "durable": False, "chunks": [e.to_dict() for e in entries]}
    if header_edit is not None:
        header_edit(header)
    blob = json.dumps(header).encode()
    return P.PREAMBLE.pack(P.MAGIC, len(blob)) + blob + b"".join(bytes(v) for v in views)


def raw_request(port: int, head: bytes, body: bytes = b"", timeout_s: float = 10.0):
    """Send ``head`` (request line + headers, no final blank line) and ``body`` on a new
    connection; return (status, parsed JSON body or raw bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            if not got:
                break
            data += got
        head_part, _, rest = data.partition(b"\r\n\r\n")
        status = int(head_part.split(b" ")[1])
        length = None
        for line in head_part.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while length is not None and len(rest) < length:
            got = s.recv(65536)
            if not got:
                break
            rest += got
    try:
        return status, json.loads(rest)
    except ValueError:
        return status, rest


def post(port: int, path: str, body: bytes, headers: dict | None = None,
         content_type: str = "application/json"):
    hdrs = {"Host": "x", "Content-Type": content_type, "Content-Length": str(len(body)),
            **AUTH, **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\n".encode() + b"\r\n".join(
        k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()) for k, v in hdrs.items())
    return raw_request(port, head, body)


def get(port: int, path: str, headers: dict | None = None):
    hdrs = {"Host": "x", **AUTH, **(headers or {})}
    head = f"GET {path} HTTP/1.1\r\n".encode() + b"\r\n".join(
        k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()) for k, v in hdrs.items())
    return raw_request(port, head)


def metric(text: str, name: str) -> float:
    """Value of the sample ``name`` (with labels, exactly as exposed) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def num_chunks(store: ChunkStore) -> int:
    return sum(t["num_chunks"] for t in store.stats()["tiers"].values())


@pytest.fixture(scope="module")
def server():
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256, max_namespaces=64))
    srv = ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN, max_batch_keys=8)))
    srv.store = store
    yield srv
    srv.stop()
    store.close()


@pytest.fixture(autouse=True)
def _empty(request):
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        srv.store.clear()
        yield
        assert get(srv.port, "/healthz")[0] == 200
    else:
        yield


# ---- 1. idle connections, a connection cap, accept() failures ---------------------------------
class Serve:
    """A real ``kvstore serve`` on a free port with ``RLIMIT_NOFILE`` = ``nofile``."""

    def __init__(self, tmp_path, nofile: int, *flags: str):
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "wb")

        def limit_fds():
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--port", "0", "--cpu-bytes", "1MiB",
             "--log-level", "info", *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=limit_fds)
        line = self.proc.stdout.readline().decode()
        assert "listening on" in line, self.log_path.read_text()
        self.port = int(line.strip().rsplit(":", 1)[1])

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        self.log.close()
        return self.log_path.read_text()


def open_idle(port: int, n: int) -> list[socket.socket]:
    """``n`` connections: even ones send nothing, odd ones part of a request line."""
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 2:
            s.sendall(b"GET /heal")
        socks.append(s)
    return socks


def closed_by_server(socks, deadline: float) -> int:
    """How many of ``socks`` see EOF (or a reset) before ``deadline`` (time.monotonic)."""
    pending, closed = list(socks), 0
    while pending and time.monotonic() < deadline:
        ready, _, _ = select.select(pending, [], [], 0.2)
        for s in ready:
            try:
                data = s.recv(4096)
            except ConnectionResetError:
                data = b""
            if not data:
                closed += 1
                pending.remove(s)
    for s in socks:
        s.close()
    return closed


def lookup_body(ns: Namespace = NS, keys=KEYS) -> bytes:
    return P.key_request(ns, keys)


def test_default_connection_cap_leaves_room_below_the_descriptor_limit():
    assert default_max_connections(256) == 128  # 256 - 64 kept - 64 for a burst of accepts
    assert default_max_connections(1024) == 832
    assert default_max_connections(65536) == 65536 - 8192 - 64
    assert default_max_connections(100) == 1


def test_300_idle_sockets_under_a_256_fd_limit_a_lookup_is_served_and_idle_ones_closed(tmp_path):
    srv = Serve(tmp_path, 256, "--idle-timeout-s", "4", "--auth-token", TOKEN)
    try:
        t_open = time.monotonic()
        socks = open_idle(srv.port, 300)
        opened_s = time.monotonic() - t_open
        t0 = time.monotonic()
        status, ans = post(srv.port, "/v1/lookup", lookup_body())
        assert status == 200 and ans["num_hit_chunks"] == 0 and ans["num_requested_chunks"] == 3
        assert time.monotonic() - t0 < 3.0  # served at once: an idle connection made room
        status, text = get(srv.port, "/metrics")
        text = text.decode()
        assert metric(text, "kvstore_server_connections") <= 128  # the cap (256 fds) holds
        assert metric(text, "kvstore_server_accept_errors_total") == 0
        if opened_s < 3.5:  # (no idle timeout fired yet) 300 idle + the lookup's connection
            # in 128 slots; the lookup's was closed by the client before /metrics connected
            assert metric(text, 'kvstore_server_connections_closed_total'
                                '{reason="idle_evicted"}') == 301 - 128
        # every idle or trickling socket is closed by the server within the idle timeout
        assert closed_by_server(socks, t_open + opened_s + 4.0 + 3.0) == 300
    finally:
        log = srv.stop()
    assert "accept() failed" not in log and "Traceback" not in log


def test_accept_failures_are_counted_and_logged_once_per_interval(tmp_path):
    # a cap above the descriptor limit: accept() itself runs out of descriptors
    srv = Serve(tmp_path, 256, "--idle-timeout-s", "2", "--max-connections", "1000")
    try:
        t_open = time.monotonic()
        socks = open_idle(srv.port, 300)
        time.sleep(0.5)
        status, _ = post(srv.port, "/v1/lookup", lookup_body())  # once idle ones are closed
        assert status == 200
        assert closed_by_server(socks, t_open + 2.0 + 6.0) >= 300 - 1  # (the backlog's last one)
        status, text = get(srv.port, "/metrics")
        failures = metric(text.decode(), "kvstore_server_accept_errors_total")
    finally:
        log = srv.stop()
    lines = [ln for ln in log.splitlines() if "accept() failed" in ln]
    assert failures >= 1
    assert 1 <= len(lines) <= 2  # at most once per 10 s (the test runs < 10 s after the first)
    assert "Traceback" not in log and len(log) < 4000


def _metrics_text(port: int) -> str:
    return get(port, "/metrics")[1].decode()


def test_at_the_cap_a_never_used_idle_connection_is_closed_before_a_used_one():
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256))
    srv = ThreadedServer(create_app(store), max_connections=2)
    try:
        used = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        used.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert used.recv(4096).startswith(b"HTTP/1.1 200 OK")  # served, now idle keep-alive
        silent = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        time.sleep(0.2)
        status, _ = get(srv.port, "/healthz")  # a third connection: ``silent`` makes room
        assert status == 200
        assert closed_by_server([silent], time.monotonic() + 5) == 1
        used.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # still open and served
        assert used.recv(4096).startswith(b"HTTP/1.1 200 OK")
        text = _metrics_text(srv.port)
        assert metric(text, 'kvstore_server_connections_closed_total{reason="idle_evicted"}') == 1
        assert metric(text, 'kvstore_server_connections_closed_total{reason="refused_busy"}') == 0
        used.close()
    finally:
        srv.stop()
        store.close()


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503_and_nothing_is_lost():
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256))
    srv = ThreadedServer(create_app(store), max_connections=2)
    try:
        bodies = [put_body(NS, NS.chunk_keys([i] * 4)) for i in (1, 2)]  # two prompts' chunks
        busy = []
        for body in bodies:  # two uploads in progress: half their body sent
            head = (f"POST /v1/put HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    f"{P.BINARY_CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(head + body[:len(body) // 2])
            busy.append(s)
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            answer = b""
            while True:
                got = s.recv(4096)
                if not got:
                    break
                answer += got
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
            "error": "connection limit reached; every connection is busy", "status": 503}
        for s, body in zip(busy, bodies):  # the uploads finish and are stored
            s.sendall(body[len(body) // 2:])
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200 OK") and b'"stored": 1' in reply
            s.close()
        assert sum(t["num_chunks"] for t in store.stats()["tiers"].values()) == 2
        time.sleep(0.2)
        text = _metrics_text(srv.port)
        assert metric(text, 'kvstore_server_connections_closed_total{reason="refused_busy"}') == 1
    finally:
        srv.stop()
        store.close()


# ---- 2. inputs that used to reach a 500 -------------------------------------------------------
HUGE = "9" * 4301  # one digit over Python's int/str conversion limit


def _with_huge(body: dict, where: str) -> bytes:
    """``body`` as JSON with the 4,301-digit integer as field ``where``."""
    blob = json.dumps({**body, where: "@HUGE@"})
    return blob.replace('"@HUGE@"', HUGE).encode()


@pytest.mark.parametrize("route", JSON_ROUTES + ("clear",))
def test_a_4301_digit_integer_in_a_json_route_is_400_and_stores_nothing(server, route):
    base = {"namespace": NS.to_dict(), "keys": [KEYS[0].hex()]}
    for field in ("lease_s", "keys", "namespace"):
        status, ans = post(server.port, f"/v1/{route}", _with_huge(base, field))
        assert status == 400 and ans["error"].startswith("malformed JSON in request body: "
                                                         "Exceeds the limit (4300 digits)")
    assert num_chunks(server.store) == 0


def test_a_4301_digit_integer_in_the_put_header_is_400_and_stores_nothing(server):
    def huge_nbytes(h):
        h["chunks"][0]["nbytes"] = "@HUGE@"
    body = put_body(NS, KEYS[:2], huge_nbytes)
    hdr_len = int.from_bytes(body[4:8], "little")
    header = body[8:8 + hdr_len].replace(b'"@HUGE@"', HUGE.encode())
    body = P.PREAMBLE.pack(P.MAGIC, len(header)) + header + body[8 + hdr_len:]
    status, ans = post(server.port, "/v1/put", body, content_type=P.BINARY_CONTENT_TYPE)
    assert status == 400 and ans["error"].startswith("malformed JSON in put header: Exceeds")
    assert num_chunks(server.store) == 0


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e999", "2.5", '"3"',
                                   "true", "null", "[2]"])
def test_a_non_integer_layout_field_is_400_on_every_route_and_in_the_put_header(server, value):
    ns_json = json.dumps(NS.to_dict()).replace('"num_layers": 2', f'"num_layers": {value}')
    keys_json = json.dumps([KEYS[0].hex()])
    for route in JSON_ROUTES:
        body = f'{{"namespace": {ns_json}, "keys": {keys_json}}}'.encode()
        status, ans = post(server.port, f"/v1/{route}", body)
        assert (status, ans["error"]) == (400, "bad namespace: layout.num_layers must be an "
                                               f"integer, got {str(json.loads(value))[:40]!r}")
    status, ans = post(server.port, "/v1/clear", f'{{"namespace": {ns_json}}}'.encode())
    assert status == 400 and "layout.num_layers must be an integer" in ans["error"]
    body = put_body(NS, KEYS[:1])
    hdr_len = int.from_bytes(body[4:8], "little")
    header = body[8:8 + hdr_len].replace(b'"num_layers": 2', f'"num_layers": {value}'.encode())
    body = P.PREAMBLE.pack(P.MAGIC, len(header)) + header + body[8 + hdr_len:]
    status, ans = post(server.port, "/v1/put", body, content_type=P.BINARY_CONTENT_TYPE)
    assert status == 400 and "layout.num_layers must be an integer" in ans["error"]
    assert num_chunks(server.store) == 0


def test_a_non_utf8_byte_in_authorization_is_401_on_every_protected_route(server):
    for bad in (b"Bearer \xff" + TOKEN.encode(), b"Bearer " + TOKEN.encode() + b"\xe9",
                b"\xc3\x28 " + TOKEN.encode()):
        for path in PROTECTED_GET:
            status, ans = get(server.port, path, {"Authorization": bad})
            assert (status, ans["error"]) == (401, "missing or wrong bearer token")
        for route in JSON_ROUTES + ("clear",):
            status, ans = post(server.port, f"/v1/{route}", lookup_body(),
                               {"Authorization": bad})
            assert (status, ans["error"]) == (401, "missing or wrong bearer token")
        status, _ = post(server.port, "/v1/put", put_body(NS, KEYS[:1]), {"Authorization": bad},
                         content_type=P.BINARY_CONTENT_TYPE)
        assert status == 401
    assert num_chunks(server.store) == 0


# ---- 3. malformed HTTP requests: counted, not logged ------------------------------------------
BAD_REQUESTS = [  # (reason label, a request aiohttp's Python parser refuses before any route)
    ("request_line", b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n"),
    ("too_long", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("header", b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"),
    ("header", b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"),
    ("body", b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
]


def test_1000_malformed_requests_keep_the_log_quiet_and_are_counted(tmp_path):
    srv = Serve(tmp_path, 1024, "--idle-timeout-s", "5")  # (default --http-parser python)
    try:
        for i in range(1000):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(BAD_REQUESTS[i % 5][1])
                assert s.recv(64).startswith(b"HTTP/1.0 400 Bad Request")
        text = get(srv.port, "/metrics")[1].decode()
    finally:
        log = srv.stop()
    counted = {r: metric(text, f'kvstore_server_client_errors_total{{reason="{r}"}}')
               for r in ("request_line", "too_long", "header", "body", "malformed", "disconnect")}
    assert counted == {"request_line": 200, "too_long": 200, "header": 400, "body": 200,
                       "malformed": 0, "disconnect": 0}
    assert "Traceback" not in log and "Error handling request" not in log
    assert len(log) < 2000  # start/stop lines only (was 804 KB of tracebacks)


# ---- 4. accepted but meaningless ----------------------------------------------------------------
def _short_key(ns: Namespace, n_hash: int) -> str:
    return (ns.ns_id + bytes(range(n_hash))).hex()


@pytest.mark.parametrize("ns,n_hash", [(NS, 16), (XXH_NS, 32)])
def test_a_key_of_the_wrong_length_for_the_hash_is_400_on_every_route(server, ns, n_hash):
    bad = _short_key(ns, n_hash)
    want = {16: 32, 32: 16}[n_hash]
    for route in JSON_ROUTES:
        body = json.dumps({"namespace": ns.to_dict(), "keys": [bad]}).encode()
        status, ans = post(server.port, f"/v1/{route}", body)
        assert (status, ans["error"]) == (
            400, f"key {bad[:16]}... has a {n_hash}-byte prefix hash; namespace hash_algo "
                 f"{ns.hash_algo} makes {want}-byte ones")
    good = ns.chunk_keys(list(range(4)))[0]

    def swap_key(h):
        h["chunks"][0]["key"] = bad
    status, ans = post(server.port, "/v1/put", put_body(ns, [good], swap_key),
                       content_type=P.BINARY_CONTENT_TYPE)
    assert status == 400 and f"{n_hash}-byte prefix hash" in ans["error"]
    assert num_chunks(server.store) == 0
    # the right length is stored and found
    status, ans = post(server.port, "/v1/put", put_body(ns, [good]),
                       content_type=P.BINARY_CONTENT_TYPE)
    assert (status, ans["stored"]) == (200, 1)


def _chunked(body: bytes, piece: int = 100) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece])
                   for i in range(0, len(body), piece))
    return out + b"0\r\n\r\n"


@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate, chunked", "br, chunked"])
def test_transfer_encoding_other_than_chunked_is_501_and_stores_nothing(server, coding):
    auth = f"Authorization: Bearer {TOKEN}".encode()
    for path, body, ctype in (("/v1/put", put_body(NS, KEYS[:2]), P.BINARY_CONTENT_TYPE),
                              ("/v1/lookup", lookup_body(), "application/json")):
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                f"Transfer-Encoding: {coding}\r\n").encode() + auth
        status, ans = raw_request(server.port, head, _chunked(body))
        assert (status, ans["error"]) == (
            501, f"Transfer-Encoding {coding!r} is not implemented (only chunked)")
    assert num_chunks(server.store) == 0
    # plain chunked is still fine
    head = (f"POST /v1/put HTTP/1.1\r\nHost: x\r\nContent-Type: {P.BINARY_CONTENT_TYPE}\r\n"
            "Transfer-Encoding: chunked\r\n").encode() + auth
    status, ans = raw_request(server.port, head, _chunked(put_body(NS, KEYS[:2])))
    assert (status, ans["stored"]) == (200, 2)


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_body_that_is_not_its_content_encoding_is_400_counted_and_not_logged(
        server, coding, caplog):
    # aiohttp raises RequestPayloadError when it reads such a body: it was a 500 with an ERROR
    # traceback (twice: ours, then aiohttp's lingering read of the rest of the body)
    sample = 'kvstore_server_client_errors_total{reason="body"}'
    before = metric(_metrics_text(server.port), sample)
    with caplog.at_level(logging.INFO):
        for path, ctype in (("/v1/put", P.BINARY_CONTENT_TYPE),
                            ("/v1/lookup", "application/json")):
            status, ans = post(server.port, path, b"not compressed",
                               {"Content-Encoding": coding}, ctype)
            assert (status, ans["error"]) == (
                400, f"cannot decode the request body: Can not decode content-encoding: {coding}")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert metric(_metrics_text(server.port), sample) == before + 2
    assert num_chunks(server.store) == 0
    # a body that is what it says is decoded: a gzip lookup is answered
    status, ans = post(server.port, "/v1/lookup", gzip.compress(lookup_body()),
                       {"Content-Encoding": "gzip"})
    assert (status, ans["num_hit_chunks"], ans["num_requested_chunks"]) == (200, 0, 3)


# ---- 5. per-namespace state is bounded ----------------------------------------------------------
def test_namespaces_beyond_the_cap_evict_the_least_recent_and_are_counted(server):
    store: ChunkStore = server.store
    cap = store.config.max_namespaces  # 64
    before_n = store.stats()["num_namespaces"]
    before_ev = store.stats()["namespace_evictions"]
    k = 37
    for i in range(cap + k):
        ns = Namespace("tiny-model", LAYOUT, cache_salt=f"cap-test-{i}")
        status, ans = post(server.port, "/v1/lookup", lookup_body(ns, ns.chunk_keys([1, 2, 3, 4])))
        assert status == 200
    st = store.stats()
    assert st["num_namespaces"] == cap
    # the earlier namespaces (NS and XXH_NS of other tests, at most 2) go first, then k + them
    assert st["namespace_evictions"] - before_ev == before_n + k
    text = get(server.port, "/metrics")[1].decode()
    assert metric(text, "kvstore_namespace_evictions_total") == st["namespace_evictions"]
    # an evicted namespace still works: its layout is checked again and its chunks are there
    ns0 = Namespace("tiny-model", LAYOUT, cache_salt="cap-test-0")
    keys0 = ns0.chunk_keys(list(range(8)))
    assert post(server.port, "/v1/put", put_body(ns0, keys0),
                content_type=P.BINARY_CONTENT_TYPE)[1]["stored"] == 2
    for i in range(cap):  # push ns0 out again
        ns = Namespace("tiny-model", LAYOUT, cache_salt=f"cap-test-again-{i}")
        post(server.port, "/v1/lookup", lookup_body(ns, ns.chunk_keys([1, 2, 3, 4])))
    status, ans = post(server.port, "/v1/lookup", lookup_body(ns0, keys0))
    assert (status, ans["num_hit_chunks"]) == (200, 2)
    assert store.stats()["num_namespaces"] == cap


def test_max_namespaces_must_be_positive():
    with pytest.raises(ValueError, match="max_namespaces"):
        StoreConfig(cpu_bytes=1 << 20, max_namespaces=0)

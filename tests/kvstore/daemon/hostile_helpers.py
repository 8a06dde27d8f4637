"""Shared pieces of the hostile-client daemon tests (``test_daemon_hostile_connections``,
``test_daemon_hostile_inputs``): raw HTTP over sockets, metric scraping, an in-process
``server`` fixture, and ``Serve``, a real ``kvstore serve`` subprocess with ``RLIMIT_NOFILE``
lowered.
"""
import json
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


def _metrics_text(port: int) -> str:
    return get(port, "/metrics")[1].decode()

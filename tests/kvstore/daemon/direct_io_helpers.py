"""Shared pieces of the daemon direct I/O fault tests (``test_direct_io_framing``,
``test_direct_io_races``, ``test_direct_io_arena_shutdown``): raw-socket clients, a server over a
CPU-tier ChunkStore, and ``settled``, which checks after every scenario that nothing torn is
visible, the server answers /healthz, the store passes ``check_integrity()``, the CPU tier's used
bytes are exactly its chunks' pages (no leaked reservation) and no reader pin is left.

Tiny layout: 2 layers, 1 KV head, head_dim 8, fp16, chunk_size 4 -> 256-byte chunks, 256-byte
pages (one page per chunk).
"""
import http.client
import json
import socket
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


# a 4-chunk put body; HDR = its preamble + header bytes
BODY4 = put_body(KEYS[:4], [chunk(i) for i in range(4)])
HDR = len(BODY4) - 4 * CB  # preamble + header

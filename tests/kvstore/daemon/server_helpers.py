"""Shared pieces of the daemon's in-process HTTP tests (``test_server_routes``,
``test_server_buffers``, ``test_client``, ``test_cli``, ``direct_io_helpers``): a tiny layout
and namespaces, a real ChunkStore, the module-scoped ``server`` fixture (a ``ThreadedServer``
with auth and small limits) with its per-test clean-up, and raw request helpers that send bytes
unaltered.
"""
import contextlib
import http.client
import json

import pytest
import torch

from kvstore.daemon import protocol as P
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore


LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
NS = Namespace("tiny-model", LAYOUT)
OTHER = Namespace("tiny-model", LAYOUT, cache_salt="tenant-b")
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_store(disk_path=None, cpu_bytes=1 << 20, disk_bytes=64 << 20) -> ChunkStore:
    """A real ChunkStore: a CPU tier, plus a disk tier when ``disk_path`` is given."""
    return ChunkStore(StoreConfig(cpu_bytes=cpu_bytes, page_bytes=256, disk_path=disk_path,
                                  disk_bytes=disk_bytes if disk_path else 0))


def chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16)  # [2, 2, 4, 1, 8]


KEYS = NS.chunk_keys(list(range(4 * 6)))  # 6 chained chunk keys


@contextlib.contextmanager
def token_daemon(token: str):
    """A daemon in this process (``ThreadedServer``) over a fresh ``make_store()`` that
    requires the bearer ``token``: yields ``(server, store)``, stops and closes both."""
    store = make_store()
    srv = ThreadedServer(create_app(store, ServerLimits(auth_token=token)))
    try:
        yield srv, store
    finally:
        srv.stop()
        store.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    store = make_store(str(tmp_path_factory.mktemp("disk")))
    limits = ServerLimits(auth_token=TOKEN, max_body_bytes=4096, max_batch_keys=8,
                          max_lease_s=1.0)
    srv = ThreadedServer(create_app(store, limits))
    srv.store = store
    yield srv
    srv.stop()
    store.close()


@pytest.fixture(autouse=True)
def _clean(server):
    server.store.clear()
    yield
    assert request(server, "GET", "/healthz")[0] == 200  # the server stays up after every test


def request(srv, method, path, body=None, headers=None, auth=True):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
    hdrs = dict(AUTH if auth else {})
    hdrs.update(headers or {})
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data, resp


def post_json(srv, path, obj, **kw):
    status, data, _ = request(srv, "POST", path, json.dumps(obj).encode(),
                              {"Content-Type": "application/json"}, **kw)
    return status, json.loads(data) if data.startswith(b"{") else data


def put_body(keys, kvs, ns=NS, durable=False, corrupt=None):
    parts = [P.entry_for(k, kv) for k, kv in zip(keys, kvs)]
    entries = [e for e, _ in parts]
    if corrupt is not None:  # header claims a checksum the payload does not have
        e = entries[corrupt]
        entries[corrupt] = P.ChunkEntry(e.key, e.nbytes, e.dtype, e.shape, "0" * 16)
    return P.put_header(ns, entries, durable) + b"".join(bytes(v) for _, v in parts)


def do_put(srv, body, **kw):
    status, data, _ = request(srv, "POST", "/v1/put", body,
                              {"Content-Type": P.BINARY_CONTENT_TYPE}, **kw)
    return status, json.loads(data)


def do_get(srv, keys, ns=NS):
    status, data, _ = request(srv, "POST", "/v1/get", P.key_request(ns, keys),
                              {"Content-Type": "application/json"})
    if status != 200:
        return status, json.loads(data)
    return status, parse_get_body(data, ns, keys)


def parse_get_body(data: bytes, ns, keys) -> list:
    """Chunks (``ns.layout.shape()``, fp16) or None per key of a whole get response body;
    asserts every checksum and that the body ends after the last payload."""
    hdr_len = P.decode_preamble(data[:8])
    entries = P.parse_get_response_header(json.loads(data[8:8 + hdr_len]), ns, keys)
    out, pos = [], 8 + hdr_len
    for e in entries:
        if not e.found:
            out.append(None)
            continue
        raw = bytearray(data[pos:pos + e.nbytes])
        pos += e.nbytes
        assert P.checksum(raw) == e.xxh3
        out.append(torch.frombuffer(raw, dtype=torch.float16).reshape(ns.layout.shape()))
    assert pos == len(data)
    return out


def stored(srv, keys, ns=NS):
    return post_json(srv, "/v1/exists", {"namespace": ns.to_dict(),
                                         "keys": [k.hex() for k in keys]})[1]["exists"]

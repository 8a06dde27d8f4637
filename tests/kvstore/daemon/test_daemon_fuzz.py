"""Property: no client input reaches a 500, and none stores anything.

Hypothesis writes requests to every route of an in-process daemon (``ThreadedServer`` over a
real ``ChunkStore``, a bearer token set), each on a new connection of a raw socket so that
malformed input reaches the server unaltered: JSON bodies mutated from valid ones (any field
replaced by any JSON value: huge integers, a 4,301-digit integer, NaN/Infinity, nested
containers, wrong types), keys of every length, put bodies with mutated headers and payloads of
any length, arbitrary bytes as a body, arbitrary (non-UTF-8) ``Authorization`` and protocol
headers, and transfer codings. Every answer must be a 2xx/4xx/501 status line, and after each
request the store holds no chunk and no pin. Bounded to a few seconds (``max_examples``).
"""
import json
import socket

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvstore.daemon import protocol as P
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.store import ChunkStore

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
NS = Namespace("fuzz-model", LAYOUT)
XXH = Namespace("fuzz-model", LAYOUT, hash_algo="xxh3_128")
TOKEN = "fuzz-token"
KEYS = NS.chunk_keys(list(range(4 * 3))) + XXH.chunk_keys(list(range(4)))
HUGE = "7" * 4301  # over Python's int/str conversion limit
ROUTES = [("GET", p) for p in ("/healthz", "/readyz", "/metrics", "/v1/stats", "/v1/whoami",
                               "/v1/nope", "/")] + \
         [("POST", f"/v1/{r}") for r in ("lookup", "exists", "get", "put", "remove", "clear",
                                         "pin", "unpin", "nope")] + \
         [("PUT", "/v1/put"), ("DELETE", "/v1/clear")]
KEY_ROUTES = [("POST", f"/v1/{r}") for r in ("lookup", "exists", "get", "put", "remove",
                                               "clear", "pin", "unpin")]


@pytest.fixture(scope="module")
def server():
    store = ChunkStore(StoreConfig(cpu_bytes=1 << 20, page_bytes=256, max_namespaces=16))
    srv = ThreadedServer(create_app(store, ServerLimits(auth_token=TOKEN, max_batch_keys=8,
                                                        max_body_bytes=1 << 16,
                                                        request_timeout_s=5.0)))
    srv.store = store
    yield srv
    srv.stop()
    store.close()


# ---- strategies -------------------------------------------------------------------------------
leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 300),
                 st.integers(-(10 ** 40), 10 ** 40), st.just("@HUGE@"),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                 st.sampled_from(["float16", "sha256", "xxh3_128", "blake2b", "bfloat16"]))
json_value = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                          max_leaves=8)


def mutated(base: dict, keys_values) -> st.SearchStrategy:
    """``base`` with some of its fields replaced, dropped or added (values from ``json_value``
    or ``keys_values``)."""
    field = st.sampled_from(sorted(base) + ["extra"])
    edits = st.lists(st.tuples(field, st.one_of(json_value, keys_values, st.just(KeyError))),
                     max_size=3)

    def apply(eds):
        out = dict(base)
        for k, v in eds:
            if v is KeyError:
                out.pop(k, None)
            else:
                out[k] = v
        return out
    return edits.map(apply)


hex_key = st.one_of(st.sampled_from([k.hex() for k in KEYS]),
                    st.binary(min_size=0, max_size=60).map(bytes.hex),
                    st.sampled_from([(NS.ns_id + bytes(16)).hex(), (XXH.ns_id + bytes(32)).hex(),
                                     "zz" * 24, KEYS[0].hex().upper(), KEYS[0].hex() + "0"]))
keys_list = st.lists(st.one_of(hex_key, json_value), max_size=10)
layout_dict = mutated(LAYOUT.to_dict(), st.integers(-2, 2 ** 70))
namespace = st.one_of(
    st.sampled_from([NS.to_dict(), XXH.to_dict()]),
    st.tuples(mutated(NS.to_dict(), json_value), layout_dict).map(
        lambda t: {**t[0], "layout": t[1]}),
    json_value)
json_body = st.one_of(
    mutated({"namespace": NS.to_dict(), "keys": [KEYS[0].hex()]}, keys_list),
    st.tuples(namespace, keys_list, json_value, json_value).map(
        lambda t: {"namespace": t[0], "keys": t[1], "lease_s": t[2], "all": t[3]}),
    json_value)


def _chunk_bytes(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16).view(torch.uint8).numpy().tobytes()


CHUNK = _chunk_bytes(0)
ENTRY = {"key": KEYS[0].hex(), "nbytes": len(CHUNK), "dtype": "float16",
         "shape": list(LAYOUT.shape()), "xxh3": "0" * 16}  # (never the right checksum)


@st.composite
def put_body(draw) -> bytes:
    header = {"namespace": draw(namespace), "durable": draw(json_value),
              "chunks": draw(st.lists(mutated(ENTRY, st.one_of(hex_key, keys_list)),
                                      max_size=3))}
    blob = _dumps(header)
    magic = draw(st.sampled_from([P.MAGIC, b"KVS\x02", b"XXXX"]))
    hdr_len = draw(st.sampled_from([len(blob), len(blob) + 5, 0, 2 ** 32 - 1]))
    payload = draw(st.sampled_from([CHUNK, CHUNK[:100], CHUNK * 2, b""]))
    return P.PREAMBLE.pack(magic, hdr_len) + blob + payload


def _dumps(obj) -> bytes:
    return json.dumps(obj).replace('"@HUGE@"', HUGE).encode()


header_value = st.one_of(st.binary(max_size=40).filter(lambda b: b"\r" not in b
                                                       and b"\n" not in b),
                         st.text(max_size=20).map(str.encode).filter(
                             lambda b: b"\r" not in b and b"\n" not in b))


def mostly(common, rare, n: int = 4) -> st.SearchStrategy:
    """``common`` in about ``n`` of ``n + 1`` draws, else ``rare`` (so most requests get past
    the auth and framing checks to the route's own validation)."""
    return st.integers(0, n).flatmap(lambda i: common if i < n else rare)


authorization = mostly(st.just(f"Bearer {TOKEN}".encode()),
                       st.one_of(st.none(), st.just(b"Bearer \xff\xfe" + TOKEN.encode()),
                                 st.just(f"bearer  {TOKEN} ".encode()), header_value))


@st.composite
def request(draw) -> tuple[str, str, bytes, dict]:
    method, path = draw(mostly(st.sampled_from(KEY_ROUTES), st.sampled_from(ROUTES), 2))
    kind = draw(mostly(st.just("put" if path == "/v1/put" else "json"),
                       st.sampled_from(["json", "put", "bytes", "none"]), 2))
    body = {"json": lambda: _dumps(draw(json_body)), "put": lambda: draw(put_body()),
            "bytes": lambda: draw(st.binary(max_size=200)), "none": lambda: b""}[kind]()
    headers = {}
    auth = draw(authorization)
    if auth is not None:
        headers[b"Authorization"] = auth
    if draw(st.booleans()):
        headers[b"X-KVStore-Protocol"] = draw(mostly(st.just(b"1"), st.one_of(
            st.sampled_from([b"2", b"-1", HUGE.encode()]), header_value)))
    headers[b"Content-Type"] = draw(st.sampled_from([b"application/json",
                                                     P.BINARY_CONTENT_TYPE.encode(),
                                                     b"text/plain"]))
    headers[b"Transfer-Encoding"] = draw(mostly(st.none(), st.sampled_from(
        [b"chunked", b"gzip, chunked", b"identity, chunked"])))
    return method, path, body, headers


def send(port: int, method: str, path: str, body: bytes, headers: dict) -> int:
    """One request on a new connection; the answer's status code."""
    te = headers.pop(b"Transfer-Encoding", None)
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: fuzz", b"Connection: close"]
    lines += [k + b": " + v for k, v in headers.items()]
    if te is not None:
        lines.append(b"Transfer-Encoding: " + te)
        framed = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    else:
        lines.append(b"Content-Length: %d" % len(body))
        framed = body
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + framed)
        data = b""
        while b"\r\n" not in data:
            got = s.recv(4096)
            if not got:
                break
            data += got
    assert data.startswith(b"HTTP/1."), f"no status line: {data[:80]!r}"
    return int(data.split(b" ", 2)[1])


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(req=request())
def test_no_input_reaches_a_500_and_none_stores_anything(server, req):
    method, path, body, headers = req
    status = send(server.port, method, path, body, dict(headers))
    assert 200 <= status < 500 or status == 501, (status, method, path, body[:200], headers)
    st_ = server.store.stats()
    assert sum(t["num_chunks"] for t in st_["tiers"].values()) == 0
    assert st_["num_pinned_chunks"] == 0
    assert st_["num_namespaces"] <= 16

"""``kvstore serve`` against hostile or buggy clients, part 2: each hostile input, with its exact
status and effect.

* inputs that used to get 500: a 4,301-digit integer, ``Infinity`` in a layout field, a
  non-UTF-8 byte in ``Authorization``;
* 1,000 malformed HTTP requests: a quiet log and a metric that counts 1,000;
* keys of the wrong length for the namespace's hash, ``Transfer-Encoding: gzip, chunked``;
* per-namespace state bounded by ``max_namespaces``, evictions counted.
"""
import gzip
import json
import logging
import socket

import pytest

from kvstore.daemon import protocol as P
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.store import ChunkStore

from tests.kvstore.daemon.hostile_helpers import (
    JSON_ROUTES, KEYS, LAYOUT, NS, PROTECTED_GET, TOKEN, XXH_NS, Serve, _metrics_text, get,
    lookup_body, metric, num_chunks, post, put_body, raw_request,
)
from tests.kvstore.daemon.hostile_helpers import _empty, server  # noqa: F401  (fixtures)


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


@pytest.mark.parametrize("field,value", [
    ("model_id", "m" * 20_000), ("cache_salt", "s" * 5_000),
    ("rope", {"long_factor": [1.0] * 2_000})])
def test_a_namespace_with_an_oversized_field_is_400_and_not_kept(server, field, value):
    """Every lookup names a namespace the daemon keeps (up to ``max_namespaces``): without a
    bound on its fields a reader could grow the daemon's memory by megabytes a request."""
    store: ChunkStore = server.store
    before = store.stats()["num_namespaces"]
    body = json.loads(lookup_body(NS, KEYS[:1]))
    body["namespace"][field] = value
    status, ans = post(server.port, "/v1/lookup", json.dumps(body).encode())
    assert status == 400 and "characters, more than" in ans["error"], ans
    assert store.stats()["num_namespaces"] == before
    # all fields together are bounded too: three fields just under the per-field bound
    body = json.loads(lookup_body(NS, KEYS[:1]))
    body["namespace"].update(model_id="m" * 4000, revision="r" * 4000, cache_salt="s" * 4000,
                             adapter="a" * 4000, quantization="q" * 1000)
    status, ans = post(server.port, "/v1/lookup", json.dumps(body).encode())
    assert status == 400 and "characters in all" in ans["error"], ans
    # a namespace of ordinary size is served
    assert post(server.port, "/v1/lookup", lookup_body(NS, KEYS[:1]))[0] == 200


def test_a_namespace_field_the_daemon_does_not_know_is_400(server):
    """Ignored, it would not be in the namespace id: two clients differing in it would share
    chunks (a field that changes the KV then changes answers)."""
    body = json.loads(lookup_body(NS, KEYS[:1]))
    body["namespace"]["sliding_window"] = 4096
    status, ans = post(server.port, "/v1/lookup", json.dumps(body).encode())
    assert status == 400 and "unknown namespace field 'sliding_window'" in ans["error"], ans


def test_a_layout_field_the_daemon_does_not_know_is_400_naming_it(server):
    """``hed_dim`` beside ``head_dim`` was ignored (the layout parsed as if it were absent),
    and ``hed_dim`` instead of ``head_dim`` was answered as a missing ``head_dim``: either
    way the field the client sent was not the one named. Lookup and put alike, nothing kept."""
    store: ChunkStore = server.store
    before = store.stats()["num_namespaces"]
    body = json.loads(lookup_body(NS, KEYS[:1]))
    body["namespace"]["layout"]["hed_dim"] = 64
    status, ans = post(server.port, "/v1/lookup", json.dumps(body).encode())
    assert status == 400, ans
    assert ans["error"] == ("bad namespace: unknown namespace layout field 'hed_dim'; a layout "
                            "has chunk_size, dtype, head_dim, num_kv_heads, num_layers "
                            "(a newer client than this daemon?)")
    del body["namespace"]["layout"]["head_dim"]          # the typo instead of the field
    status, ans = post(server.port, "/v1/lookup", json.dumps(body).encode())
    assert status == 400 and "unknown namespace layout field 'hed_dim'" in ans["error"], ans

    def typo(header):
        header["namespace"]["layout"]["sliding_window"] = 4096
    status, ans = post(server.port, "/v1/put", put_body(NS, KEYS[:1], typo),
                       content_type=P.BINARY_CONTENT_TYPE)
    assert status == 400 and "unknown namespace layout field 'sliding_window'" in ans["error"], ans
    assert num_chunks(store) == 0 and store.stats()["num_namespaces"] == before
    # the known fields are served as before
    assert post(server.port, "/v1/lookup", lookup_body(NS, KEYS[:1]))[0] == 200

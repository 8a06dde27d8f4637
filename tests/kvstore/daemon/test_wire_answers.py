"""What a client author writing raw HTTP from docs/wire-format.md meets, on a real
``kvstore serve``: the put answer says what was stored, already stored and refused (with the
first refused key and why), a binary get answer names the request limits, a key of another
namespace is refused naming both namespace ids, and ``/v1/clear {}`` names its three forms."""
from __future__ import annotations

import contextlib
import http.client
import json

import numpy as np
import pytest
import xxhash

from kvstore.daemon import protocol as P
from kvstore.keys import Namespace
from tests.kvstore.daemon.serve_proc import free_port, start, stop

BODY, BATCH = 1 << 20, 16
#: the doc's first worked example: 2 x 2 x 4 x 1 x 8 fp16 = 256-byte chunks
NS = {"model_id": "example/model", "layout": {"num_layers": 2, "num_kv_heads": 1,
                                              "head_dim": 8, "dtype": "fp16", "chunk_size": 4}}
KEYS = [k.hex() for k in Namespace.from_dict(NS).chunk_keys(list(range(4 * 6)))]
#: 1 x 2 x 1024 x 1 x 64 fp16 = 256 KiB chunks: a few fill a 1 MiB arena
BIG = {"model_id": "example/big", "layout": {"num_layers": 1, "num_kv_heads": 1,
                                             "head_dim": 64, "dtype": "float16",
                                             "chunk_size": 1024}}
BIG_BYTES = 2 * 1024 * 64 * 2


@pytest.fixture(scope="module")
def port():
    p = free_port()
    proc = start(p, None, ["--cpu-bytes", "1MiB", "--max-body-bytes", str(BODY),
                           "--max-batch-keys", str(BATCH)])
    yield p
    stop(proc)


def _call(port, method, path, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    with contextlib.closing(conn):
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()


def _json(port, path, obj):
    status, headers, body = _call(port, "POST", path, json.dumps(obj).encode(),
                                  {"Content-Type": "application/json"})
    return status, headers, json.loads(body)


def _put(port, ns, chunks, nbytes=256, durable=False):
    """Put ``chunks``: ``[(key hex, parent hex or None, seed)]`` as raw bytes."""
    entries, payloads = [], []
    for key, parent, seed in chunks:
        data = np.random.default_rng(seed).standard_normal(nbytes // 2).astype("<f2").tobytes()
        layout = Namespace.from_dict(ns).layout
        entries.append({"key": key, "parent": parent, "nbytes": nbytes, "dtype": "float16",
                        "shape": list(layout.shape()), "xxh3": xxhash.xxh3_64_hexdigest(data)})
        payloads.append(data)
    body = P.encode_preamble_and_header({"namespace": ns, "durable": durable,
                                         "chunks": entries}) + b"".join(payloads)
    status, _, out = _call(port, "POST", "/v1/put", body,
                           {"Content-Type": P.BINARY_CONTENT_TYPE})
    assert status == 200, out
    return json.loads(out)


@pytest.fixture(autouse=True)
def _clean(port):
    yield
    for ns in (NS, BIG):
        assert _json(port, "/v1/clear", {"namespace": ns})[0] == 200


def test_an_orphan_is_refused_and_named(port):
    out = _put(port, NS, [(KEYS[0], None, 0), (KEYS[2], KEYS[1], 2)])
    assert out == {"stored": 1, "num_chunks": 2, "durable": False, "already_stored": 0,
                   "refused": 1, "first_refused": {"index": 1, "key": KEYS[2],
                                                   "reason": "parent_missing"}}


def test_a_batch_stops_at_its_first_refusal(port):
    _put(port, NS, [(KEYS[0], None, 0)])
    out = _put(port, NS, [(KEYS[2], KEYS[1], 2), (KEYS[1], KEYS[0], 1)])
    assert out["stored"] == 0 and out["refused"] == 2 and out["already_stored"] == 0
    assert out["first_refused"] == {"index": 0, "key": KEYS[2], "reason": "parent_missing"}
    # parent first, it is stored
    out = _put(port, NS, [(KEYS[1], KEYS[0], 1), (KEYS[2], KEYS[1], 2)])
    assert (out["stored"], out["refused"], out["first_refused"]) == (2, 0, None)


def test_already_stored_is_told_from_refused(port):
    assert _put(port, NS, [(KEYS[0], None, 0), (KEYS[1], KEYS[0], 1)])["stored"] == 2
    out = _put(port, NS, [(KEYS[0], None, 0), (KEYS[1], KEYS[0], 1), (KEYS[2], KEYS[1], 2)])
    assert (out["stored"], out["already_stored"], out["refused"]) == (1, 2, 0)
    assert out["first_refused"] is None


def test_no_room_is_named(port):
    """An arena full of pinned chunks refuses a new chunk with ``no_room``."""
    seeds, pinned = iter(range(100, 200)), []
    try:
        _fill_until_refused(port, seeds, pinned)
    finally:  # (the other tests need room)
        _json(port, "/v1/unpin", {"namespace": BIG, "keys": pinned})


def _fill_until_refused(port, seeds, pinned):
    for _ in range(16):  # independent prompts (first chunks) until one finds no room
        key = Namespace.from_dict(BIG).chunk_keys([next(seeds)] * 1024)[0].hex()
        out = _put(port, BIG, [(key, None, 0)], BIG_BYTES)
        if out["refused"]:
            assert out["first_refused"] == {"index": 0, "key": key, "reason": "no_room"}
            assert out["stored"] == 0 and out["already_stored"] == 0
            break
        assert out["stored"] == 1
        st, _, pin = _json(port, "/v1/pin", {"namespace": BIG, "keys": [key], "lease_s": 60})
        assert (st, pin["pinned"]) == (200, 1)
        pinned.append(key)
    else:
        pytest.fail("a 1 MiB arena took 16 pinned chunks of 256 KiB")


def test_binary_get_names_the_limits(port):
    _put(port, NS, [(KEYS[0], None, 0)])
    status, headers, body = _call(port, "POST", "/v1/get",
                                  json.dumps({"namespace": NS, "keys": [KEYS[0]]}).encode())
    assert status == 200 and headers["Content-Type"] == P.BINARY_CONTENT_TYPE
    assert headers["X-KVStore-Max-Body-Bytes"] == str(BODY)
    assert headers["X-KVStore-Max-Batch-Keys"] == str(BATCH)
    hdr_len = P.decode_preamble(body[:P.PREAMBLE_BYTES])
    (entry,) = json.loads(body[P.PREAMBLE_BYTES:P.PREAMBLE_BYTES + hdr_len])["chunks"]
    assert entry["found"] is True and "parent" not in entry  # as the doc says


def test_a_key_of_another_namespace_names_both_ids(port):
    other = {**NS, "revision": "v2"}
    status, _, out = _json(port, "/v1/exists", {"namespace": other, "keys": [KEYS[0]]})
    assert status == 400
    assert Namespace.from_dict(NS).ns_id.hex() in out["error"]
    assert Namespace.from_dict(other).ns_id.hex() in out["error"]


def test_clear_of_nothing_names_its_forms(port):
    status, _, out = _json(port, "/v1/clear", {})
    assert status == 400
    assert "'ns_id'" in out["error"] and "'all'" in out["error"] and "'namespace'" in out["error"]


def test_parser_errors_are_plain_text(port):
    """As the doc says: aiohttp's parser answers before any route, without our headers."""
    status, headers, _ = _call(port, "POST", "/v1/put", b"x",
                               {"Transfer-Encoding": "gzip"})
    assert status in (400, 501)
    assert headers.get("Content-Type", "").startswith("text/plain")
    assert "X-KVStore-Max-Body-Bytes" not in headers

"""The daemon's wire codec (``X-KVStore-Wire-Codec``, ``kvstore.daemon.wire_codec``): a client
whose namespace accepts a lossy codec gets and puts chunks encoded with it through a real
daemon, about half the payload bytes; the daemon refuses it (422) for any other namespace and
stores nothing; an unknown codec is a 400; default clients stay bit-exact."""
import json
import re

import pytest
import torch

from kvstore import kv_codec
from kvstore.config import StoreConfig
from kvstore.daemon import protocol as P
from kvstore.daemon.async_client import _encoded_entries
from kvstore.daemon.client import KVStoreClient
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.daemon.wire_codec import WIRE_CODEC_HEADER
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from tests.kvstore.daemon.server_helpers import request

# chunk of 64 tokens, head_dim 64: int8 payload 0.5156x fp16, kivi 0.484x (kv_codec's formulas)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", chunk_size=64)
EXACT = Namespace("wire-model", LAYOUT)
LOSSY = {c: Namespace("wire-model", LAYOUT, lossy_codec=c) for c in kv_codec.LOSSY_CODECS}


def chunk(seed: int) -> torch.Tensor:
    """A chunk ``[2, 2, 64, 2, 64]`` fp16 with an outlier key channel (as real KV has)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYOUT.shape(), generator=g)
    kv[:, 0, :, :, 3] *= 20.0
    return kv.to(torch.float16)


def stored_values(kv: torch.Tensor, codec: str) -> torch.Tensor:
    """What the daemon holds after a put of ``kv`` under ``codec``: its decoded payload."""
    return kv_codec.decode(kv_codec.encode(kv, codec), codec, kv.dtype, tuple(kv.shape))


def within_bound(got: torch.Tensor, kv: torch.Tensor, codec: str) -> bool:
    """``|got - kv|`` within ``kv_codec.error_bound`` plus the fp16 rounding of ``got``."""
    err = (got.float() - kv.float()).abs()
    return bool((err <= kv_codec.error_bound(kv, codec) + got.float().abs() * 2 ** -11
                 + 2 ** -24).all())


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    store = ChunkStore(StoreConfig(cpu_bytes=64 << 20, disk_path=str(
        tmp_path_factory.mktemp("disk")), disk_bytes=64 << 20))
    srv = ThreadedServer(create_app(store, ServerLimits()))
    srv.store = store
    yield srv
    srv.stop()
    store.close()


@pytest.fixture()
def clients(daemon):
    """``(raw, wire)`` clients over HTTP; ``wire(codec)`` opens one asking for ``codec``."""
    daemon.store.clear()
    opened = []

    def wire(codec="raw"):
        c = KVStoreClient(daemon.url, timeout_s=30.0, same_host=False, wire_codec=codec)
        opened.append(c)
        return c
    yield wire
    for c in opened:
        c.close()


def counter(daemon, name: str) -> float:
    status, text, _ = request(daemon, "GET", "/metrics", auth=False)
    assert status == 200
    m = re.search(rf"^{name} ([0-9.e+]+)$", text.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def get_raw(daemon, ns, keys, codec=None):
    """``(status, body bytes, response)`` of a get, with ``codec`` in the header if given."""
    headers = {"Content-Type": "application/json"}
    if codec is not None:
        headers[WIRE_CODEC_HEADER] = codec
    return request(daemon, "POST", "/v1/get", P.key_request(ns, keys), headers, auth=False)


def put_raw(daemon, ns, keys, kvs, codec):
    """A put whose payloads are encoded with ``codec`` and whose header names it."""
    parts = _encoded_entries(keys, kvs, codec)
    body = P.put_header(ns, [e for e, _ in parts]) + b"".join(bytes(v) for _, v in parts)
    return request(daemon, "POST", "/v1/put", body,
                   {"Content-Type": P.BINARY_CONTENT_TYPE, WIRE_CODEC_HEADER: codec},
                   auth=False)


@pytest.mark.parametrize("codec", ["int8", "kivi"])
def test_wire_put_and_get_round_trip_within_the_codec_bound(daemon, clients, codec):
    ns, kvs = LOSSY[codec], [chunk(i) for i in range(3)]
    keys = ns.chunk_keys(range(64 * 3))
    wire, raw = clients(codec), clients()
    assert wire.put_chunks(ns, keys, kvs) == 3
    held = raw.get_chunks(ns, keys)          # a raw client reads what the store holds:
    for h, kv in zip(held, kvs):             # exactly the decoded put payloads
        assert torch.equal(h, stored_values(kv, codec)) and within_bound(h, kv, codec)
        assert not torch.equal(h, kv)        # (lossy indeed)
    got = wire.get_chunks(ns, keys)
    for g, h in zip(got, held):
        assert g.dtype == torch.float16 and g.shape == (2, 2, 64, 2, 64)
        assert torch.equal(g, stored_values(h, codec)) and within_bound(g, h, codec)
    out = [torch.empty(LAYOUT.shape(), dtype=torch.float16) for _ in keys]
    assert all(r is o for r, o in zip(wire.get_chunks(ns, keys, out), out))
    assert all(torch.equal(o, g) for o, g in zip(out, got))


@pytest.mark.parametrize("codec, most", [("int8", 0.52), ("kivi", 0.4999)])
def test_payload_bytes_on_the_wire(daemon, clients, codec, most):
    ns, kvs = LOSSY[codec], [chunk(i) for i in range(4)]
    keys = ns.chunk_keys(range(64 * 4))
    raw_bytes = 4 * LAYOUT.chunk_bytes
    before = counter(daemon, "kvstore_server_received_bytes_total")
    assert clients(codec).put_chunks(ns, keys, kvs) == 4
    put_bytes = counter(daemon, "kvstore_server_received_bytes_total") - before
    assert put_bytes == 4 * kv_codec.payload_nbytes(codec, LAYOUT.shape())
    assert put_bytes <= most * raw_bytes
    status, body, resp = get_raw(daemon, ns, keys, codec)
    assert status == 200 and resp.getheader(WIRE_CODEC_HEADER) == codec
    hdr_len = P.decode_preamble(body[:P.PREAMBLE_BYTES])
    header = json.loads(body[P.PREAMBLE_BYTES:P.PREAMBLE_BYTES + hdr_len])
    payload = sum(c["nbytes"] for c in header["chunks"])
    assert {c["codec"] for c in header["chunks"]} == {codec}
    assert len(body) == P.PREAMBLE_BYTES + hdr_len + payload and payload <= most * raw_bytes
    status, body_raw, _ = get_raw(daemon, ns, keys)         # the same chunks, raw
    assert status == 200 and len(body_raw) > raw_bytes


def test_a_namespace_that_did_not_accept_the_codec_is_refused_and_nothing_stored(daemon,
                                                                                  clients):
    kvs = [chunk(0), chunk(1)]
    for ns in (EXACT, LOSSY["fp8"]):                        # accepts none / another codec
        keys = ns.chunk_keys(range(128))
        status, body, _ = put_raw(daemon, ns, keys, kvs, "int8")
        assert status == 422 and "wire codec 'int8' refused" in json.loads(body)["error"]
        assert clients().exists(ns, keys) == [False, False]
        assert clients().put_chunks(ns, keys, kvs) == 2     # stored raw: a lossy get refused
        status, body, _ = get_raw(daemon, ns, keys, "int8")
        assert status == 422 and "refused" in json.loads(body)["error"]


def test_an_unknown_codec_header_is_a_400(daemon, clients):
    ns, keys = LOSSY["int8"], LOSSY["int8"].chunk_keys(range(64))
    clients().put_chunks(ns, keys, [chunk(0)])
    status, body, _ = get_raw(daemon, ns, keys, "int4")
    assert status == 400 and "unknown wire codec 'int4'" in json.loads(body)["error"]
    parts = _encoded_entries(keys, [chunk(1)], "int8")
    body = P.put_header(ns, [e for e, _ in parts]) + b"".join(bytes(v) for _, v in parts)
    status, resp, _ = request(daemon, "POST", "/v1/put", body,
                              {"Content-Type": P.BINARY_CONTENT_TYPE, WIRE_CODEC_HEADER: "zstd"},
                              auth=False)
    assert status == 400 and "unknown wire codec" in json.loads(resp)["error"]
    assert torch.equal(clients().get_chunks(ns, keys)[0], chunk(0))     # nothing replaced
    status, resp, _ = request(daemon, "POST", "/v1/put", body,         # entries say int8,
                              {"Content-Type": P.BINARY_CONTENT_TYPE}, auth=False)  # header not
    assert status == 400 and "neither raw nor" in json.loads(resp)["error"]


def test_default_clients_stay_bit_exact(daemon, clients):
    kvs = [chunk(5), chunk(6)]
    for ns, client in ((LOSSY["int8"], clients()), (EXACT, clients("int8"))):
        keys = ns.chunk_keys(range(128))
        before = counter(daemon, "kvstore_server_received_bytes_total")
        assert client.put_chunks(ns, keys, kvs) == 2
        assert counter(daemon, "kvstore_server_received_bytes_total") - before == \
            2 * LAYOUT.chunk_bytes
        assert all(torch.equal(g, kv) for g, kv in zip(client.get_chunks(ns, keys), kvs))


def test_a_chunk_the_codec_cannot_encode_travels_exactly(daemon, clients):
    ns, keys = LOSSY["int8"], LOSSY["int8"].chunk_keys(range(128))
    bad = chunk(7)
    bad[0, 1, 5, 0, 9] = float("inf")
    wire = clients("int8")
    assert wire.put_chunks(ns, keys, [chunk(8), bad], durable=True) == 2
    got = wire.get_chunks(ns, keys)
    assert torch.equal(got[1], bad) and torch.equal(clients().get_chunks(ns, keys)[1], bad)
    assert torch.equal(got[0], stored_values(stored_values(chunk(8), "int8"), "int8"))


def test_put_header_entry_checks():
    ns, key = LOSSY["int8"], LOSSY["int8"].chunk_keys(range(64))[0]
    (e, v), = _encoded_entries([key], [chunk(0)], "int8")
    header = json.loads(P.put_header(ns, [e])[P.PREAMBLE_BYTES:])
    _, (parsed,), _ = P.parse_put_header(header, 8, "int8")
    assert parsed.codec == "int8" and parsed.nbytes == v.nbytes == e.nbytes
    with pytest.raises(P.ProtocolError, match="neither raw nor"):
        P.parse_put_header(header, 8, "kivi")
    header["chunks"][0]["nbytes"] = 10 ** 9
    with pytest.raises(P.ProtocolError, match="nbytes of a int8 payload must be in"):
        P.parse_put_header(header, 8, "int8")

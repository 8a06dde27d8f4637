"""Wire format v1: preamble, headers, validation of put headers against the layout."""
import json
import struct

import pytest
import torch
import xxhash

from kvstore.daemon import protocol as P
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16", chunk_size=4)
NS = Namespace("tiny-model", LAYOUT)
OTHER = Namespace("tiny-model", LAYOUT, cache_salt="tenant-b")


def _chunk(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape(), generator=g).to(torch.float16)  # [2, 2, 4, 1, 8]


def _header(blob: bytes) -> dict:
    hdr_len = P.decode_preamble(blob[:8])
    return json.loads(blob[8:8 + hdr_len])


def test_preamble_layout_is_magic_then_uint32_le_length():
    blob = P.encode_preamble_and_header({"a": 1})
    assert blob[:4] == b"KVS\x01"
    assert struct.unpack("<I", blob[4:8])[0] == len(b'{"a":1}')
    assert blob[8:] == b'{"a":1}'
    assert P.decode_preamble(blob[:8]) == 7


@pytest.mark.parametrize("pre,msg", [
    (b"XYZ\x01" + struct.pack("<I", 10), "bad magic"),
    (b"KVS\x02" + struct.pack("<I", 10), "unsupported protocol version 2"),
    (b"KVS\x01" + struct.pack("<I", 0), "out of range"),
    (b"KVS\x01" + struct.pack("<I", P.MAX_HEADER_BYTES + 1), "out of range"),
    (b"KVS\x01", "truncated preamble"),
])
def test_decode_preamble_rejects_bad_framing(pre, msg):
    with pytest.raises(P.ProtocolError, match=msg) as e:
        P.decode_preamble(pre)
    assert e.value.status == 400


def test_checksum_is_xxh3_64_hex_of_the_payload_bytes():
    kv = _chunk(0)
    view = P.tensor_bytes(kv)
    assert view.nbytes == LAYOUT.chunk_bytes == 256
    assert P.checksum(view) == xxhash.xxh3_64_hexdigest(kv.numpy().tobytes())
    assert len(P.checksum(view)) == 16


def test_tensor_bytes_of_a_non_contiguous_tensor_is_its_contiguous_bytes():
    kv = _chunk(1)
    sliced = torch.cat([kv, kv], dim=2)[:, :, :4]  # [2, 2, 4, 1, 8], not contiguous
    assert not sliced.is_contiguous()
    assert bytes(P.tensor_bytes(sliced)) == kv.numpy().tobytes()


def test_put_header_round_trips_through_parse_put_header():
    keys = NS.chunk_keys(list(range(8)))
    entries = [P.entry_for(k, _chunk(i))[0] for i, k in enumerate(keys)]
    ns, parsed, durable = P.parse_put_header(_header(P.put_header(NS, entries, durable=True)), 16)
    assert ns == NS and durable is True
    assert parsed == entries
    assert parsed[0].shape == (2, 2, 4, 1, 8) and parsed[0].nbytes == 256


def _put_dict(**chunk_over) -> dict:
    key = NS.chunk_keys([1, 2, 3, 4])[0]
    entry = P.entry_for(key, _chunk(0))[0].to_dict()
    entry.update(chunk_over)
    return {"namespace": NS.to_dict(), "chunks": [entry]}


@pytest.mark.parametrize("over,msg", [
    ({"dtype": "float32"}, "dtype mismatch: layout has float16"),
    ({"shape": [2, 2, 3, 1, 8]}, r"shape mismatch: expected \[2, 2, 4, 1, 8\]"),
    ({"nbytes": 255}, "nbytes mismatch: layout needs 256"),
    ({"xxh3": "abc"}, "'xxh3' must be 16 hex digits"),
    ({"key": "zz"}, "bad key"),
    ({"key": OTHER.chunk_keys([1, 2, 3, 4])[0].hex()}, "does not belong"),
])
def test_parse_put_header_rejects_entries_that_do_not_match_the_layout(over, msg):
    with pytest.raises(P.ProtocolError, match=msg):
        P.parse_put_header(_put_dict(**over), 16)


def test_parse_put_header_rejects_duplicates_empty_and_too_many():
    d = _put_dict()
    d["chunks"] = d["chunks"] * 2
    with pytest.raises(P.ProtocolError, match="duplicate key"):
        P.parse_put_header(d, 16)
    with pytest.raises(P.ProtocolError, match="413|exceed") as e:
        P.parse_put_header(d, 1)
    assert e.value.status == 413
    with pytest.raises(P.ProtocolError, match="non-empty list"):
        P.parse_put_header({"namespace": NS.to_dict(), "chunks": []}, 16)
    with pytest.raises(P.ProtocolError, match="bad namespace"):
        P.parse_put_header({"namespace": {"model_id": "x"}, "chunks": [1]}, 16)
    with pytest.raises(P.ProtocolError, match="'durable' must be a boolean"):
        P.parse_put_header({**_put_dict(), "durable": "yes"}, 16)


def test_parse_json_and_version_errors_are_protocol_errors():
    with pytest.raises(P.ProtocolError, match="malformed JSON"):
        P.parse_json(b"{not json")
    with pytest.raises(P.ProtocolError, match="must be a JSON object"):
        P.parse_json(b"[1, 2]")
    P.check_version(None)
    P.check_version("1")
    with pytest.raises(P.ProtocolError, match="unsupported protocol version 7"):
        P.check_version("7")
    with pytest.raises(P.ProtocolError, match="bad X-KVStore-Protocol"):
        P.check_version("one")


def test_parse_keys_enforces_namespace_and_batch_limit():
    keys = NS.chunk_keys(list(range(12)))
    assert P.parse_keys(NS, [k.hex() for k in keys], 3) == keys
    with pytest.raises(P.ProtocolError) as e:
        P.parse_keys(NS, [k.hex() for k in keys], 2)
    assert e.value.status == 413
    with pytest.raises(P.ProtocolError, match="does not belong"):
        P.parse_keys(OTHER, [keys[0].hex()], 3)
    body = json.loads(P.key_request(NS, keys[:1], lease_s=2.5))
    assert body == {"namespace": NS.to_dict(), "keys": [keys[0].hex()], "lease_s": 2.5}


def test_get_response_header_round_trip_with_a_missing_entry():
    keys = NS.chunk_keys(list(range(8)))
    found, _ = P.entry_for(keys[0], _chunk(3))
    entries = [found, P.ChunkEntry(keys[1], found=False)]
    got = P.parse_get_response_header(_header(P.get_response_header(entries)), NS, keys)
    assert got == entries
    assert P.payload_total(got) == 256
    with pytest.raises(P.ProtocolError, match="do not match"):
        P.parse_get_response_header(_header(P.get_response_header(entries)), NS, keys[::-1])


def test_chunk_key_hex_on_the_wire_is_ns_id_then_prefix_hash():
    key = NS.chunk_keys([5, 6, 7, 8])[0]
    assert ChunkKey.from_bytes(bytes.fromhex(key.hex())) == key
    assert key.hex()[:32] == NS.ns_id.hex()


def test_fast_key_request_and_parse_keys_match_the_generic_json_path():
    import json as _json
    from kvstore.layout import KVLayout as _L
    from kvstore.keys import Namespace as _N
    ns = _N("m", _L(2, 1, 4, "float16", 4), cache_salt="t")
    keys = ns.chunk_keys(list(range(4 * 5)))
    body = P.key_request(ns, keys)
    assert body == _json.dumps({"namespace": ns.to_dict(), "keys": [k.hex() for k in keys]},
                               separators=(",", ":")).encode()
    assert P.key_request(ns, []) == _json.dumps({"namespace": ns.to_dict(), "keys": []},
                                                separators=(",", ":")).encode()
    d = _json.loads(body)
    parsed_ns = P.parse_namespace(d["namespace"])
    assert parsed_ns == ns and P.parse_namespace(d["namespace"]) is parsed_ns  # cached
    assert P.parse_keys(ns, d["keys"], 8) == keys
    other = _N("m", _L(2, 1, 4, "float16", 4)).chunk_keys(list(range(4)))[0]
    with pytest.raises(P.ProtocolError, match="does not belong"):
        P.parse_keys(ns, d["keys"][:2] + [other.hex()], 8)
    with pytest.raises(P.ProtocolError, match="bad key"):
        P.parse_keys(ns, d["keys"][:1] + ["zz" * 48], 8)
    # the fast path takes lowercase hex of the namespace; anything else goes the checked way
    assert P.parse_keys(ns, [k.upper() for k in d["keys"]], 8) == keys
    with pytest.raises(P.ProtocolError, match="prefix hash"):
        P.parse_keys(ns, d["keys"][:1] + [d["keys"][1][:-32]], 8)
    with pytest.raises(P.ProtocolError):
        P.parse_keys(ns, d["keys"][:1] + [7], 8)
    with pytest.raises(P.ProtocolError, match="bad namespace"):
        P.parse_namespace({**d["namespace"], "layout": {"num_layers": 2}})

"""``kvstore.ns_wire`` (the namespace's wire form and digest without torch, which
``kvstore clear --namespace`` uses) gives what ``Namespace.from_dict(d).to_dict()`` and
``Namespace.digest`` give, refuses what they refuse, and accepts the dtypes and lossy codecs
``kvstore.layout`` and ``kvstore.kv_codec`` accept."""
import hashlib
import json

import pytest

from kvstore import kv_codec, layout, ns_wire
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

LAY = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "bfloat16",
       "chunk_size": 256}
BASE = {"model_id": "HuggingFaceTB/SmolLM2-135M", "layout": LAY}

GOOD = [
    BASE,
    Namespace("m", KVLayout(2, 1, 8, "float16", 4)).to_dict(),
    {**BASE, "layout": {**LAY, "dtype": "fp16"}},                   # an alias
    {**BASE, "layout": {**LAY, "dtype": "fp8", "chunk_size": 16}},
    {**BASE, "revision": "v2", "cache_salt": "tenant-a", "hash_algo": "xxh3_128"},
    {**BASE, "rope": {"theta": 100000.0, "scaling": None}},         # a dict rope
    {**BASE, "rope": '{"scaling":null,"theta":100000.0}'},
    {**BASE, "rope": {}, "adapter": "", "quantization": None},      # empty: left out
    {**BASE, "weights_fingerprint": "xxh3_128:" + "1" * 32, "compute_dtype": "float32",
     "quantization": "awq", "kv_quantization": '{"cache_dtype":"fp8"}',
     "adapter": '{"weights":"xxh3_128:ab"}', "lossy_codec": "int8"},
    {**BASE, "lossy_codec": "kivi", "hash_algo": "blake2b"},
]

BAD = [
    {"layout": LAY},                                        # no model_id
    {"model_id": "m"},                                      # no layout
    {**BASE, "layout": {k: v for k, v in LAY.items() if k != "head_dim"}},
    {**BASE, "layout": [1, 2]},
    {**BASE, "layout": {**LAY, "dtype": "int4"}},
    {**BASE, "layout": {**LAY, "num_layers": 0}},
    {**BASE, "layout": {**LAY, "head_dim": "many"}},
    {**BASE, "layout": {**LAY, "chunk_size": "16"}},        # not coerced
    {**BASE, "layout": {**LAY, "hed_dim": 64}},
    {**BASE, "model_id": 5},
    {**BASE, "revision": None},
    {**BASE, "hash_algo": "md5"},
    {**BASE, "adapter": ["lora"]},
    {**BASE, "lossy_codec": "int4"},
]


@pytest.mark.parametrize("d", GOOD, ids=range(len(GOOD)))
def test_the_wire_form_and_digest_are_the_namespaces(d):
    ns = Namespace.from_dict(json.loads(json.dumps(d)))
    wire = ns_wire.wire_namespace(json.loads(json.dumps(d)))
    assert wire == ns.to_dict()
    assert ns_wire.namespace_digest(wire) == ns.digest and ns.digest[:16] == ns.ns_id
    assert Namespace.from_dict(wire) == ns


def test_the_digest_of_a_plain_namespace_is_the_one_it_always_had():
    blob = json.dumps({"model_id": "m", "revision": "", "cache_salt": "", "hash_algo": "sha256",
                       "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
                                  "dtype": "float16", "chunk_size": 4}},
                      sort_keys=True, separators=(",", ":")).encode()
    want = hashlib.sha256(b"kvstore-ns-v1" + blob).digest()
    d = {"model_id": "m", "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8,
                                     "dtype": "half", "chunk_size": 4}}
    assert ns_wire.namespace_digest(ns_wire.wire_namespace(d)) == want
    assert Namespace.from_dict(d).digest == want


@pytest.mark.parametrize("d", BAD, ids=range(len(BAD)))
def test_what_the_namespace_refuses_the_wire_form_refuses_alike(d):
    with pytest.raises((KeyError, ValueError, TypeError)) as want:
        Namespace.from_dict(d)
    with pytest.raises(type(want.value)) as got:
        ns_wire.wire_namespace(d)
    if isinstance(want.value, KeyError):          # the CLI names this field
        assert got.value.args == want.value.args


def test_its_lists_are_the_torch_modules_lists():
    assert set(layout.DTYPES) <= set(ns_wire.KV_DTYPE_NAMES)
    assert set(ns_wire.KV_DTYPE_NAMES) - set(layout.DTYPES) <= {"float8_e4m3fn", "float8_e5m2"}
    assert ns_wire.KV_DTYPE_ALIASES == layout._ALIASES
    assert ns_wire.LOSSY_CODEC_NAMES == kv_codec.LOSSY_CODECS
    assert ns_wire.LAYOUT_FIELDS == tuple(KVLayout(2, 1, 8, "float16", 4).to_dict())


@pytest.mark.parametrize("d, message", [
    ({**BASE, "layout": {**LAY, "hed_dim": 64}},
     "unknown namespace layout field 'hed_dim'; a layout has chunk_size, dtype, head_dim, "
     "num_kv_heads, num_layers"),
    ({**BASE, "layout": {**{k: v for k, v in LAY.items() if k != "head_dim"}, "hed_dim": 64,
                         "sliding_window": 4096}},
     "unknown namespace layout fields 'hed_dim', 'sliding_window'; a layout has chunk_size, "
     "dtype, head_dim, num_kv_heads, num_layers"),
    ({**BASE, "cache_slat": "a", "layout": {**LAY, "hed_dim": 64}},   # the namespace's first
     "unknown namespace field 'cache_slat'; a namespace has " + ", ".join(
         sorted(ns_wire.NAMESPACE_FIELDS))),
])
def test_an_unknown_layout_field_is_refused_naming_it(d, message):
    """``check_known_fields`` refuses a field a layout does not have, as the daemon does,
    before the namespace's other fields are read."""
    with pytest.raises(ValueError) as e:
        ns_wire.check_known_fields(d)
    assert str(e.value) == message


@pytest.mark.parametrize("d", GOOD + [{**BASE, "layout": [1, 2]}, {"model_id": "m"}],
                         ids=range(len(GOOD) + 2))
def test_known_fields_pass_the_check(d):
    assert ns_wire.check_known_fields(d) is None


@pytest.mark.parametrize("d, field", [
    ({**BASE, "cache_slat": "tenant-a"}, "cache_slat"),
    ({**BASE, "dtpye": "float16"}, "dtpye"),                # a layout field at the top level
    ({**BASE, "hash_algo": "sha256", "weights_fingerprnt": "xxh3_128:ab"},
     "weights_fingerprnt"),
    ({**BASE, "layout": {**LAY, "dtpye": "float16"}}, "dtpye"),
    ({"modle_id": "m", "layout": LAY}, "modle_id"),          # named before the missing model_id
])
def test_an_unknown_field_is_refused_by_every_parser_naming_it(d, field):
    """``Namespace.from_dict`` and ``wire_namespace`` refuse a field a namespace (or its
    layout) does not have, naming it, before reading the others: ignored, the typo would
    name the namespace without it (``cache_slat``: no salt), another namespace's keys."""
    for parse in (Namespace.from_dict, ns_wire.wire_namespace):
        with pytest.raises(ValueError) as e:
            parse(json.loads(json.dumps(d)))
        assert f"'{field}'" in str(e.value) and "unknown namespace" in str(e.value), parse


@pytest.mark.parametrize("d", [None, [BASE], "m"])
def test_a_namespace_that_is_not_an_object_is_a_type_error(d):
    for parse in (Namespace.from_dict, ns_wire.wire_namespace):
        with pytest.raises(TypeError, match="a namespace must be an object"):
            parse(d)

"""``KVLayout.from_dict`` refuses what it used to coerce or ignore, naming the field: a number
given as text (``int("30x")`` failed without a field name), a float (30.7 was cut to 30), a
bool (true read as 1), a dtype that is not a string, a field a layout does not have; the
namespace built from such a layout (``Namespace.from_dict``, the engine's reported form) and
its torch-free wire form (``kvstore clear --namespace``) refuse it alike."""
from __future__ import annotations

import json

import pytest

from kvstore import ns_wire
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

LAY = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype": "bfloat16",
       "chunk_size": 256}

REFUSED = [
    ({"num_layers": "30x"}, "KVLayout.num_layers must be a positive int, got '30x'"),
    ({"num_layers": "30"}, "KVLayout.num_layers must be a positive int, got '30'"),
    ({"num_kv_heads": 30.7}, "KVLayout.num_kv_heads must be a positive int, got 30.7"),
    ({"head_dim": 64.0}, "KVLayout.head_dim must be a positive int, got 64.0"),
    ({"chunk_size": True}, "KVLayout.chunk_size must be a positive int, got True"),
    ({"num_layers": None}, "KVLayout.num_layers must be a positive int, got None"),
    ({"num_layers": -2}, "KVLayout.num_layers must be a positive int, got -2"),
    ({"dtype": 16}, "KVLayout.dtype must be a dtype name (a string), got 16"),
    ({"dtype": "int4"}, "unsupported KV dtype 'int4'"),
    ({"sliding_window": 4096}, "unknown namespace layout field 'sliding_window'; a layout has "
                               "chunk_size, dtype, head_dim, num_kv_heads, num_layers"),
]


@pytest.mark.parametrize("change, message", REFUSED, ids=[str(c) for c, _ in REFUSED])
def test_a_wrong_type_or_unknown_field_is_refused_naming_the_field(change, message):
    bad = json.loads(json.dumps({**LAY, **change}))   # as it arrives from JSON
    with pytest.raises(ValueError) as e:
        KVLayout.from_dict(bad)
    assert str(e.value).startswith(message)
    ns = {"model_id": "m", "layout": bad}
    for parse in (Namespace.from_dict, ns_wire.wire_namespace):
        with pytest.raises(ValueError) as e:
            parse(ns)
        assert str(e.value).startswith(message)


def test_a_missing_field_is_a_key_error_naming_it():
    with pytest.raises(KeyError) as e:
        KVLayout.from_dict({k: v for k, v in LAY.items() if k != "head_dim"})
    assert e.value.args == ("head_dim",)


def test_what_to_dict_writes_reads_back_and_an_alias_is_taken():
    lay = KVLayout(30, 3, 64, "bf16", 256)
    assert KVLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    assert KVLayout.from_dict({**LAY, "dtype": "fp16"}).dtype == "float16"
    assert ns_wire.wire_layout({**LAY, "dtype": "half"}) == {**LAY, "dtype": "float16"}


def test_the_constructor_refuses_a_bool_as_a_dimension():
    with pytest.raises(ValueError, match="KVLayout.num_layers must be a positive int, got True"):
        KVLayout(True, 3, 64)

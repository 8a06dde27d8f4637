"""KVLayout: shapes, byte sizes and validation messages."""
import pytest
import torch

from kvstore.layout import DEFAULT_CHUNK_SIZE, KVLayout, dtype_name


def test_real_model_chunk_is_5898240_bytes():
    lay = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="fp16", chunk_size=256)
    assert lay.dtype == "float16"
    assert lay.shape() == (30, 2, 256, 3, 64)
    assert lay.token_bytes == 30 * 2 * 3 * 64 * 2 == 23040
    assert lay.chunk_bytes == 23040 * 256 == 5898240


def test_a_layout_naming_no_chunk_size_has_the_default_of_256_tokens():
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8)
    assert lay.chunk_size == DEFAULT_CHUNK_SIZE == 256
    assert lay.shape() == (2, 2, 256, 1, 8)


def test_dtype_aliases_and_errors():
    assert dtype_name("bf16") == "bfloat16"
    assert dtype_name(torch.float32) == "float32"
    with pytest.raises(ValueError, match="unsupported KV dtype 'int8'"):
        dtype_name("int8")
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        KVLayout(0, 1, 4)


def test_validate_names_expected_and_got():
    lay = KVLayout(2, 1, 4, "float16", 4)
    lay.validate(torch.zeros(2, 2, 4, 1, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"expected \[2, 2, 4, 1, 4\], got \[2, 2, 4, 1, 8\]"):
        lay.validate(torch.zeros(2, 2, 4, 1, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="expected torch.float16, got torch.float32"):
        lay.validate(torch.zeros(2, 2, 4, 1, 4))


def test_dict_round_trip():
    lay = KVLayout(30, 3, 64, "bfloat16", 256)
    assert KVLayout.from_dict(lay.to_dict()) == lay

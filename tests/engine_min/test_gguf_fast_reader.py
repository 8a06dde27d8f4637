"""engine_min.weights.open_gguf's reader (reads slice a plain ndarray view of the memmap)
parses the shipped GGUF into exactly what the stock ``gguf.GGUFReader`` gives: every field's
name, types, parts and data indices, every tensor's name, type, shape, element count, bytes
and offset; and a file it cannot parse is still a ModelLoadError naming the path."""
import numpy as np
import pytest
from gguf import GGUFReader

from engine_min.weights import ModelLoadError, default_model_path, open_gguf


def test_fast_reader_equals_the_stock_reader_on_the_shipped_model():
    path = default_model_path()
    stock, fast = GGUFReader(path), open_gguf(path)
    assert type(fast) is not GGUFReader and isinstance(fast, GGUFReader)
    assert list(fast.fields) == list(stock.fields)
    for name, a in stock.fields.items():
        b = fast.fields[name]
        assert (b.name, b.offset, list(b.types), list(b.data)) == \
            (a.name, a.offset, list(a.types), list(a.data)), name
        assert len(b.parts) == len(a.parts)
        for pa, pb in zip(a.parts, b.parts):
            assert pa.dtype == pb.dtype and np.array_equal(pa, pb), name
    assert len(fast.tensors) == len(stock.tensors) == 272
    for a, b in zip(stock.tensors, fast.tensors):
        assert (b.name, b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset) \
            == (a.name, a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset)
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape
        assert b.data.tobytes() == a.data.tobytes(), a.name
    tokens = fast.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 49152


def test_a_file_that_is_not_gguf_is_a_model_load_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        open_gguf(str(bad))

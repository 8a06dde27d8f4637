"""Disk value format: byte shuffle, codec choice, and detection of every kind of damage."""
import numpy as np
import pytest

from kvstore.codec import (HEADER_BYTES_MAX, CorruptChunkError, encode_payload, pack_value, shuffle,
                           unpack_header, unpack_value, unshuffle)

KEY = bytes(range(48))
PARENT = bytes(range(1, 49))
SHAPE = (2, 2, 16, 1, 16)  # 1024 fp16 elements


def _fp16(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(1024) * scale).astype(np.float16).view(np.uint8)


def test_shuffle_groups_bytes_and_round_trips():
    raw = np.arange(8, dtype=np.uint8)  # four 2-byte elements: (0,1) (2,3) (4,5) (6,7)
    assert shuffle(raw, 2).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert shuffle(raw, 4).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unshuffle(shuffle(raw, 2), 2).tolist() == list(range(8))
    x = _fp16()
    assert np.array_equal(unshuffle(shuffle(x, 2), 2), x)


def test_auto_codec_keeps_raw_for_random_and_compresses_structured():
    codec, payload = encode_payload(_fp16(), 2, "auto")
    assert codec == "raw" and len(payload) == 2048
    structured = np.round(np.random.default_rng(1).standard_normal(1024) * 4) / 4
    codec, payload = encode_payload(structured.astype(np.float16).view(np.uint8), 2, "auto")
    assert codec == "shuffle-lz4" and len(payload) < 0.9 * 2048


@pytest.mark.parametrize("codec", ["raw", "lz4", "shuffle-lz4", "auto"])
def test_pack_unpack_round_trip(codec):
    raw = _fp16(2)
    value = pack_value(KEY, PARENT, raw, "float16", SHAPE, codec)
    h, out = unpack_value(value, KEY)
    assert np.array_equal(out, raw)
    assert (h.dtype, h.shape, h.raw_nbytes, h.key, h.parent) == ("float16", SHAPE, 2048, KEY, PARENT)
    assert h.codec == ("raw" if codec == "auto" else codec)
    assert len(value) - len(raw) <= HEADER_BYTES_MAX or codec != "raw"
    assert unpack_header(pack_value(KEY, None, raw, "float16", SHAPE)).parent is None


@pytest.mark.parametrize("codec", ["raw", "shuffle-lz4"])
def test_every_flipped_byte_is_detected(codec):
    raw = (np.round(np.random.default_rng(3).standard_normal(1024) * 4) / 4).astype(np.float16).view(np.uint8)
    value = pack_value(KEY, PARENT, raw, "float16", SHAPE, codec)
    h = unpack_header(value)
    positions = list(range(h.payload_offset)) + list(range(h.payload_offset, len(value)))
    for pos in positions:
        bad = bytearray(value)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptChunkError):
            unpack_value(bytes(bad), KEY)


def test_truncated_and_swapped_values_are_detected():
    a = pack_value(KEY, None, _fp16(4), "float16", SHAPE, "raw")
    b_key = bytes(reversed(KEY))
    b = pack_value(b_key, None, _fp16(5), "float16", SHAPE, "raw")
    for cut in (0, 10, 40, len(a) - 1):
        with pytest.raises(CorruptChunkError):
            unpack_value(a[:cut], KEY)
    with pytest.raises(CorruptChunkError, match="belongs to key"):
        unpack_value(b, KEY)  # b stored under a's key
    unpack_value(b, b_key)

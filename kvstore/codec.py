"""On-disk chunk value: a small versioned header followed by the (maybe compressed) payload.

Value layout (little-endian)::

    magic "KVC1" | version u16 | codec u8 | dtype code u8 | raw_nbytes u64 | xxh3_64 u64
    | shape 5 x u32 | key_len u8 | key | parent_len u8 | parent | payload | xxh3_64 u64 of all before

* ``raw_nbytes`` and ``xxh3_64`` describe the *raw* tensor bytes (checked after decoding); the
  trailing xxh3_64 covers the whole stored value, so any flipped or missing byte is caught even
  where decoding would hide it (an lz4 match offset pointing at identical bytes).
* ``key`` is the chunk's own storage key, so a value moved under another key is detected;
  ``parent`` is the previous chunk's key (empty for the first chunk of a prompt), kept so a
  reopened store still evicts tails before heads.
* codecs: ``raw`` (0), ``lz4`` (1), ``shuffle-lz4`` (2: byte-shuffle, then lz4 block). Byte
  shuffle groups byte j of every element together (as blosc does): fp16/bf16 exponent bytes
  repeat a lot, mantissa bytes do not, so lz4 finds the repeats only after shuffling.
  Lossy: ``int8`` (3), ``fp8`` (4), ``kivi`` (5: grouped, 6-8 bits per value), see
  ``kvstore.kv_codec`` (payload = scales + codes). For them ``raw_nbytes`` and ``xxh3_64`` describe the *decoded* tensor's bytes
  (computed at encode time by decoding once), so every codec's decoded bytes are checked the
  same way; a payload whose size is not the codec's for the header's shape (a header naming
  the wrong codec) does not decode.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import lz4.block
import numpy as np
import torch
import xxhash

from kvstore import kv_codec

MAGIC = b"KVC1"
VERSION = 1
#: Codec codes (append only: the code is stored on disk).
CODECS = ("raw", "lz4", "shuffle-lz4") + kv_codec.LOSSY_CODECS
#: Fixed dtype codes (append only: the code is stored on disk).
DTYPE_CODES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
#: ``auto`` keeps compression only when it saves at least this fraction of the bytes.
MIN_SAVING = 0.10
#: ``auto`` first compresses a sample of this many bytes (4 slices spread over the chunk) and
#: stores raw at once when the sample does not save ``MIN_SAVING`` (most fp16 KV: see bench).
SAMPLE_BYTES = 128 * 1024

_FIXED = struct.Struct("<4sHBBQQ5I")
_TRAILER = struct.Struct("<Q")
#: Bytes of the trailing checksum.
TRAILER_BYTES = _TRAILER.size
#: Largest overhead of a value: fixed part + two length-prefixed 48-byte keys + trailer.
HEADER_BYTES_MAX = _FIXED.size + 2 * 49 + _TRAILER.size


class CorruptChunkError(ValueError):
    """A stored value fails a check (magic, version, sizes, key, checksum, decoding)."""


def checksum(raw: np.ndarray | bytes | memoryview) -> int:
    """xxh3_64 of raw bytes."""
    return xxhash.xxh3_64_intdigest(raw)


def shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte-shuffle ``raw`` (uint8, length a multiple of ``itemsize``): all byte 0s, then all
    byte 1s... A numpy transpose copy; the identity for itemsize 1."""
    if itemsize == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


def unshuffle(shuffled: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of ``shuffle``."""
    if itemsize == 1:
        return shuffled
    return np.ascontiguousarray(shuffled.reshape(itemsize, -1).T).reshape(-1)


def encode_payload(raw: np.ndarray, itemsize: int, codec: str = "auto") -> tuple[str, bytes | np.ndarray]:
    """Compress raw bytes (uint8 1-D) losslessly. Returns ``(codec used, payload)``.

    ``auto`` tries shuffle-lz4 and falls back to raw when it saves less than ``MIN_SAVING``.
    (Lossy codecs need the tensor's dtype and shape: ``pack_value``.)

    Raises:
        ValueError: unknown codec.
    """
    if codec == "raw":
        return "raw", raw
    if codec == "lz4":
        return "lz4", lz4.block.compress(raw, store_size=False)
    if codec == "auto" and raw.nbytes > 2 * SAMPLE_BYTES and not _sample_compresses(raw, itemsize):
        return "raw", raw
    if codec in ("shuffle-lz4", "auto"):
        packed = lz4.block.compress(shuffle(raw, itemsize), store_size=False)
        if codec == "auto" and len(packed) > (1.0 - MIN_SAVING) * raw.nbytes:
            return "raw", raw
        return "shuffle-lz4", packed
    raise ValueError(f"unknown lossless codec {codec!r}; choose one of {CODECS[:3]} or 'auto'")


def _sample_compresses(raw: np.ndarray, itemsize: int) -> bool:
    step, part = raw.nbytes // 4, SAMPLE_BYTES // 4 // itemsize * itemsize
    sample = np.concatenate([raw[i * step:i * step + part] for i in range(4)])
    packed = lz4.block.compress(shuffle(sample, itemsize), store_size=False)
    return len(packed) <= (1.0 - MIN_SAVING) * sample.nbytes


def decode_payload(codec: str, payload, raw_nbytes: int, itemsize: int,
                   copy: bool = True) -> np.ndarray:
    """Raw bytes (a new writable uint8 array) from a payload; with ``copy=False`` a ``raw``
    payload is returned as a view of ``payload`` itself (read-only when it is).

    Raises:
        CorruptChunkError: the payload does not decode to ``raw_nbytes`` bytes.
    """
    try:
        if codec == "raw":
            if len(payload) != raw_nbytes:
                raise CorruptChunkError(f"raw payload has {len(payload)} bytes, header says {raw_nbytes}")
            arr = np.frombuffer(payload, dtype=np.uint8)
            return arr.copy() if copy else arr
        out = lz4.block.decompress(payload, uncompressed_size=raw_nbytes, return_bytearray=True)
    except (lz4.block.LZ4BlockError, ValueError) as e:
        raise CorruptChunkError(f"{codec} payload does not decode: {e}") from e
    if len(out) != raw_nbytes:
        raise CorruptChunkError(f"{codec} payload decodes to {len(out)} bytes, header says {raw_nbytes}")
    arr = np.frombuffer(out, dtype=np.uint8)
    return unshuffle(arr, itemsize) if codec == "shuffle-lz4" else arr


@dataclass(frozen=True)
class ChunkHeader:
    """Parsed header of a stored value (see module docstring)."""

    codec: str
    dtype: str
    shape: tuple[int, ...]
    raw_nbytes: int
    checksum: int
    key: bytes
    parent: bytes | None
    payload_offset: int


def pack_value(key: bytes, parent: bytes | None, raw: np.ndarray, dtype: str,
               shape: tuple[int, ...], codec: str = "auto",
               fallback: str = "raw") -> bytes:
    """Header + encoded payload for a chunk. ``raw`` is the tensor's bytes (uint8 1-D).

    A lossy ``codec`` (``int8``, ``fp8``, ``kivi``) encodes the tensor (``shape``, ``dtype``) and records
    the checksum of its decoded bytes; a chunk it cannot encode (a non-finite value, a dtype
    it does not take) is written with the lossless ``fallback`` instead. ``kivi`` keeps the
    first ``kv_codec.SINK_TOKENS`` tokens of a chunk with no ``parent`` (the first chunk of a
    prompt: its attention sinks) in fp16; a tail piece stored without a parent keeps them
    too (a few bytes more, never less exact).

    Raises:
        ValueError: unknown codec.
    """
    parent = parent or b""
    used, payload, csum = None, None, None
    if codec in kv_codec.LOSSY_CODECS:
        sinks = kv_codec.SINK_TOKENS if codec == "kivi" and not parent else 0
        try:
            used, payload, csum = codec, *_encode_lossy(raw, dtype, shape, codec, sinks)
        except ValueError:
            codec = fallback
    if used is None:
        used, payload = encode_payload(raw, ITEMSIZE[dtype], codec)
        csum = checksum(raw)
    fixed = _FIXED.pack(MAGIC, VERSION, CODECS.index(used), DTYPE_CODES.index(dtype), raw.nbytes,
                        csum, *shape)
    body = b"".join((fixed, bytes((len(key),)), key, bytes((len(parent),)), parent, payload))
    return body + _TRAILER.pack(checksum(body))


def _tensor(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)


def _encode_lossy(raw: np.ndarray, dtype: str, shape: tuple[int, ...],
                  codec: str, sink_tokens: int = 0) -> tuple[bytes, int]:
    """(payload, checksum of the decoded bytes) of a lossy codec. Raises ValueError when the
    codec cannot encode the chunk."""
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"{codec} does not encode {dtype}")
    payload = kv_codec.encode(_tensor(raw, dtype, shape), codec, sink_tokens)  # uint8 array
    decoded = kv_codec.decode(payload, codec, getattr(torch, dtype), shape)
    return payload, checksum(decoded.view(-1).view(torch.uint8).numpy())


def unpack_header(buf) -> ChunkHeader:
    """Parse the header of a stored value (``buf`` bytes-like).

    Raises:
        CorruptChunkError: bad magic, unknown version/codec/dtype, truncated header.
    """
    mv = memoryview(buf)
    if len(mv) < _FIXED.size + 2:
        raise CorruptChunkError(f"value of {len(mv)} bytes is shorter than a header")
    magic, version, codec, dtype, raw_nbytes, csum, *shape = _FIXED.unpack_from(mv)
    if magic != MAGIC or version != VERSION:
        raise CorruptChunkError(f"bad magic/version {bytes(magic)!r}/{version}")
    if codec >= len(CODECS) or dtype >= len(DTYPE_CODES):
        raise CorruptChunkError(f"unknown codec {codec} or dtype code {dtype}")
    pos = _FIXED.size
    key_len = mv[pos]
    key = bytes(mv[pos + 1:pos + 1 + key_len])
    pos += 1 + key_len
    if pos >= len(mv):
        raise CorruptChunkError("value truncated inside its header")
    parent_len = mv[pos]
    parent = bytes(mv[pos + 1:pos + 1 + parent_len]) or None
    pos += 1 + parent_len
    if pos > len(mv) or len(key) != key_len or (parent_len and len(parent) != parent_len):
        raise CorruptChunkError("value truncated inside its header")
    return ChunkHeader(CODECS[codec], DTYPE_CODES[dtype], tuple(shape), raw_nbytes, csum, key,
                       parent, pos)


def unpack_value(buf, expect_key: bytes, copy: bool = True) -> tuple[ChunkHeader, np.ndarray]:
    """Header and verified raw bytes of a stored value (``copy=False``: a ``raw`` payload as
    a view of ``buf``, see ``decode_payload``).

    Raises:
        CorruptChunkError: any header problem, a key other than ``expect_key``, a shape/dtype
            that does not match ``raw_nbytes``, a payload that does not decode, or a checksum
            mismatch.
    """
    mv = memoryview(buf)
    if len(mv) < _TRAILER.size or checksum(mv[:-_TRAILER.size]) != _TRAILER.unpack_from(mv, len(mv) - _TRAILER.size)[0]:
        raise CorruptChunkError("value checksum mismatch (flipped or missing bytes)")
    h = unpack_header(buf)
    if h.key != expect_key:
        raise CorruptChunkError(f"value belongs to key {h.key.hex()[:16]}.., read under "
                                f"{expect_key.hex()[:16]}..")
    if int(np.prod(h.shape)) * ITEMSIZE[h.dtype] != h.raw_nbytes:
        raise CorruptChunkError(f"shape {h.shape} x {h.dtype} does not match {h.raw_nbytes} bytes")
    payload = mv[h.payload_offset:len(mv) - _TRAILER.size]
    if h.codec in kv_codec.LOSSY_CODECS:
        raw = _decode_lossy(h, payload)
    else:
        raw = decode_payload(h.codec, payload, h.raw_nbytes, ITEMSIZE[h.dtype], copy)
    # a raw payload is covered by the trailer already; check what a decoder produced
    if h.codec != "raw" and checksum(raw) != h.checksum:
        raise CorruptChunkError("payload checksum mismatch")
    return h, raw


def _decode_lossy(h: ChunkHeader, payload) -> np.ndarray:
    try:
        kv = kv_codec.decode(payload, h.codec, getattr(torch, h.dtype), h.shape)
    except ValueError as e:
        raise CorruptChunkError(f"{h.codec} payload does not decode: {e}") from e
    return kv.view(-1).view(torch.uint8).numpy()

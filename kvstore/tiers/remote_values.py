"""The remote tier's keys and values: the deployment key prefix, and the check of a value read
from Redis (``kvstore.codec``'s self-describing format) against the chunk it was asked for.
Pure functions, no I/O."""
from __future__ import annotations

import re
import warnings

import torch

from kvstore.codec import MAGIC, TRAILER_BYTES, CorruptChunkError, unpack_header, unpack_value
from kvstore.keys import ChunkKey
from kvstore.layout import DTYPES

#: A deployment key prefix: 1-64 of letters, digits, ``_.-/`` (no ``:`` and no braces, which
#: would change the key's form or pin every key to one cluster slot).
KEY_PREFIX_RE = re.compile(r"[A-Za-z0-9_.\-/]{1,64}")


def check_key_prefix(prefix, field: str = "remote key prefix") -> str:
    """``prefix`` if it is a valid deployment key prefix.

    Raises:
        ValueError: anything else, naming ``field``.
    """
    if not isinstance(prefix, str) or not KEY_PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"{field} must be 1-64 of letters, digits, _.-/, got {prefix!r}")
    return prefix


def tensor_over(raw, dtype: str, shape) -> torch.Tensor:
    """A tensor over ``raw`` (uint8 numpy, maybe a read-only view of the received value: no
    copy of a chunk that was just received whole; the store copies it into its top tier, the
    engine into its KV cache)."""
    if not raw.flags.writeable:
        with warnings.catch_warnings():  # (the value's bytes are ours alone; nobody writes them)
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(raw)
    else:
        t = torch.from_numpy(raw)
    return t.view(DTYPES[dtype]).view(shape)


def decode_value(key: ChunkKey, value: bytes, shape: tuple, dtype: str) -> tuple:
    """``(kv, parent, nbytes)`` of a valid value, or ``("invalid", why, nbytes, value)``."""
    try:
        h, raw = unpack_value(value, bytes(key), copy=False)
        if h.dtype != dtype or tuple(h.shape) != shape:
            raise CorruptChunkError(f"layout: value is {h.dtype} {list(h.shape)}, the "
                                    f"namespace says {dtype} {list(shape)}")
        parent = ChunkKey.from_bytes(h.parent) if h.parent else None
    except (CorruptChunkError, ValueError) as e:
        return ("invalid", str(e), len(value), value)
    return (tensor_over(raw, h.dtype, h.shape), parent, len(value))


def failure_reason(value: bytes, why: str) -> str:
    """Which check a value failed, as a ``validation_failures`` label: ``header`` (not a chunk
    value: bad magic), ``version`` (a format version this build does not read), ``truncated``
    (shorter than its header says), ``key`` (another chunk's or namespace's value), ``layout``
    (a dtype or shape other than the namespace's), ``checksum`` (bytes changed)."""
    if bytes(value[:4]) != MAGIC:
        return "header"
    try:
        h = unpack_header(value)
    except CorruptChunkError as e:
        return "truncated" if "truncated" in str(e) or "shorter" in str(e) else "version"
    if h.codec == "raw" and len(value) < h.payload_offset + h.raw_nbytes + TRAILER_BYTES:
        return "truncated"
    if why.startswith("layout"):
        return "layout"
    if "belongs to key" in why:
        return "key"
    return "checksum"

"""Wire format of the kvstore daemon (protocol version 1). Pure functions, no I/O.

This module holds the binary messages; the JSON part (namespace, keys, version, errors) is
``kvstore.daemon.fields``, whose names are re-exported here (``P.parse_keys`` etc.).

Control requests (lookup, exists, get, remove, demote, clear, pin, unpin) are small JSON bodies
(``application/json``); keys travel as lowercase hex of ``bytes(ChunkKey)``. Tensor payloads
travel only as raw bytes inside a *binary message* (``application/x-kvstore``)::

    offset 0   magic      4 bytes   b"KVS" + version byte (0x01)
    offset 4   hdr_len    uint32 LE length of the JSON header (<= MAX_HEADER_BYTES)
    offset 8   header     hdr_len bytes of UTF-8 JSON (see below)
    then       payloads   one per *present* chunk entry, in header order, each exactly
                          entry["nbytes"] bytes, no padding, no separators

Header of a put request body::

    {"namespace": Namespace.to_dict(), "durable": bool,
     "chunks": [{"key": hex, "nbytes": int, "dtype": "float16",
                 "shape": [L, 2, T, H, D], "xxh3": 16-hex xxh3_64 of the payload,
                 "parent": hex or null (optional)}, ...]}

``parent`` is the key of the chunk before this one in its prompt (null: the prompt's first
chunk), validated like ``key`` (hex of a key of the request's namespace, not the chunk's own
key). An entry without it has the previous entry's key as its parent (the first entry: none),
so a batch of a prompt's chunks from its first one needs no parent field; a batch continuing
a prompt stored by an earlier put names its first chunk's parent. The store keeps prefixes
reachable (``kvstore.movement``) only with true parents.

Header of a get response body (``found: false`` entries carry no payload)::

    {"chunks": [{"key": hex, "found": true, "nbytes": ..., "dtype": ..., "shape": ...,
                 "xxh3": ...}, {"key": hex, "found": false}, ...]}

With ``X-KVStore-Wire-Codec: NAME`` (``kvstore.daemon.wire_codec``) payloads travel encoded
with a lossy codec, for namespaces that accept it: each such entry also says ``"codec": NAME``,
its ``nbytes`` and ``xxh3`` being the encoded payload's (absent ``codec``: ``raw``).

Every request and response also carries ``X-KVStore-Protocol: 1``. A request naming an
unsupported version is refused with 400. Errors are JSON ``{"error": str, "status": int}``.
"""
from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import xxhash

from kvstore.daemon.fields import (  # noqa: F401 (the JSON part of the wire format)
    PREFIX_HASH_BYTES, PROTOCOL_VERSION, SUPPORTED_VERSIONS, VERSION_HEADER,
    ProtocolError, check_key_types, check_version, error_body, key_request, parse_json,
    parse_key, parse_keys, parse_namespace)
from kvstore.daemon.wire_codec import WIRE_CODEC_HEADER, max_nbytes  # noqa: F401
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout, dtype_name

MAGIC = b"KVS" + bytes([PROTOCOL_VERSION])
PREAMBLE = struct.Struct("<4sI")  # magic, header length
PREAMBLE_BYTES = PREAMBLE.size  # 8
MAX_HEADER_BYTES = 16 << 20
BINARY_CONTENT_TYPE = "application/x-kvstore"


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk's header entry: key, payload size, dtype, shape and checksum.

    ``found`` is False only in get responses for missing keys (then no payload follows).
    ``codec``: the payload's wire codec (``kvstore.daemon.wire_codec``; ``nbytes`` and
    ``xxh3`` are the encoded payload's), ``raw`` by default (not written by ``to_dict``).
    ``parent`` (put only): the chunk's parent key, None for a first chunk; ``parent_given``
    says whether the header carries it (``to_dict`` writes ``"parent"`` only then; without
    it the previous entry's key is the parent: ``put_parents``).
    """

    key: ChunkKey
    nbytes: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()
    xxh3: str = ""
    found: bool = True
    parent: ChunkKey | None = None
    parent_given: bool = False
    codec: str = "raw"

    def to_dict(self) -> dict:
        if not self.found:
            return {"key": self.key.hex(), "found": False}
        out = {"key": self.key.hex(), "found": True, "nbytes": self.nbytes,
               "dtype": self.dtype, "shape": list(self.shape), "xxh3": self.xxh3}
        if self.codec != "raw":
            out["codec"] = self.codec
        if self.parent_given:
            out["parent"] = None if self.parent is None else self.parent.hex()
        return out


def checksum(buf: bytes | memoryview) -> str:
    """xxh3_64 of a payload as 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(buf)


def tensor_bytes(kv: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a CPU tensor (made contiguous first if needed)."""
    kv = kv.detach()
    if kv.device.type != "cpu":
        kv = kv.cpu()
    kv = kv.contiguous()
    return memoryview(kv.view(torch.uint8).reshape(-1).numpy())


def entry_for(key: ChunkKey, kv: torch.Tensor) -> tuple[ChunkEntry, memoryview]:
    """Header entry and payload view of one chunk tensor."""
    view = tensor_bytes(kv)
    return ChunkEntry(key, view.nbytes, dtype_name(kv.dtype), tuple(kv.shape),
                      checksum(view)), view


def encode_preamble_and_header(header: dict) -> bytes:
    """``MAGIC | uint32 len | JSON`` for a binary message header."""
    blob = json.dumps(header, separators=(",", ":")).encode()
    if len(blob) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(blob)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREAMBLE.pack(MAGIC, len(blob)) + blob


def decode_preamble(buf: bytes) -> int:
    """Header length from the 8-byte preamble.

    Raises:
        ProtocolError: bad magic, unsupported version, or a header length out of range.
    """
    if len(buf) != PREAMBLE_BYTES:
        raise ProtocolError(f"truncated preamble: {len(buf)} of {PREAMBLE_BYTES} bytes")
    magic, hdr_len = PREAMBLE.unpack(buf)
    if magic[:3] != MAGIC[:3]:
        raise ProtocolError(f"bad magic {magic!r}; expected {MAGIC!r}")
    if magic[3] not in SUPPORTED_VERSIONS:
        raise ProtocolError(f"unsupported protocol version {magic[3]}; "
                            f"supported: {list(SUPPORTED_VERSIONS)}")
    if not 2 <= hdr_len <= MAX_HEADER_BYTES:
        raise ProtocolError(f"header length {hdr_len} out of range [2, {MAX_HEADER_BYTES}]")
    return hdr_len


def parse_put_header(header: dict, max_keys: int, wire_codec: str = "raw"
                     ) -> tuple[Namespace, list[ChunkEntry], bool]:
    """Validate a put header against its namespace layout, before any payload is read.
    Entries may say ``"codec"``: ``raw`` or the request's ``wire_codec``.

    Returns:
        (namespace, entries, durable)

    Raises:
        ProtocolError: missing fields, a key of another namespace, a duplicate key, a dtype,
            shape or nbytes that does not match ``namespace.layout`` (a lossy entry's
            nbytes: at most ``wire_codec.max_nbytes``), an entry codec other than ``raw`` or
            ``wire_codec``, or too many chunks (413).
    """
    ns = parse_namespace(header.get("namespace"))
    chunks = header.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ProtocolError("'chunks' must be a non-empty list")
    if len(chunks) > max_keys:
        raise ProtocolError(f"{len(chunks)} chunks exceed the limit of {max_keys} per batch", 413)
    layout = ns.layout
    entries = [_parse_put_entry(ns, layout, c, wire_codec) for c in chunks]
    if len({e.key for e in entries}) != len(entries):
        raise ProtocolError("duplicate key in one put batch")
    entries = [_parse_parent(ns, c, e) for c, e in zip(chunks, entries)]
    durable = header.get("durable", False)
    if not isinstance(durable, bool):
        raise ProtocolError("'durable' must be a boolean")
    return ns, entries, durable


def _parse_put_entry(ns: Namespace, layout: KVLayout, c: Any,
                     wire_codec: str = "raw") -> ChunkEntry:
    if not isinstance(c, dict):
        raise ProtocolError("each chunk entry must be a JSON object")
    key = parse_key(ns, c.get("key"))
    codec = c.get("codec", "raw")
    if codec not in ("raw", wire_codec):
        raise ProtocolError(f"chunk codec {str(codec)[:40]!r} is neither raw nor the request's "
                            f"wire codec {wire_codec!r} ({WIRE_CODEC_HEADER})")
    nbytes, dtype, shape, xxh = c.get("nbytes"), c.get("dtype"), c.get("shape"), c.get("xxh3")
    if dtype != layout.dtype:
        raise ProtocolError(f"dtype mismatch: layout has {layout.dtype}, chunk says {dtype!r}")
    # exact ints: JSON 256.0 == 256 in Python, but a float size breaks range()/slicing later
    if not isinstance(shape, list) or any(type(s) is not int for s in shape) \
            or tuple(shape) != layout.shape():
        raise ProtocolError(f"shape mismatch: expected {list(layout.shape())}, got {shape!r}")
    if codec == "raw" and (type(nbytes) is not int or nbytes != layout.chunk_bytes):
        raise ProtocolError(f"nbytes mismatch: layout needs {layout.chunk_bytes}, "
                            f"chunk says {nbytes!r}")
    if codec != "raw" and (type(nbytes) is not int
                           or not 0 < nbytes <= max_nbytes(codec, layout)):
        raise ProtocolError(f"nbytes of a {codec} payload must be in [1, "
                            f"{max_nbytes(codec, layout)}], chunk says {nbytes!r}")
    if not isinstance(xxh, str) or len(xxh) != 16:
        raise ProtocolError(f"'xxh3' must be 16 hex digits, got {xxh!r}")
    return ChunkEntry(key, nbytes, dtype, tuple(shape), xxh.lower(), codec=codec)


def _parse_parent(ns: Namespace, c: dict, e: ChunkEntry) -> ChunkEntry:
    """``e`` with the header's ``"parent"`` (hex of a key of ``ns``, or null) when ``c`` has
    one. Raises ProtocolError on a bad parent."""
    if "parent" not in c:
        return e
    value = c["parent"]
    parent = None if value is None else parse_key(ns, value)
    if parent == e.key:
        raise ProtocolError(f"chunk {e.key.hex()[:16]}... names itself as its parent")
    return dataclasses.replace(e, parent=parent, parent_given=True)


def put_parents(entries: Sequence[ChunkEntry]) -> list[ChunkKey | None]:
    """Each put entry's parent: the one its header entry gives, else the previous entry's key
    (the first entry: None)."""
    return [e.parent if e.parent_given else (entries[i - 1].key if i else None)
            for i, e in enumerate(entries)]


def put_header(ns: Namespace, entries: Sequence[ChunkEntry], durable: bool = False) -> bytes:
    """Preamble + header of a put request body (payloads follow, in entry order)."""
    return encode_preamble_and_header({"namespace": ns.to_dict(), "durable": durable,
                                       "chunks": [e.to_dict() for e in entries]})


def get_response_header(entries: Sequence[ChunkEntry]) -> bytes:
    """Preamble + header of a get response body."""
    return encode_preamble_and_header({"chunks": [e.to_dict() for e in entries]})


def parse_get_response_header(header: dict, ns: Namespace, keys: Sequence[ChunkKey],
                              wire_codec: str = "raw") -> list[ChunkEntry]:
    """Validate a get response header against the request (same keys, in order, and the
    namespace layout for found entries, whose ``codec`` may be ``raw`` or the ``wire_codec``
    asked for). Raises ProtocolError."""
    chunks = header.get("chunks")
    if not isinstance(chunks, list) or len(chunks) != len(keys):
        raise ProtocolError(f"get response lists {len(chunks) if isinstance(chunks, list) else 0}"
                            f" chunks for {len(keys)} keys")
    out = []
    for key, c in zip(keys, chunks):
        if not isinstance(c, dict) or c.get("key") != key.hex():
            raise ProtocolError("get response keys do not match the request")
        if not c.get("found"):
            out.append(ChunkEntry(key, found=False))
            continue
        out.append(_parse_put_entry(ns, ns.layout, c, wire_codec))
    return out


def payload_total(entries: Sequence[ChunkEntry]) -> int:
    """Sum of the payload bytes of present entries."""
    return sum(e.nbytes for e in entries if e.found)

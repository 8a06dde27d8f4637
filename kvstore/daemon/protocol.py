"""Wire format of the kvstore daemon (protocol version 1). Pure functions, no I/O.

Control requests (lookup, exists, get, remove, clear, pin, unpin) are small JSON bodies
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

from kvstore.keys import IDENTITY_FIELDS, ChunkKey, Namespace
from kvstore.layout import KVLayout, dtype_name

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAGIC = b"KVS" + bytes([PROTOCOL_VERSION])
PREAMBLE = struct.Struct("<4sI")  # magic, header length
PREAMBLE_BYTES = PREAMBLE.size  # 8
MAX_HEADER_BYTES = 16 << 20
VERSION_HEADER = "X-KVStore-Protocol"
NAMESPACE_HEADER = "X-KVStore-Namespace"
BINARY_CONTENT_TYPE = "application/x-kvstore"


class ProtocolError(ValueError):
    """A message that does not follow the wire format (maps to HTTP 400, or ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk's header entry: key, payload size, dtype, shape and checksum.

    ``found`` is False only in get responses for missing keys (then no payload follows).
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

    def to_dict(self) -> dict:
        if not self.found:
            return {"key": self.key.hex(), "found": False}
        out = {"key": self.key.hex(), "found": True, "nbytes": self.nbytes,
               "dtype": self.dtype, "shape": list(self.shape), "xxh3": self.xxh3}
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


def parse_json(blob: bytes | str, what: str = "body") -> dict:
    """Decode a JSON object (``NaN``/``Infinity`` are read as floats, as Python writes them:
    each field's check refuses them where a number is expected).

    Raises:
        ProtocolError: malformed JSON, non-UTF-8 bytes, an integer of more than 4,300 digits
            (Python's int/str conversion limit), nesting deeper than the recursion limit, or a
            non-object.
    """
    try:
        obj = json.loads(blob)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"malformed JSON in {what}: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


def check_version(value: str | None) -> None:
    """Validate an ``X-KVStore-Protocol`` header value (absent means the current version)."""
    if value is None:
        return
    try:
        v = int(value)
    except ValueError:
        raise ProtocolError(f"bad {VERSION_HEADER} header {value!r}") from None
    if v not in SUPPORTED_VERSIONS:
        raise ProtocolError(f"unsupported protocol version {v}; "
                            f"supported: {list(SUPPORTED_VERSIONS)}")


#: Namespaces parsed recently, by their fields (parsing + digest cost ~20 us per request).
_NS_CACHE: dict[tuple, Namespace] = {}
_NS_CACHE_MAX = 1024


def _ns_cache_key(obj: dict) -> tuple | None:
    layout = obj.get("layout")
    if not isinstance(layout, dict) or len(obj) > 5 + len(IDENTITY_FIELDS):
        return None
    try:
        key = tuple((k, v) for k, v in sorted(obj.items()) if k != "layout") + \
            (("layout", tuple(sorted(layout.items()))),)
        hash(key)
    except TypeError:  # unhashable field values: parse without the cache
        return None
    return key


_LAYOUT_INTS = ("num_layers", "num_kv_heads", "head_dim", "chunk_size")


def parse_namespace(obj: Any) -> Namespace:
    """Namespace from its ``to_dict()`` form (recent ones cached). Raises ProtocolError naming
    the problem."""
    if not isinstance(obj, dict):
        raise ProtocolError("missing or non-object 'namespace'")
    ck = _ns_cache_key(obj)
    ns = _NS_CACHE.get(ck) if ck is not None else None
    if ns is not None:
        return ns
    layout = obj.get("layout")
    if isinstance(layout, dict):  # exact ints: int() would take 2.7, "3", true or overflow
        for name in _LAYOUT_INTS:
            v = layout.get(name)
            if type(v) is not int:
                raise ProtocolError(f"bad namespace: layout.{name} must be an integer, "
                                    f"got {str(v)[:40]!r}")
    try:
        ns = Namespace.from_dict(obj)
        ns.ns_id  # validates and caches the digest
    except KeyError as e:
        raise ProtocolError(f"bad namespace: missing field {str(e)[:100]}") from None
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise ProtocolError(f"bad namespace: {str(e)[:200]!r}") from None
    if ck is not None:
        if len(_NS_CACHE) >= _NS_CACHE_MAX:
            _NS_CACHE.clear()
        _NS_CACHE[ck] = ns
    return ns


#: Prefix hash bytes of each ``Namespace.hash_algo`` (``kvstore.keys``: sha256 and blake2b
#: digests are 32 bytes, xxh3_128 16).
PREFIX_HASH_BYTES = {"sha256": 32, "blake2b": 32, "xxh3_128": 16}


def parse_key(ns: Namespace, value: Any) -> ChunkKey:
    """A hex key that must belong to ``ns`` (tenant isolation: ns_id prefix must match) and
    have the prefix-hash length of ``ns.hash_algo`` (``PREFIX_HASH_BYTES``).

    Raises:
        ProtocolError: not a hex string, a key of another namespace or of another length.
    """
    if not isinstance(value, str):
        raise ProtocolError(f"key must be a hex string, got {type(value).__name__}")
    try:
        key = ChunkKey.from_bytes(bytes.fromhex(value))
    except ValueError as e:
        raise ProtocolError(f"bad key {value[:100]!r}: {e}") from None
    if key.ns_id != ns.ns_id:
        raise ProtocolError(f"key {value[:16]}... does not belong to the request's namespace")
    want = PREFIX_HASH_BYTES[ns.hash_algo]
    if len(key.prefix_hash) != want:  # no client of this namespace could ever name it
        raise ProtocolError(f"key {value[:16]}... has a {len(key.prefix_hash)}-byte prefix "
                            f"hash; namespace hash_algo {ns.hash_algo} makes {want}-byte ones")
    return key


def parse_keys(ns: Namespace, values: Any, max_keys: int) -> list[ChunkKey]:
    """List of hex keys, at most ``max_keys`` (413 beyond). Raises ProtocolError."""
    if not isinstance(values, list):
        raise ProtocolError("'keys' must be a list of hex strings")
    if len(values) > max_keys:
        raise ProtocolError(f"{len(values)} keys exceed the limit of {max_keys} per batch", 413)
    # fast path: every key a hex string of this namespace with the same length; decoded at once
    if values and all(v.__class__ is str for v in values):
        n = len(values[0])
        if n == 2 * (16 + PREFIX_HASH_BYTES[ns.hash_algo]) and all(len(v) == n for v in values):
            try:
                raw = bytes.fromhex("".join(values))
            except ValueError:
                raw = None
            if raw is not None:
                ns_id, half = ns.ns_id, n // 2
                if all(raw[i:i + 16] == ns_id for i in range(0, len(raw), half)):
                    return [ChunkKey(ns_id, raw[i + 16:i + half]) for i in range(0, len(raw), half)]
    return [parse_key(ns, v) for v in values]  # slow path names the bad key


def key_request(ns: Namespace, keys: Sequence[ChunkKey], **extra: Any) -> bytes:
    """JSON body of a control request (lookup/exists/get/remove/pin/unpin)."""
    if extra:
        body = {"namespace": ns.to_dict(), "keys": [k.hex() for k in keys], **extra}
        return json.dumps(body, separators=(",", ":")).encode()
    # same bytes as json.dumps of {"namespace", "keys"}, without re-encoding the namespace
    hexes = '","'.join([(k.ns_id + k.prefix_hash).hex() for k in keys])
    return (b'{"namespace":' + _ns_json(ns) + b',"keys":' +
            (f'["{hexes}"]' if keys else "[]").encode() + b"}")


def _ns_json(ns: Namespace) -> bytes:
    blob = _NS_JSON.get(ns)
    if blob is None:
        if len(_NS_JSON) >= _NS_CACHE_MAX:
            _NS_JSON.clear()
        blob = _NS_JSON[ns] = json.dumps(ns.to_dict(), separators=(",", ":")).encode()
    return blob


_NS_JSON: dict[Namespace, bytes] = {}


def parse_put_header(header: dict, max_keys: int) -> tuple[Namespace, list[ChunkEntry], bool]:
    """Validate a put header against its namespace layout, before any payload is read.

    Returns:
        (namespace, entries, durable)

    Raises:
        ProtocolError: missing fields, a key of another namespace, a duplicate key, a dtype,
            shape or nbytes that does not match ``namespace.layout``, or too many chunks (413).
    """
    ns = parse_namespace(header.get("namespace"))
    chunks = header.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ProtocolError("'chunks' must be a non-empty list")
    if len(chunks) > max_keys:
        raise ProtocolError(f"{len(chunks)} chunks exceed the limit of {max_keys} per batch", 413)
    layout = ns.layout
    entries = [_parse_put_entry(ns, layout, c) for c in chunks]
    if len({e.key for e in entries}) != len(entries):
        raise ProtocolError("duplicate key in one put batch")
    entries = [_parse_parent(ns, c, e) for c, e in zip(chunks, entries)]
    durable = header.get("durable", False)
    if not isinstance(durable, bool):
        raise ProtocolError("'durable' must be a boolean")
    return ns, entries, durable


def _parse_put_entry(ns: Namespace, layout: KVLayout, c: Any) -> ChunkEntry:
    if not isinstance(c, dict):
        raise ProtocolError("each chunk entry must be a JSON object")
    key = parse_key(ns, c.get("key"))
    nbytes, dtype, shape, xxh = c.get("nbytes"), c.get("dtype"), c.get("shape"), c.get("xxh3")
    if dtype != layout.dtype:
        raise ProtocolError(f"dtype mismatch: layout has {layout.dtype}, chunk says {dtype!r}")
    # exact ints: JSON 256.0 == 256 in Python, but a float size breaks range()/slicing later
    if not isinstance(shape, list) or any(type(s) is not int for s in shape) \
            or tuple(shape) != layout.shape():
        raise ProtocolError(f"shape mismatch: expected {list(layout.shape())}, got {shape!r}")
    if type(nbytes) is not int or nbytes != layout.chunk_bytes:
        raise ProtocolError(f"nbytes mismatch: layout needs {layout.chunk_bytes}, "
                            f"chunk says {nbytes!r}")
    if not isinstance(xxh, str) or len(xxh) != 16:
        raise ProtocolError(f"'xxh3' must be 16 hex digits, got {xxh!r}")
    return ChunkEntry(key, nbytes, dtype, tuple(shape), xxh.lower())


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


def parse_get_response_header(header: dict, ns: Namespace,
                              keys: Sequence[ChunkKey]) -> list[ChunkEntry]:
    """Validate a get response header against the request (same keys, in order, and the
    namespace layout for found entries). Raises ProtocolError."""
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
        out.append(_parse_put_entry(ns, ns.layout, c))
    return out


def payload_total(entries: Sequence[ChunkEntry]) -> int:
    """Sum of the payload bytes of present entries."""
    return sum(e.nbytes for e in entries if e.found)


def error_body(message: str, status: int) -> dict:
    """JSON error object sent with every non-2xx response."""
    return {"error": message, "status": status}

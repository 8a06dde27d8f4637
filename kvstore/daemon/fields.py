"""JSON fields of the kvstore daemon's wire format: the namespace, keys, protocol version and
error bodies of control requests. Pure functions, no I/O. The binary messages (put and get
bodies) and the format's description are ``kvstore.daemon.protocol``, which re-exports these.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from kvstore.daemon.wire_version import (  # noqa: F401 (re-exported)
    PROTOCOL_VERSION, SUPPORTED_VERSIONS, VERSION_HEADER)
from kvstore.keys import IDENTITY_FIELDS, ChunkKey, Namespace
from kvstore.ns_wire import LAYOUT_FIELDS, check_known_fields  # noqa: F401 (re-exported)
from kvstore.ns_wire import NAMESPACE_FIELDS as _NS_WIRE_FIELDS


class ProtocolError(ValueError):
    """A message that does not follow the wire format (maps to HTTP 400, or ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


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
#: Characters one namespace field may have (a model id, revision, salt, fingerprint, a rope
#: config's JSON); the daemon keeps every namespace it was named (``--max-namespaces``), so a
#: field without a bound would let any client, a reader too, grow the daemon's memory.
MAX_NAMESPACE_FIELD_CHARS = 4096
#: Characters all fields of one namespace may have together.
MAX_NAMESPACE_CHARS = 16384


#: The fields of a namespace's wire form (``Namespace.to_dict``; ``kvstore.ns_wire``'s).
NAMESPACE_FIELDS = frozenset(_NS_WIRE_FIELDS)


def check_namespace_fields(obj: dict) -> None:
    """Refuse a namespace with a field ``Namespace`` does not have, or a ``layout`` object with
    a field ``KVLayout`` does not have (``kvstore.ns_wire.check_known_fields``, the check
    every parse of a namespace makes: ignoring it would let two clients that differ in it
    share chunks, as the field is not in the namespace id; a typo ``hed_dim`` would be
    answered as a missing ``head_dim``), or whose fields exceed ``MAX_NAMESPACE_FIELD_CHARS``
    each or ``MAX_NAMESPACE_CHARS`` together (strings by length, other values by their JSON).

    Raises:
        ProtocolError: (400) ``bad namespace: `` and ``check_known_fields``' message (the
            unknown field(s), up to 5 of 40 characters each, and the fields known) with a
            hint that the client may be newer than the daemon; or naming the field and the
            bound.
    """
    try:
        check_known_fields(obj)
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"bad namespace: {e} (a newer client than this daemon?)") from None
    total = 0
    for name, value in obj.items():
        if name == "layout" and isinstance(value, dict):  # (only LAYOUT_FIELDS, checked above)
            n = sum(len(str(v)) for v in value.values())
        else:
            try:
                n = len(value) if isinstance(value, str) else len(json.dumps(value, default=str))
            except (RecursionError, ValueError):
                raise ProtocolError(f"bad namespace: field {str(name)[:40]!r} is nested too "
                                    "deep") from None
        if n > MAX_NAMESPACE_FIELD_CHARS:
            raise ProtocolError(f"bad namespace: field {str(name)[:40]!r} has {n} characters, "
                                f"more than {MAX_NAMESPACE_FIELD_CHARS}")
        total += n + len(str(name))
    if total > MAX_NAMESPACE_CHARS:
        raise ProtocolError(f"bad namespace: {total} characters in all, more than "
                            f"{MAX_NAMESPACE_CHARS}")


def parse_namespace(obj: Any) -> Namespace:
    """Namespace from its ``to_dict()`` form (recent ones cached). Raises ProtocolError naming
    the problem."""
    if not isinstance(obj, dict):
        raise ProtocolError("missing or non-object 'namespace'")
    ck = _ns_cache_key(obj)
    ns = _NS_CACHE.get(ck) if ck is not None else None
    if ns is not None:
        return ns
    check_namespace_fields(obj)
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
        raise ProtocolError(f"key {value[:16]}... does not belong to the request's namespace: "
                            f"its namespace id is {key.ns_id.hex()}, the request's namespace "
                            f"has id {ns.ns_id.hex()} (docs/wire-format.md: Namespaces and keys)")
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
    # fast path: every key a lowercase hex string of this namespace's id and hash size;
    # decoded at once (the slow path names the first bad key)
    n, ns_hex = 2 * (16 + PREFIX_HASH_BYTES[ns.hash_algo]), ns.ns_id.hex()
    if values and all(v.__class__ is str and len(v) == n and v.startswith(ns_hex)
                      for v in values):
        try:
            raw = bytes.fromhex("".join(values))
        except ValueError:
            raw = None
        if raw is not None:
            ns_id, size, trusted = ns.ns_id, n // 2, ChunkKey.trusted
            return [trusted(ns_id, raw[i + 16:i + size]) for i in range(0, len(raw), size)]
    return [parse_key(ns, v) for v in values]


def check_key_types(keys: Sequence[ChunkKey]) -> None:
    """Raise ``ValueError`` for a key that is not a ``ChunkKey`` (as the in-process store
    does: raw bytes would be sent as a key of whatever namespace their first 16 bytes name)."""
    if set(map(type, keys)) <= _CHUNK_KEY_TYPE:
        return
    for k in keys:
        if not isinstance(k, ChunkKey):
            raise ValueError(f"expected ChunkKey, got {type(k).__name__}")


_CHUNK_KEY_TYPE = {ChunkKey}


def key_request(ns: Namespace, keys: Sequence[ChunkKey], **extra: Any) -> bytes:
    """JSON body of a control request (lookup/exists/get/remove/pin/unpin).

    Raises:
        ValueError: a key that is not a ``ChunkKey`` (``check_key_types``).
    """
    check_key_types(keys)
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


def error_body(message: str, status: int) -> dict:
    """JSON error object sent with every non-2xx response."""
    return {"error": message, "status": status}

"""Chunk keys: a chained prefix hash of token ids, seeded by a namespace digest.

Scheme (stable across processes, platforms and restarts; no environment setting):

    seed     = H(b"kvstore-ns-v1" || canonical JSON of the namespace)       (namespace digest)
    hash(-1) = seed
    hash(i)  = H(hash(i-1) || uint32-LE token ids of chunk i)

so ``hash(i)`` names chunk ``i`` *together with every token before it*. ``H`` is sha256 by
default (collision resistant: keys are shared between tenants), ``blake2b`` (32-byte digest)
on request, or ``xxh3_128`` for trusted single-tenant use only. Only full chunks get keys.
"""
from __future__ import annotations

import hashlib
from dataclasses import FrozenInstanceError, dataclass
from functools import cached_property
from itertools import repeat
from operator import itemgetter
from typing import Callable, Sequence

import numpy as np
import xxhash

from kvstore.kv_codec import LOSSY_CODECS
from kvstore.layout import KVLayout
from kvstore.ns_wire import (HASH_ALGOS, IDENTITY_FIELDS,  # noqa: F401 (re-exported)
                             canonical_json, check_known_fields, namespace_digest,
                             text_field)


def _hasher(algo: str) -> Callable[[bytes], bytes]:
    if algo == "sha256":
        return lambda b: hashlib.sha256(b).digest()
    if algo == "blake2b":
        return lambda b: hashlib.blake2b(b, digest_size=32).digest()
    if algo == "xxh3_128":
        return lambda b: xxhash.xxh3_128_digest(b)
    raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {HASH_ALGOS}")


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as uint32 little-endian bytes (4 bytes per token).

    Raises:
        ValueError: a token id that is not an integer (``1.5`` used to be truncated to ``1``,
            so two prompts shared keys), is negative, or does not fit in 32 bits.
    """
    arr = np.asarray(tokens)
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind != "O" or not all(isinstance(t, (int, np.integer))
                                            and not isinstance(t, bool) for t in arr.flat):
            raise ValueError(f"token ids must be integers, got {arr.dtype} values")
        if any(not 0 <= int(t) < 2**32 for t in arr.flat):  # ints too big for int64
            raise ValueError("token ids must be in [0, 2**32)")
    arr = arr.astype(np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def chain_hashes(seed: bytes, tokens: Sequence[int] | np.ndarray, unit: int,
                 algo: str = "sha256") -> list[bytes]:
    """Chained hashes of each full ``unit``-token slice of ``tokens``.

    ``out[i] = H(out[i-1] || tokens[i*unit:(i+1)*unit])`` with ``out[-1] = seed``.
    Used for store chunk keys (unit = the namespace's ``chunk_size``).
    """
    if unit <= 0:
        raise ValueError(f"unit must be positive, got {unit}")
    h = _hasher(algo)
    raw = tokens_to_bytes(tokens)
    step = 4 * unit
    out: list[bytes] = []
    prev = seed
    for i in range(len(raw) // step):
        prev = h(prev + raw[i * step:(i + 1) * step])
        out.append(prev)
    return out


def _rope_number(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def rope_identity(theta: float, scaling: dict | None) -> dict:
    """The ``rope`` ingredient of a namespace in one form for every engine:
    ``{"theta": float, "scaling": dict | None}``, from RoPE's base and its scaling as a model's
    config writes it (Hugging Face ``rope_scaling`` / ``rope_parameters``, or GGUF's
    ``rope.scaling.*`` read into the same keys).

    Normalized so that two engines that read the same model write the same value: ``type`` is
    renamed ``rope_type``; ``rope_theta`` inside the scaling dict is dropped (it is ``theta``);
    a ``rope_type`` of ``"default"`` (or none) with no other parameter is no scaling (None);
    numbers are floats (``8`` and ``8.0`` are one factor), lists of numbers likewise.

    Args:
        theta: RoPE base (e.g. 100000.0 for SmolLM2).
        scaling: the scaling parameters, or None.

    Raises:
        TypeError: ``scaling`` is neither a dict nor None.
    """
    if scaling is not None and not isinstance(scaling, dict):
        raise TypeError(f"rope scaling must be a dict or None, not {type(scaling).__name__}")
    sc = {}
    for k, v in (scaling or {}).items():
        if k == "rope_theta":
            continue
        k = "rope_type" if k == "type" else k
        sc[k] = [_rope_number(x) for x in v] if isinstance(v, (list, tuple)) else _rope_number(v)
    if sc.get("rope_type", "default") == "default" and set(sc) <= {"rope_type"}:
        sc = None
    return {"theta": float(theta), "scaling": sc}


@dataclass(frozen=True)
class Namespace:
    """What a chunk's KV depends on besides its tokens.

    Two namespaces with any field different never share a key. A connector fills every field
    that changes the KV of the same token ids from what its engine actually loaded (see
    ``connectors.engine_min`` and ``connectors.vllm``); the user names nothing by default.

    Attributes:
        model_id: model name or path-independent identity (e.g. ``"HuggingFaceTB/SmolLM2-135M-Instruct"``).
        layout: KV layout (layers, heads, head_dim, KV dtype, chunk_size).
        revision: weights revision (a tag or commit), ``""`` when not named.
        cache_salt: optional tenant salt; tenants with different salts never share chunks.
        hash_algo: ``"sha256"`` (default), ``"blake2b"`` or ``"xxh3_128"``.
        weights_fingerprint: digest of the loaded weights' content (e.g. ``"xxh3_128:<32 hex>"``,
            ``engine_min.identity.weights_fingerprint``); ``""`` = not computed.
        compute_dtype: dtype the model computes in, when it differs from the KV dtype or the
            engine reports it (``"float32"``...); ``""`` = not reported.
        rope: RoPE parameters (theta and scaling) as canonical JSON; a dict is accepted and
            written canonically (``canonical_json``). ``""`` = not reported.
        quantization: weight quantization method (vLLM's ``quantization``, e.g. ``"awq"``);
            ``""`` = none (engine_min dequantizes at load; the fingerprint covers the values).
        kv_quantization: KV cache quantization (scales / method); ``""`` = none.
        adapter: LoRA (or other adapter) identity applied to the KV; ``""`` = none.
        lossy_codec: the lossy codec (``"int8"``, ``"fp8"``, ``"kivi"``) this namespace's consumer accepts
            its chunks to be stored with in a tier configured for it (``kvstore.kv_codec``:
            reads may then return decoded, not bit-exact, KV); ``""`` (default) = bit-exact
            only. Part of the digest when set, so such chunks never share a key with exact ones.

    ``IDENTITY_FIELDS`` left empty are not part of ``to_dict`` nor the digest (namespaces
    without them keep their keys).

    Raises:
        ValueError: an unknown ``hash_algo`` or ``lossy_codec``.
        TypeError: a field value that is not a string (``rope`` may be a dict).
    """

    model_id: str
    layout: KVLayout
    revision: str = ""
    cache_salt: str = ""
    hash_algo: str = "sha256"
    weights_fingerprint: str = ""
    compute_dtype: str = ""
    rope: str = ""
    quantization: str = ""
    kv_quantization: str = ""
    adapter: str = ""
    lossy_codec: str = ""

    def __post_init__(self) -> None:
        _hasher(self.hash_algo)  # validates
        object.__setattr__(self, "rope", canonical_json(self.rope))
        for name in ("model_id", "revision", "cache_salt") + IDENTITY_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Namespace.{name} must be a str, got "
                                f"{type(getattr(self, name)).__name__}")
        if self.lossy_codec and self.lossy_codec not in LOSSY_CODECS:
            raise ValueError(f"unknown lossy_codec {self.lossy_codec!r}; choose one of "
                             f"{LOSSY_CODECS} or '' (bit-exact only)")

    def to_dict(self) -> dict:
        """The wire form, JSON-able (``from_dict`` inverts it): every field, except
        ``IDENTITY_FIELDS`` that are empty (so a namespace without them has its old form)."""
        out = {"model_id": self.model_id, "revision": self.revision,
               "layout": self.layout.to_dict(), "cache_salt": self.cache_salt,
               "hash_algo": self.hash_algo}
        out.update((f, getattr(self, f)) for f in IDENTITY_FIELDS if getattr(self, f))
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Namespace":
        """Inverse of ``to_dict``; absent optional fields take their defaults.

        Raises:
            KeyError: no ``model_id`` or ``layout``. ValueError: a field a namespace or its
                layout does not have (a typo such as ``cache_slat`` would name another
                namespace), named before any other field is read
                (``kvstore.ns_wire.check_known_fields``); bad values. TypeError: ``d`` is not
                a dict; bad values.
        """
        check_known_fields(d)
        extra = {f: d.get(f) or "" for f in IDENTITY_FIELDS}  # checked by __post_init__
        return cls(model_id=text_field(d, "model_id", None), layout=KVLayout.from_dict(d["layout"]),
                   revision=text_field(d, "revision", ""), cache_salt=text_field(d, "cache_salt", ""),
                   hash_algo=text_field(d, "hash_algo", "sha256"), **extra)

    def describe(self) -> str:
        """One line for logs: model id, revision, fingerprint, KV dtype, chunk size, ns id."""
        parts = [self.model_id, f"revision={self.revision or '-'}",
                 f"weights={self.weights_fingerprint or '-'}", f"kv_dtype={self.layout.dtype}",
                 f"chunk_size={self.layout.chunk_size}"]
        parts += [f"{f}={getattr(self, f)}" for f in IDENTITY_FIELDS[1:] if getattr(self, f)]
        return " ".join(parts) + f" ns_id={self.ns_id.hex()}"

    @cached_property
    def digest(self) -> bytes:
        """32-byte seed of the hash chain (always sha256 of the canonical JSON of
        ``to_dict()``). Cached: the namespace is frozen, and lookups ask for it on every call."""
        return namespace_digest(self.to_dict())   # (kvstore.ns_wire: no torch needed)

    @cached_property
    def ns_id(self) -> bytes:
        """16-byte namespace id, the prefix of every storage key of this namespace."""
        return self.digest[:16]

    def chunk_keys(self, tokens: Sequence[int] | np.ndarray) -> list["ChunkKey"]:
        """Keys of the full chunks of ``tokens`` (``len(tokens) // chunk_size`` keys)."""
        hashes = chain_hashes(self.digest, tokens, self.layout.chunk_size, self.hash_algo)
        return trusted_keys(self.ns_id, hashes)  # (16-byte id, hashes of hash_algo's size)


class ChunkKey(tuple):
    """Key of one stored chunk: namespace id + chained prefix hash.

    Attributes:
        ns_id: 16-byte namespace id (``Namespace.ns_id``).
        prefix_hash: 32 bytes (sha256/blake2b) or 16 bytes (xxh3_128).

    ``bytes(key)`` (= ns_id || prefix_hash) is the storage key on disk and on the wire.

    The key is the pair ``(ns_id, prefix_hash)`` (a tuple underneath): hashing, equality and
    ordering (ns_id first) run in C, so an index, policy or pin probe with a key made by
    another request (another object than the stored one) calls no Python code. Immutable
    (setting a field raises ``dataclasses.FrozenInstanceError``); pickles as its two fields,
    so an unpickled key hashes as the loading process does. It also equals the plain tuple
    ``(ns_id, prefix_hash)``.

    Raises (constructor):
        ValueError: an ``ns_id`` that is not 16 bytes, or a ``prefix_hash`` of neither 16
            nor 32 bytes.
    """

    __slots__ = ()

    def __new__(cls, ns_id: bytes, prefix_hash: bytes) -> "ChunkKey":
        if len(ns_id) != 16:
            raise ValueError(f"ns_id must be 16 bytes, got {len(ns_id)}")
        if len(prefix_hash) not in (16, 32):
            raise ValueError(f"prefix_hash must be 16 or 32 bytes, got {len(prefix_hash)}")
        return _new_tuple(cls, (ns_id, prefix_hash))

    ns_id = property(itemgetter(0), doc="16-byte namespace id")
    prefix_hash = property(itemgetter(1), doc="16- or 32-byte chained prefix hash")

    @classmethod
    def trusted(cls, ns_id: bytes, prefix_hash: bytes) -> "ChunkKey":
        """The key of parts known to be well formed (``ns_id`` 16 bytes, ``prefix_hash`` 16
        or 32 bytes), built without the constructor's checks, for paths that make many keys
        at once from parts they checked (a namespace's own hashes, a request's keys whose
        lengths were checked together). Equal to ``ChunkKey(ns_id, prefix_hash)``.
        ``trusted_keys`` builds a whole list faster still."""
        return _new_tuple(cls, (ns_id, prefix_hash))

    def __setattr__(self, name, value):
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self):
        return (self.__class__, (self[0], self[1]))

    def __bytes__(self) -> bytes:
        return self[0] + self[1]

    @classmethod
    def from_bytes(cls, b: bytes) -> "ChunkKey":
        """The key whose ``bytes()`` is ``b`` (32 or 48 bytes).

        Raises:
            ValueError: another length.
        """
        if len(b) not in (32, 48):
            raise ValueError(f"a chunk key is 32 or 48 bytes, got {len(b)}")
        return cls(bytes(b[:16]), bytes(b[16:]))

    def hex(self) -> str:
        return bytes(self).hex()

    def __repr__(self) -> str:
        return f"ChunkKey({self[0].hex()[:8]}:{self[1].hex()[:12]})"

    __str__ = __repr__


_new_tuple = tuple.__new__


def trusted_keys(ns_id: bytes, prefix_hashes) -> list[ChunkKey]:
    """``[ChunkKey.trusted(ns_id, h) for h in prefix_hashes]`` in one C-level pass (a
    32-key request's keys in about a microsecond); the same trust rule as ``trusted``."""
    return list(map(_new_tuple, repeat(ChunkKey), zip(repeat(ns_id), prefix_hashes)))

"""A namespace's wire form and digest from plain JSON, importing neither torch nor numpy.

``wire_namespace(d)`` checks a namespace dict and returns the canonical form that
``kvstore.keys.Namespace.from_dict(d).to_dict()`` returns, and ``namespace_digest`` is the
digest ``Namespace.digest`` computes (``Namespace`` calls it), so ``kvstore clear --namespace``
checks and sends a namespace without torch's 2-3 s import, and the namespace id is defined in
one place:

    digest = sha256(b"kvstore-ns-v1" || canonical JSON of the wire form)     (32 bytes)
    ns_id  = digest[:16]

The dtype names and lossy codecs accepted here are the ones ``kvstore.layout`` and
``kvstore.kv_codec`` accept (those modules import torch; a test checks the lists agree).
"""
from __future__ import annotations

import hashlib
import json
from typing import Collection

HASH_ALGOS = ("sha256", "blake2b", "xxh3_128")

#: Namespace fields that name what besides the model id and KV layout changes a token's KV;
#: left out of ``to_dict`` (so of the digest) while empty: a namespace without them keeps the
#: keys it had before these fields existed.
IDENTITY_FIELDS = ("weights_fingerprint", "compute_dtype", "rope", "quantization",
                   "kv_quantization", "adapter", "lossy_codec")

#: ``kvstore.kv_codec.LOSSY_CODECS``
LOSSY_CODEC_NAMES = ("int8", "fp8", "kivi")
#: the keys of ``kvstore.layout.DTYPES`` (the fp8 names where torch has them)
KV_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
#: ``kvstore.layout``'s dtype aliases
KV_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16",
                    "bf16": "bfloat16", "float": "float32", "fp8": "float8_e4m3fn"}
#: The fields of a namespace's wire form (``Namespace.to_dict``), the only ones the daemon
#: takes (``kvstore.daemon.fields.NAMESPACE_FIELDS``; a test checks they agree).
NAMESPACE_FIELDS = ("model_id", "revision", "layout", "cache_salt", "hash_algo") + IDENTITY_FIELDS
#: The fields of a namespace's ``layout`` (``KVLayout.to_dict``; a test checks they agree).
LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_size")


def canonical_json(value) -> str:
    """``value`` as compact JSON with sorted keys (``""`` for None/empty), the form every
    process writes the same way; a str is taken as already canonical.

    Raises:
        TypeError: a value JSON cannot encode.
    """
    if value is None or value == {} or value == "":
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def namespace_digest(wire: dict) -> bytes:
    """The 32-byte digest of a namespace from its wire form (``wire_namespace``'s result or
    ``Namespace.to_dict()``): sha256 of ``b"kvstore-ns-v1"`` and the form's compact JSON with
    sorted keys. Its first 16 bytes are the namespace id."""
    blob = json.dumps(wire, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"kvstore-ns-v1" + blob).digest()


def text_field(d: dict, name: str, default: str | None) -> str:
    """``d[name]``, which must be a string (absent: ``default``; no default: KeyError).
    Not coerced: ``null`` or ``5`` read as ``"None"`` / ``"5"`` would name another namespace
    than the client meant (``Namespace.from_dict`` reads its fields with this too).

    Raises:
        KeyError: ``name`` absent with no default. ValueError: not a string.
    """
    if name not in d and default is not None:
        return default
    value = d[name]
    if not isinstance(value, str):
        raise ValueError(f"namespace field {name!r} must be a string, got {type(value).__name__}")
    return value


def wire_layout(d: dict) -> dict:
    """The canonical form of the layout dict ``d`` (``KVLayout.to_dict``'s: the dtype's
    canonical name), torch-free; ``KVLayout.from_dict`` checks its dict with this. Not
    coerced: ``"30"``, ``30.7`` or ``true`` for a number would name another layout than meant.

    Raises:
        TypeError: ``d`` is not a dict.
        ValueError: a field a layout does not have; a number that is not a positive int
            (bools refused), a dtype that is not a string or not a supported name; each
            message names the field.
        KeyError: a missing field (``e.args[0]`` names it).
    """
    if not isinstance(d, dict):
        raise TypeError(f"namespace layout must be an object, got {type(d).__name__}")
    _check_layout_fields(d)
    out = {}
    for field in LAYOUT_FIELDS:
        value = d[field]
        if field == "dtype":
            if not isinstance(value, str):
                raise ValueError(f"KVLayout.dtype must be a dtype name (a string), got "
                                 f"{repr(value)[:40]}")
            value = KV_DTYPE_ALIASES.get(value, value)
            if value not in KV_DTYPE_NAMES:
                raise ValueError(f"unsupported KV dtype {d[field]!r}; supported: "
                                 f"{sorted(KV_DTYPE_NAMES)}")
        elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"KVLayout.{field} must be a positive int, got {repr(value)[:40]}")
        out[field] = value
    return out


def unknown_fields(d: dict, known: Collection[str]) -> list[str]:
    """The keys of ``d`` not in ``known``, in ``d``'s order, each cut to 40 characters."""
    return [str(k)[:40] for k in d if k not in known]


def _names(unknown: list[str]) -> str:
    return ", ".join(repr(k) for k in unknown[:5]) + (", ..." if len(unknown) > 5 else "")


def check_known_fields(d: dict) -> None:
    """Refuse a namespace dict with a field a namespace does not have, or a ``layout`` (when
    it is an object) with a field a layout does not have, as the daemon does (400): ignored,
    a typo (``cache_slat``, ``hed_dim``) would name another namespace than the one meant.
    ``wire_namespace`` and ``Namespace.from_dict`` call it before reading any field.

    Raises:
        TypeError: ``d`` is not a dict.
        ValueError: one line naming the unknown field(s) (up to 5, 40 characters each) and
            the fields a namespace (or its layout) has; namespace fields are checked first.
    """
    if not isinstance(d, dict):
        raise TypeError(f"a namespace must be an object, got {type(d).__name__}")
    unknown = unknown_fields(d, NAMESPACE_FIELDS)
    if unknown:
        raise ValueError(f"unknown namespace field{'s' if len(unknown) > 1 else ''} "
                         f"{_names(unknown)}; a namespace has "
                         f"{', '.join(sorted(NAMESPACE_FIELDS))}")
    layout = d.get("layout")
    if isinstance(layout, dict):
        _check_layout_fields(layout)


def _check_layout_fields(layout: dict) -> None:
    unknown = unknown_fields(layout, LAYOUT_FIELDS)
    if unknown:
        raise ValueError(f"unknown namespace layout field{'s' if len(unknown) > 1 else ''} "
                         f"{_names(unknown)}; a layout has {', '.join(sorted(LAYOUT_FIELDS))}")


def wire_namespace(d: dict) -> dict:
    """The canonical wire form of the namespace ``d`` (JSON of ``Namespace.to_dict()``, or a
    hand-written one: dtype aliases, a dict ``rope``, absent optional fields), equal to
    ``Namespace.from_dict(d).to_dict()``: ``model_id``, ``revision``, ``layout`` (5 fields),
    ``cache_salt``, ``hash_algo``, and each identity field that is not empty.

    Raises:
        KeyError: ``model_id``, ``layout`` or a layout field is missing (``e.args[0]`` names
            it; ``model_id`` is checked first).
        ValueError: a field a namespace or its layout does not have, named before any other
            field is read (``check_known_fields``); a field that must be a string is not, a
            layout number that is not a positive int, an unknown dtype, hash algorithm or
            lossy codec (``wire_layout``).
        TypeError: ``d`` is not a dict, an identity field that is not a string (``rope`` may
            be any JSON value), or a ``layout`` that is not a dict.
    """
    check_known_fields(d)
    extra = {f: d.get(f) or "" for f in IDENTITY_FIELDS}
    model_id = text_field(d, "model_id", None)
    layout = wire_layout(d["layout"])
    out = {"model_id": model_id, "revision": text_field(d, "revision", ""), "layout": layout,
           "cache_salt": text_field(d, "cache_salt", ""),
           "hash_algo": text_field(d, "hash_algo", "sha256")}
    if out["hash_algo"] not in HASH_ALGOS:
        raise ValueError(f"unknown hash algorithm {out['hash_algo']!r}; choose one of "
                         f"{HASH_ALGOS}")
    extra["rope"] = canonical_json(extra["rope"])
    for name in IDENTITY_FIELDS:
        if not isinstance(extra[name], str):
            raise TypeError(f"Namespace.{name} must be a str, got {type(extra[name]).__name__}")
    if extra["lossy_codec"] and extra["lossy_codec"] not in LOSSY_CODEC_NAMES:
        raise ValueError(f"unknown lossy_codec {extra['lossy_codec']!r}; choose one of "
                         f"{LOSSY_CODEC_NAMES} or '' (bit-exact only)")
    out.update((f, v) for f, v in extra.items() if v)
    return out

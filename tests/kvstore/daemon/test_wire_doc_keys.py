"""docs/wire-format.md's "Namespaces and keys" section cannot drift from the code: every
worked example in it (a fenced JSON block after ``<!-- keys-example -->``) is recomputed twice,
by ``kvstore.keys.Namespace`` and by the formula as the doc states it (hashlib and struct
only, as a client author in another language would write it)."""
from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import pytest
import xxhash

from kvstore.keys import Namespace
from kvstore.ns_wire import wire_namespace

DOC = Path(__file__).resolve().parents[3] / "docs" / "wire-format.md"
_BLOCK = re.compile(r"<!-- keys-example -->\s*```json\n(.*?)\n```", re.S)


def _examples() -> list[dict]:
    blocks = _BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 2, "docs/wire-format.md lost its worked key examples"
    return [json.loads(b) for b in blocks]


def _by_the_doc(ex: dict) -> tuple[bytes, list[str]]:
    """The digest and keys computed from the doc's text alone."""
    canonical = ex["canonical"].encode()
    digest = hashlib.sha256(b"kvstore-ns-v1" + canonical).digest()
    algo = json.loads(ex["canonical"])["hash_algo"]
    H = {"sha256": lambda b: hashlib.sha256(b).digest(),
         "blake2b": lambda b: hashlib.blake2b(b, digest_size=32).digest(),
         "xxh3_128": xxhash.xxh3_128_digest}[algo]
    size = json.loads(ex["canonical"])["layout"]["chunk_size"]
    toks, prev, keys = ex["tokens"], digest, []
    for i in range(len(toks) // size):
        prev = H(prev + struct.pack(f"<{size}I", *toks[i * size:(i + 1) * size]))
        keys.append((digest[:16] + prev).hex())
    return digest, keys


@pytest.mark.parametrize("ex", _examples(), ids=lambda ex: json.dumps(ex["namespace"])[:60])
def test_worked_example_matches_the_code(ex):
    ns = Namespace.from_dict(ex["namespace"])
    assert json.dumps(wire_namespace(ex["namespace"]), sort_keys=True,
                      separators=(",", ":")) == ex["canonical"]
    assert json.dumps(ns.to_dict(), sort_keys=True, separators=(",", ":")) == ex["canonical"]
    assert ns.digest.hex() == ex["digest"]
    assert ns.ns_id.hex() == ex["ns_id"]
    keys = [k.hex() for k in ns.chunk_keys(ex["tokens"])]
    assert keys == ex["keys"]
    assert len(keys) == len(ex["tokens"]) // ns.layout.chunk_size  # full chunks only
    digest, doc_keys = _by_the_doc(ex)
    assert digest.hex() == ex["digest"] and doc_keys == ex["keys"]


def test_examples_cover_an_alias_and_a_16_byte_hash():
    exs = _examples()
    assert any(ex["namespace"]["layout"]["dtype"] == "fp16" for ex in exs)
    assert {len(bytes.fromhex(ex["keys"][0])) for ex in exs} == {48, 32}


def test_empty_identity_fields_are_dropped_and_defaults_kept():
    """The canonical-form rule the doc states: revision, cache_salt and hash_algo always
    present, an empty identity field dropped, a dict rope written as sorted compact JSON."""
    base = _examples()[0]["namespace"]
    w = wire_namespace({**base, "adapter": "", "rope": {"theta": 1.0, "scaling": None}})
    assert w["revision"] == "" and w["cache_salt"] == "" and w["hash_algo"] == "sha256"
    assert "adapter" not in w and w["rope"] == '{"scaling":null,"theta":1.0}'
    assert Namespace.from_dict({**base, "adapter": ""}).ns_id.hex() == _examples()[0]["ns_id"]

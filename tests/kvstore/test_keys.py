"""Chunk keys: chaining, namespace separation, and identity across processes."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.keys import ChunkKey, Namespace, chain_hashes, tokens_to_bytes
from kvstore.layout import KVLayout

LAY = KVLayout(2, 1, 4, "float16", 4)
NS = Namespace("m", LAY)


def test_chain_is_sha256_of_previous_and_tokens():
    seed = NS.digest
    h0 = hashlib.sha256(seed + tokens_to_bytes([1, 2, 3, 4])).digest()
    h1 = hashlib.sha256(h0 + tokens_to_bytes([5, 6, 7, 8])).digest()
    assert chain_hashes(seed, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, h1]  # partial chunk: no key
    keys = NS.chunk_keys([1, 2, 3, 4, 5, 6, 7, 8])
    assert [k.prefix_hash for k in keys] == [h0, h1]
    assert bytes(keys[0]) == NS.ns_id + h0 and len(bytes(keys[0])) == 48


def test_same_chunk_tokens_at_other_position_get_other_key():
    k = NS.chunk_keys([1, 2, 3, 4, 1, 2, 3, 4])
    assert k[0] != k[1]


def test_namespace_fields_all_change_keys():
    toks = list(range(8))
    base = NS.chunk_keys(toks)
    others = [Namespace("other", LAY), Namespace("m", LAY, revision="r2"),
              Namespace("m", KVLayout(2, 1, 4, "bfloat16", 4)), Namespace("m", KVLayout(3, 1, 4, "float16", 4)),
              Namespace("m", LAY, cache_salt="tenant-b")]
    for ns in others:
        ks = ns.chunk_keys(toks)
        assert all(a != b for a, b in zip(base, ks)), ns


def test_hash_algos_and_bad_input():
    assert len(Namespace("m", LAY, hash_algo="blake2b").chunk_keys([0] * 4)[0].prefix_hash) == 32
    assert len(Namespace("m", LAY, hash_algo="xxh3_128").chunk_keys([0] * 4)[0].prefix_hash) == 16
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        Namespace("m", LAY, hash_algo="md5")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        NS.chunk_keys([1, 2, 3, -1])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        NS.chunk_keys([1, 2, 3, 2**70])  # beyond int64 too
    for bad in ([1, 2, 3, 4.5], [1.0, 2.0, 3.0, 4.0], [1, 2, 3, None], np.ones(4)):
        with pytest.raises(ValueError, match="token ids must be integers"):
            NS.chunk_keys(bad)  # 4.5 used to be truncated to 4: another prompt's key
    assert NS.chunk_keys(np.arange(4, dtype=np.uint32)) == NS.chunk_keys([0, 1, 2, 3])
    with pytest.raises(ValueError, match="chunk key is 32 or 48 bytes, got 3"):
        ChunkKey.from_bytes(b"abc")
    k = NS.chunk_keys([1, 2, 3, 4])[0]
    assert ChunkKey.from_bytes(bytes(k)) == k


_CHILD = ("from kvstore.keys import Namespace; from kvstore.layout import KVLayout;"
          "ns = Namespace('SmolLM2', KVLayout(30, 3, 64, 'float16', 256), revision='q4_1', cache_salt='s');"
          "print(','.join(k.hex() for k in ns.chunk_keys(list(range(1000, 1768)))))")


def test_keys_identical_in_two_processes():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    outs = []
    for seed in ("1", "2"):
        env["PYTHONHASHSEED"] = seed
        r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                           check=True, timeout=60)
        outs.append(r.stdout.strip())
    ns = Namespace("SmolLM2", KVLayout(30, 3, 64, "float16", 256), revision="q4_1", cache_salt="s")
    here = ",".join(k.hex() for k in ns.chunk_keys(list(range(1000, 1768))))
    assert outs[0] == outs[1] == here
    assert len(here.split(",")) == 3

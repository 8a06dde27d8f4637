"""``ChunkKey`` computes its hash once; equality, ordering and pickling are unchanged."""
import copy
import dataclasses
import pickle
import subprocess
import sys

import pytest

from kvstore.keys import ChunkKey

A = ChunkKey(b"n" * 16, b"a" * 32)


def test_equal_keys_hash_alike_and_unequal_keys_differ():
    b = ChunkKey(b"n" * 16, b"a" * 32)
    other_ns = ChunkKey(b"m" * 16, b"a" * 32)
    short = ChunkKey(b"n" * 16, b"a" * 16)
    assert A == b and hash(A) == hash(b) == hash((b"n" * 16, b"a" * 32))
    assert A != other_ns and A != short and A != bytes(A)
    assert {A: 1}[b] == 1 and len({A, b, other_ns, short}) == 3
    assert sorted([A, other_ns]) == [other_ns, A]  # order=True: ns_id first


def test_a_pickled_key_gets_the_hash_of_the_process_that_loads_it():
    blob = pickle.dumps({A: "v"})
    # another process hashes bytes with another seed: the dict must still find the key
    code = ("import pickle, sys; from kvstore.keys import ChunkKey; "
            "d = pickle.loads(sys.stdin.buffer.read()); "
            "print(d[ChunkKey(b'n' * 16, b'a' * 32)])")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                         check=True, env={"PYTHONHASHSEED": "12345"})
    assert out.stdout.decode().strip() == "v"
    assert copy.deepcopy(A) == A and hash(copy.copy(A)) == hash(A)


def test_a_trusted_key_is_the_same_key_as_a_checked_one():
    t = ChunkKey.trusted(b"n" * 16, b"a" * 32)
    assert t == A and hash(t) == hash(A) and {A: 1}[t] == 1 and repr(t) == repr(A)
    assert bytes(t) == bytes(A) and t.hex() == A.hex() and sorted([t, A]) == [A, A]
    assert pickle.loads(pickle.dumps(t)) == A and copy.deepcopy(t) == A
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.ns_id = b"m" * 16

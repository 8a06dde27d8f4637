"""The engine's block hash: a chain of xxh3-128 digests over full blocks of uint32 tokens."""
import struct

import pytest
import xxhash

from engine_min.block_hash import block_hashes


def test_each_hash_chains_the_previous_one_and_the_block_tokens():
    h = block_hashes(b"seed", [1, 2, 3, 4, 5, 6, 7], 3)   # 2 full blocks; token 7 left out
    first = xxhash.xxh3_128_digest(b"seed" + struct.pack("<3I", 1, 2, 3))
    assert h == [first, xxhash.xxh3_128_digest(first + struct.pack("<3I", 4, 5, 6))]
    assert all(len(x) == 16 for x in h)


def test_extending_from_the_last_hash_equals_hashing_the_whole_prefix():
    whole = block_hashes(b"s", list(range(12)), 4)
    head = block_hashes(b"s", list(range(8)), 4)
    assert head + block_hashes(head[-1], list(range(8, 12)), 4) == whole


def test_a_different_earlier_block_or_seed_changes_every_later_hash():
    a = block_hashes(b"s", [1, 2, 3, 4], 2)
    b = block_hashes(b"s", [9, 2, 3, 4], 2)
    c = block_hashes(b"t", [1, 2, 3, 4], 2)
    assert a[0] != b[0] and a[1] != b[1] and a[1] != c[1]
    assert block_hashes(b"s", [1, 2], 4) == []


@pytest.mark.parametrize("tokens, bs", [([1, 2], 0), ([-1, 2], 2), ([2**32, 0], 2)])
def test_bad_block_size_or_token_id_raises(tokens, bs):
    with pytest.raises(ValueError):
        block_hashes(b"s", tokens, bs)

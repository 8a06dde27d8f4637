"""A lookup's paths (``StoreState.check_keys`` and ``locate_leading``): one tier or several, with
chunks removed while pinned, give the tiers ``locate`` gives key by key, and refuse bad keys
with the same errors; keys built in bulk (``trusted_keys``) are the keys the constructor
builds."""
import pytest

from kvstore.keys import ChunkKey, Namespace, trusted_keys
from tests.kvstore.store_helpers import LAY, NS, make, prompt, put


def key_of(i):
    return NS.chunk_keys(prompt(i))[0]


def test_leading_tiers_over_cpu_and_disk_stop_at_the_first_miss(tmp_path):
    s = make(tmp_path, cpu=2, disk=10**6, promote_on_hit=False)
    for i in range(4):  # two CPU pages: prompts 0 and 1 spill to disk
        put(s, prompt(i))
    k = [key_of(i) for i in range(5)]  # k[4]: never stored
    r = s.lookup_keys(NS, k[:4])
    assert (r.num_hit_chunks, r.tiers, r.num_requested_chunks) == (4, ("disk", "disk", "cpu", "cpu"), 4)
    assert s.lookup_keys(NS, [k[3], k[4], k[0]]).tiers == ("cpu",)
    assert s.lookup_keys(NS, [k[4], k[3]]).num_hit_chunks == 0
    assert s.lookup_keys(NS, []).tiers == ()
    s.pin(NS, [k[0]])
    assert s.remove(NS, [k[0]]) == 1  # pinned: kept until unpinned, but no longer found
    assert s.lookup_keys(NS, [k[2], k[0], k[1]]).tiers == ("cpu",)
    assert s.try_lookup_keys(NS, [k[1], k[3], k[0]]).tiers == ("disk", "cpu")
    assert s.stats()["lookups"] == 6
    s.check_integrity()
    s.close()


def test_one_tier_counts_its_leading_keys(tmp_path):
    s = make(cpu=4)
    for i in range(3):
        put(s, prompt(i))
    k = [key_of(i) for i in range(4)]
    assert s.lookup_keys(NS, k).tiers == ("cpu",) * 3
    assert s.try_lookup_keys(NS, [k[1], k[3], k[0]]).tiers == ("cpu",)
    s.pin(NS, [k[1]])
    s.remove(NS, [k[1]])
    assert s.lookup_keys(NS, [k[0], k[1], k[2]]).tiers == ("cpu",)
    assert s.stats()["requested_tokens"] == 4 * (4 + 3 + 3)
    assert s.stats()["hit_tokens"] == 4 * (3 + 1 + 1)
    s.close()


def test_bad_keys_are_refused_as_before():
    s = make(cpu=2)
    other = Namespace("other", LAY).chunk_keys(prompt(0))[0]
    k = key_of(0)
    with pytest.raises(ValueError, match="belongs to namespace"):
        s.lookup_keys(NS, [k, other])
    with pytest.raises(ValueError, match="expected ChunkKey, got tuple"):
        s.lookup_keys(NS, [k, (k.ns_id, k.prefix_hash)])  # equal to the key, yet not one
    with pytest.raises(ValueError, match="expected ChunkKey, got bytes"):
        s.exists(NS, [bytes(k)])

    class Key(ChunkKey):
        __slots__ = ()
    assert s.lookup_keys(NS, [Key(k.ns_id, k.prefix_hash)]).num_hit_chunks == 0
    s.close()


def test_keys_built_in_bulk_are_the_checked_keys():
    hashes = [bytes([i]) * 32 for i in range(3)] + [b"\x07" * 16]
    bulk = trusted_keys(b"n" * 16, hashes)
    assert bulk == [ChunkKey(b"n" * 16, h) for h in hashes]
    assert [type(k) for k in bulk] == [ChunkKey] * 4
    assert [k.prefix_hash for k in bulk] == hashes and {k.ns_id for k in bulk} == {b"n" * 16}
    assert trusted_keys(b"n" * 16, []) == []
    k = bulk[0]
    assert k == (b"n" * 16, hashes[0]) and len(k) == 2  # the pair underneath
    assert not hasattr(k, "__dict__") and str(k) == repr(k) == "ChunkKey(6e6e6e6e:000000000000)"
    with pytest.raises(ValueError, match="ns_id must be 16 bytes"):
        ChunkKey(b"n" * 15, hashes[0])
    with pytest.raises(ValueError, match="prefix_hash must be 16 or 32 bytes"):
        ChunkKey(b"n" * 16, b"x" * 20)

"""Values in Redis that fail a check (a flipped payload byte, a value under another chunk's
key, a truncated value, an unknown version, another layout's value) are misses: the store's
get returns None for that chunk and the right tensors for the others, raises nothing, counts
``validation_failures{reason}`` and deletes the bad value."""
import struct

import pytest
import torch

from kvstore.codec import checksum, pack_value, unpack_header
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from tests.kvstore.remote_helpers import NS, count, make_store, prompt, rkey, same, sample

BAD = 1  # index of the corrupted chunk in the 4-chunk prompt


def flip_payload_byte(r, keys):
    rk = rkey(keys[BAD])
    off = unpack_header(r.get(rk)).payload_offset + 10
    old = r.getrange(rk, off, off)[0]
    r.setrange(rk, off, bytes([old ^ 0x01]))


def copy_other_chunk(r, keys):
    r.set(rkey(keys[BAD]), r.get(rkey(keys[3])))


def truncate(r, keys):
    v = r.get(rkey(keys[BAD]))
    r.set(rkey(keys[BAD]), v[:len(v) // 2])


def flip_version_byte(r, keys):
    """Version 1 -> 2 with the trailer checksum made right again (only the version is off)."""
    v = bytearray(r.get(rkey(keys[BAD])))
    struct.pack_into("<H", v, 4, 2)
    body = bytes(v[:-8])
    r.set(rkey(keys[BAD]), body + struct.pack("<Q", checksum(body)))


def flip_version_byte_only(r, keys):
    r.setrange(rkey(keys[BAD]), 4, b"\x02")


def garbage(r, keys):
    r.set(rkey(keys[BAD]), b"not a chunk value at all")


@pytest.mark.parametrize("corrupt, reason", [
    (flip_payload_byte, "checksum"),
    (copy_other_chunk, "key"),
    (truncate, "truncated"),          # shorter than its header says
    (flip_version_byte, "version"),   # checksum right, version unknown
    (flip_version_byte_only, "version"),  # (the trailer checksum fails too: version named first)
    (garbage, "header"),              # not a chunk value (bad magic)
])
def test_an_invalid_value_is_a_counted_deleted_miss(redis_server, corrupt, reason):
    a, b = make_store(redis_server.url), make_store(redis_server.url, promote_on_hit=False)
    try:
        keys, kvs = prompt(NS, 0, 4)
        assert a.put_chunks(NS, keys, kvs) == 4 and a.flush(5.0)
        with redis_server.client() as r:
            corrupt(r, keys)
        got = b.get_chunks(NS, keys)
        assert same(got, [kvs[0], None, kvs[2], kvs[3]])
        assert count(b.remote, "validation_failures") == 1
        assert count(b.remote, "validation_failures", reason) == 1
        assert sample(b, "kvstore_remote_validation_failures_total", {"reason": reason}) == 1.0
        assert (count(b.remote, "hits"), count(b.remote, "misses")) == (3, 1)
        assert b.flush(5.0)  # the delete is queued behind the writes
        with redis_server.client() as r:
            assert [r.exists(rkey(k)) for k in keys] == [1, 0, 1, 1]
        assert count(b.remote, "deleted") == 1
        # once deleted it is an ordinary miss, not counted again
        assert same(b.get_chunks(NS, keys[BAD:BAD + 1]), [None])
        assert count(b.remote, "validation_failures") == 1
        assert b.lookup_keys(NS, keys).num_hit_chunks == 1
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("other", [
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", chunk_size=4),
    KVLayout(num_layers=2, num_kv_heads=4, head_dim=4, dtype="float16", chunk_size=4),
])
def test_a_value_of_another_layout_under_a_key_is_a_layout_miss(redis_server, other):
    """The namespace id covers the layout, so this cannot happen by itself: the value of a
    NS chunk is written by hand under a key of namespace ``ns2`` (another layout), with that
    key in its header, so only the layout check can catch it."""
    ns2 = Namespace("remote-test-model", other)
    w = make_store(redis_server.url, ns=ns2)
    b = make_store(redis_server.url, ns=ns2, promote_on_hit=False)
    try:
        keys2 = ns2.chunk_keys(list(range(8)))
        good = torch.ones(other.shape(), dtype=other.torch_dtype)
        assert w.put_chunks(ns2, keys2[:1], [good]) == 1 and w.flush(5.0)
        _, kvs = prompt(NS, 0, 1)
        raw = kvs[0].reshape(-1).view(torch.uint8).numpy()
        value = pack_value(bytes(keys2[1]), bytes(keys2[0]), raw, "float16",
                           tuple(kvs[0].shape), "raw")
        with redis_server.client() as r:
            r.set(rkey(keys2[1]), value)
        got = b.get_chunks(ns2, keys2[:2])
        assert torch.equal(got[0], good) and got[1] is None
        assert count(b.remote, "validation_failures", "layout") == 1
        assert count(b.remote, "validation_failures") == 1
        assert b.flush(5.0)
        with redis_server.client() as r:
            assert [r.exists(rkey(k)) for k in keys2[:2]] == [1, 0]
    finally:
        w.close()
        b.close()

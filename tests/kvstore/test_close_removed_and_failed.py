"""What a close leaves on the disk tier when chunks were removed while pinned, and when the
pass that persists the memory tiers fails: a removed chunk never comes back at a restart, and
a failed pass still closes the tiers (the disk path is released, what was written is kept).
Real tiers (CPU arena, lmdb disk tier), reopened; layout and helpers of test_close_persist."""
import lmdb
import pytest
import torch

from kvstore.api import PrefixStore
from kvstore.tiers.memory import MemoryTier
from tests.kvstore.test_close_persist import (CHUNKS, LAY, NS, disk_of, kv, on_disk,
                                             reopen_disk_only, store, tokens)


def _parent_on_disk_child_in_memory(tmp_path):
    """A store whose prompt 0 has its first 2 chunks on disk, its last 2 in the CPU tier."""
    s = store(tmp_path, cpu=4)
    half = tokens(0)[:2 * LAY.chunk_size]
    PrefixStore(s, NS).put(half, kv(0)[:, :, :len(half)])
    PrefixStore(s, NS).put(tokens(1), kv(1))  # the CPU tier's 4 chunks: prompt 0's go to disk
    PrefixStore(s, NS).put(tokens(0), kv(0))  # its last 2 in the CPU tier
    assert on_disk(s, 0) == [True, True, False, False]
    return s


@pytest.mark.parametrize("persist_s", [0.0, 30.0])
def test_a_chunk_removed_while_pinned_does_not_come_back_after_a_restart(tmp_path, persist_s):
    s = _parent_on_disk_child_in_memory(tmp_path)
    keys = NS.chunk_keys(tokens(0))
    assert s.pin(NS, keys[:2]) == 2  # a reader still holds them (a lease, a borrow)
    assert s.remove(NS, keys[:2]) == 2
    assert PrefixStore(s, NS).lookup(tokens(0)).num_hit_chunks == 0
    s.close(persist_s=persist_s)
    r = reopen_disk_only(tmp_path)
    try:
        assert on_disk(r, 0) == [False] * CHUNKS  # nor their descendants (unreachable)
        assert PrefixStore(r, NS).lookup(tokens(0)).num_hit_chunks == 0
        if persist_s:  # (without, prompt 1's chunks that were in the CPU tier are lost)
            assert on_disk(r, 1) == [True] * CHUNKS
            assert r.stats()["unreachable_bytes"] == 0
    finally:
        r.close()


def test_a_persist_pass_that_fails_still_closes_the_store(tmp_path, monkeypatch, caplog):
    s = store(tmp_path, cpu=64)
    for i in range(3):
        PrefixStore(s, NS).put(tokens(i), kv(i))
    PrefixStore(s, NS).get(tokens(0), CHUNKS * LAY.chunk_size)  # the hottest: written first
    bad = NS.chunk_keys(tokens(0))[2]
    real = MemoryTier.read

    def read(self, key, *a, **kw):  # e.g. a device error while copying a chunk out
        if key == bad:
            raise RuntimeError("device error while reading a chunk")
        return real(self, key, *a, **kw)
    monkeypatch.setattr(MemoryTier, "read", read)
    with caplog.at_level("ERROR", logger="kvstore.store"):
        s.close(persist_s=30.0)
    assert any("persist" in r.getMessage() for r in caplog.records), caplog.records
    s.close()  # idempotent
    r = reopen_disk_only(tmp_path)  # the disk path was released
    try:
        assert on_disk(r, 0) == [True, True, False, False]  # a prefix: what came before
        assert not any(on_disk(r, 1)) and not any(on_disk(r, 2))  # (the pass ended there)
        assert r.stats()["unreachable_bytes"] == 0
        assert torch.equal(PrefixStore(r, NS).get(tokens(0)[:2 * LAY.chunk_size],
                                                  2 * LAY.chunk_size),
                           kv(0)[:, :, :2 * LAY.chunk_size])
    finally:
        r.close()


def test_a_disk_that_fails_every_write_is_reported_as_an_error_not_as_the_budget(tmp_path,
                                                                                 caplog):
    s = store(tmp_path, cpu=64)
    for i in range(5):
        PrefixStore(s, NS).put(tokens(i), kv(i))
    disk = disk_of(s)

    def write_batch(batch):  # what lmdb raises on a read-only or full file system
        raise lmdb.ReadonlyError("mdb_txn_begin: Permission denied")
    disk._write_batch = write_batch
    with caplog.at_level("INFO", logger="kvstore.store"):
        rep = s.persist_memory_tiers(30.0)
    assert rep.written_chunks == 0 and rep.seconds < 10.0
    assert (rep.left_error, rep.left_time, rep.left_room) == (5 * CHUNKS, 0, 0)
    line = [r.getMessage() for r in caplog.records if "persist on close" in r.getMessage()]
    assert "0 when the 30 s budget ran out" in line[0] and "20 on an error" in line[0], line
    assert disk.num_chunks == 0 and s.stats()["unreachable_bytes"] == 0
    s.close()

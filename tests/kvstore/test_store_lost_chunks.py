"""A chunk its tier loses on its own (a disk write that fails, a full disk, a corrupt chunk)
takes its stored descendants with it, as an eviction does: otherwise they fill the CPU tier
while no lookup can reach them (``unreachable_bytes``)."""
import logging

import lmdb
import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from kvstore.tiers.disk import DiskTier
from tests.kvstore.tmpfs_helpers import mounted_tmpfs

LAY = KVLayout(2, 2, 16, "float32", 64)  # 64-token chunks of 32 KiB
NS = Namespace("lost", LAY)
KEYS = NS.chunk_keys(list(range(64 * 48)))


def chunk(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(LAY.shape(), generator=g)


def settle(store: ChunkStore) -> None:
    """Wait for the disk writer, then make the store take in what its tiers lost."""
    store.flush(30)
    store.lookup_keys(NS, KEYS[:1])


def failing_disk_store(tmp_path, monkeypatch) -> ChunkStore:
    """A store of a 4-chunk CPU tier over a disk tier whose every write fails (EIO)."""
    def fail(self, batch):
        raise lmdb.Error("mdb_txn_commit: Input/output error")
    monkeypatch.setattr(DiskTier, "_write_batch", fail)
    return ChunkStore(StoreConfig(cpu_bytes=4 * LAY.chunk_bytes, disk_path=str(tmp_path / "d"),
                                  disk_bytes="8MiB"))


def test_a_failed_spill_takes_the_chunks_descendants_out_of_the_cpu_tier(tmp_path, monkeypatch,
                                                                         caplog):
    store = failing_disk_store(tmp_path, monkeypatch)
    try:
        with caplog.at_level(logging.WARNING):
            assert store.put_chunks(NS, KEYS[:8], [chunk(i) for i in range(8)]) == 8
            settle(store)
        st = store.stats()
        assert st["dropped_writes"] >= 4 and st["unreachable_bytes"] == 0
        # the spilled head (chunks 0-3) is lost, so 4-7 could never be reached: gone too
        assert store.exists(NS, KEYS[:8]) == [False] * 8
        assert st["stranded_removals"] == 4 and st["tiers"]["cpu"]["used_bytes"] == 0
        store.check_integrity()
        # the writer's failure is one line, not a traceback per batch
        fails = [r for r in caplog.records if "writing a batch" in r.getMessage()]
        assert fails and all(r.exc_info is None for r in fails)
        assert "Input/output error" in fails[0].getMessage()
        monkeypatch.undo()  # the disk works again: the store is usable
        assert store.put_chunks(NS, KEYS[:3], [chunk(i) for i in range(3)]) == 3
        assert store.lookup_keys(NS, KEYS[:3]).num_hit_chunks == 3
    finally:
        store.close()


def test_a_pinned_descendant_of_a_lost_chunk_goes_at_its_last_unpin(tmp_path, monkeypatch):
    store = failing_disk_store(tmp_path, monkeypatch)
    try:
        assert store.put_chunks(NS, KEYS[:4], [chunk(i) for i in range(4)]) == 4
        assert store.pin(NS, KEYS[3:4]) == 1
        assert store.put_chunks(NS, KEYS[4:6], [chunk(i) for i in range(4, 6)], parents=[
            KEYS[3], KEYS[4]]) == 2   # spills 0 and 1, whose writes fail
        settle(store)
        assert store.exists(NS, KEYS[:6]) == [False] * 6  # the pinned one no longer counts
        assert store.pin_count(KEYS[3]) == 1
        store.unpin(NS, KEYS[3:4])
        assert store.stats()["tiers"]["cpu"]["used_bytes"] == 0
        store.check_integrity()
    finally:
        store.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 512 KiB tmpfs (skips where this process may not mount one)."""
    with mounted_tmpfs(tmp_path, "512k") as where:
        yield where


def test_a_full_disk_strands_nothing_in_the_cpu_tier(small_tmpfs, caplog):
    """A real full disk (a 512 KiB tmpfs under an 8 MiB disk tier): spills fail with ENOSPC
    or an I/O error; what the store still holds is reachable, and lookups agree with gets."""
    store = ChunkStore(StoreConfig(cpu_bytes=4 * LAY.chunk_bytes,
                                   disk_path=str(small_tmpfs / "kv"), disk_bytes="8MiB"))
    try:
        with caplog.at_level(logging.WARNING):
            for start in range(0, 48, 4):
                store.put_chunks(NS, KEYS[start:start + 4],
                                 [chunk(i) for i in range(start, start + 4)],
                                 parents=[KEYS[start - 1] if start else None] +
                                 KEYS[start:start + 3])
            settle(store)
        st = store.stats()
        assert st["dropped_writes"] > 0  # the disk did fill
        assert st["unreachable_bytes"] == 0
        hit = store.lookup_keys(NS, KEYS).num_hit_chunks
        got = store.get_chunks(NS, KEYS[:hit])
        assert all(g is not None and torch.equal(g, chunk(i)) for i, g in enumerate(got))
        store.check_integrity()
        assert not any(r.exc_info for r in caplog.records if "disk tier" in r.getMessage())
    finally:
        store.close()


def test_a_restart_with_a_smaller_disk_says_what_it_evicted(tmp_path, caplog):
    path = str(tmp_path / "d")
    store = ChunkStore(StoreConfig(cpu_bytes=0, disk_path=path, disk_bytes="8MiB"))
    assert store.put_chunks(NS, KEYS[:6], [chunk(i) for i in range(6)]) == 6
    store.flush(30)
    store.close()
    with caplog.at_level(logging.WARNING):
        store = ChunkStore(StoreConfig(cpu_bytes=0, disk_path=path, allow_disk_shrink=True,
                                       disk_bytes=3 * LAY.chunk_bytes + 4096))
    try:
        kept = sum(store.exists(NS, KEYS[:6]))
        msgs = [r.getMessage() for r in caplog.records if "at open" in r.getMessage()]
        assert len(msgs) == 1 and f"evicted {6 - kept} chunks" in msgs[0], msgs
        assert f"capacity of {3 * LAY.chunk_bytes + 4096} bytes" in msgs[0]
        assert 0 < kept < 6
    finally:
        store.close()

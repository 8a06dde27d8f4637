"""The graceful-close persist pass when the disk tier has room for only part of the memory
tiers (``kvstore.close_persist``), and what becomes of disk chunks left unreachable by a restart.

- a chunk that does not fit is left out (with its descendants) and the pass goes on with the
  chunks that do fit (smaller ones: another namespace's), never evicting a disk chunk;
- a memory chunk whose child is on disk already is written before the others, so the chunks
  spilled to disk are reachable after the restart;
- after a restart, disk chunks whose parent is stored nowhere are kept (a recomputed parent
  makes them reachable again) but are the disk tier's first victims; not those whose parent
  the remote tier (a real Redis) holds.

Real tiers: CPU arena, lmdb disk tier on a tmp dir, reopened; Redis (``redis_server``).
"""
import pytest
import torch

from kvstore.api import PrefixStore
from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from tests.kvstore.test_close_persist import (CB, CHUNKS, LAY, NS, disk_of, kv, on_disk,
                                              reopen_disk_only, store, tokens)

#: a namespace whose chunks are 4x larger: 64 tokens per chunk -> 64 KiB
BIG_LAY = KVLayout(4, 2, 32, "float16", 64)
BIG_NS = Namespace("persist-on-close-big", BIG_LAY)
SLOT = CB + HEADER_BYTES_MAX  # the disk room one small chunk takes at most


def big_tokens(i: int) -> list[int]:
    return [7_000_000 + 1000 * i + j for j in range(2 * BIG_LAY.chunk_size)]


def big_kv(i: int) -> torch.Tensor:
    """Random KV of big prompt i: [4, 2, 128, 2, 32] fp16 (2 chunks)."""
    g = torch.Generator().manual_seed(500 + i)
    return torch.randn(BIG_LAY.shape(2 * BIG_LAY.chunk_size), generator=g).to(torch.float16)


def short_tokens(i: int, n: int) -> list[int]:
    """A prompt of ``n`` chunks, its tokens apart from ``tokens(i)``'s."""
    return [3_000_000 + 1000 * i + j for j in range(n * LAY.chunk_size)]


def short_kv(i: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(900 + i)
    return torch.randn(LAY.shape(n * LAY.chunk_size), generator=g).to(torch.float16)


def test_a_chunk_that_does_not_fit_is_skipped_and_smaller_ones_are_written(tmp_path, caplog):
    cap = 4 * SLOT  # room for 4 small chunks, never for a big one (64 KiB)
    s = store(tmp_path, cpu=64, disk=cap)
    s.register(BIG_NS)
    old = NS.chunk_keys(tokens(99))[:1]
    assert s.persist(NS, old, [kv(99)[:, :, :LAY.chunk_size]]) == 1  # on disk already
    for i in range(2):  # 8 small chunks
        PrefixStore(s, NS).put(tokens(i), kv(i))
    PrefixStore(s, BIG_NS).put(big_tokens(0), big_kv(0))  # 2 big chunks, the hottest
    PrefixStore(s, NS).get(tokens(0), CHUNKS * LAY.chunk_size)  # prompt 0 after them
    PrefixStore(s, BIG_NS).get(big_tokens(0), 2 * BIG_LAY.chunk_size)
    with caplog.at_level("INFO", logger="kvstore.store"):
        rep = s.persist_memory_tiers(30.0)
    # the big chain does not fit: left out; 3 of prompt 0's chunks fill the room left
    assert (rep.written_chunks, rep.left_room, rep.left_time, rep.left_error) == (3, 7, 0, 0)
    assert rep.reattached == 0
    line = [r.getMessage() for r in caplog.records if "persist on close" in r.getMessage()]
    assert len(line) == 1 and "left out 7" in line[0] and "7 with the disk tier full" in line[0]
    s.close()
    r = reopen_disk_only(tmp_path, disk=cap)
    try:
        r.register(BIG_NS)
        assert disk_of(r).contains(old[0])  # no disk chunk evicted for the pass
        assert on_disk(r, 0) == [True, True, True, False] and not any(on_disk(r, 1))
        assert PrefixStore(r, BIG_NS).lookup(big_tokens(0)).num_hit_chunks == 0
        assert r.stats()["unreachable_bytes"] == 0
        r.check_integrity()
        got = PrefixStore(r, NS).get(tokens(0), 3 * LAY.chunk_size)
        assert torch.equal(got, kv(0)[:, :, :3 * LAY.chunk_size])
    finally:
        r.close()


def spill_a_tail(s: ChunkStore) -> None:
    """Leave prompt A (``tokens(0)``)'s head (2 chunks) in the 8-chunk CPU tier and its tail
    (2 chunks) on disk only, with prompts B (``tokens(1)``, 4 chunks) and C (2 chunks) hotter
    than A's head in the CPU tier."""
    PrefixStore(s, NS).put(tokens(0), kv(0))
    PrefixStore(s, NS).put(tokens(1), kv(1))  # the CPU tier is full
    PrefixStore(s, NS).put(short_tokens(0, 2), short_kv(0, 2))  # A's tail spills (leaves first)
    PrefixStore(s, NS).get(tokens(1), CHUNKS * LAY.chunk_size)
    PrefixStore(s, NS).get(short_tokens(0, 2), 2 * LAY.chunk_size)
    cpu, disk = s.tiers[0], disk_of(s)
    a = NS.chunk_keys(tokens(0))
    assert [cpu.contains(k) for k in a] == [True, True, False, False]
    assert [disk.contains(k) for k in a] == [False, False, True, True]


def test_parents_of_disk_chunks_are_written_first(tmp_path):
    cap = 4 * SLOT  # A's tail, and room for 2 more
    s = store(tmp_path, cpu=8, disk=cap)
    spill_a_tail(s)
    rep = s.persist_memory_tiers(30.0)
    # A's head, which makes A's tail on disk reachable; B and C left out
    assert (rep.written_chunks, rep.left_room, rep.reattached) == (2, 6, 2)
    s.close()
    r = reopen_disk_only(tmp_path, disk=cap)
    try:
        assert r.stats()["unreachable_bytes"] == 0
        p = PrefixStore(r, NS)
        assert p.lookup(tokens(0)).tiers == ("disk",) * CHUNKS  # the chain found whole
        assert torch.equal(p.get(tokens(0), CHUNKS * LAY.chunk_size), kv(0))
        assert p.lookup(tokens(1)).num_hit_chunks == 0
        r.check_integrity()
    finally:
        r.close()


def unreachable_tail_and_roots(tmp_path, cap: int, roots: int) -> list:
    """A disk tier at ``tmp_path`` holding ``roots`` one-chunk prompts (reachable) and prompt
    A's tail (2 chunks) whose head lived only in the CPU tier of a store closed without
    persisting it. Returns the roots' keys."""
    s = store(tmp_path, cpu=8, disk=cap)
    spill_a_tail(s)
    keys = []
    for i in range(roots):
        k = NS.chunk_keys(short_tokens(10 + i, 1))
        assert s.persist(NS, k, [short_kv(10 + i, 1)]) == 1
        keys += k
    s.close()  # no persist: A's head is lost
    return keys


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "s3fifo", "arc"])
def test_unreachable_disk_chunks_are_the_first_victims_after_a_restart(tmp_path, policy):
    cap = 12 * SLOT
    roots = unreachable_tail_and_roots(tmp_path, cap, 10)
    cfg = StoreConfig(cpu_bytes=0, disk_bytes=cap, disk_path=str(tmp_path / "db"),
                      disk_policy=policy)
    r = ChunkStore(cfg, [NS])
    try:
        disk, tail = disk_of(r), NS.chunk_keys(tokens(0))[2:]
        assert all(disk.contains(k) for k in tail + roots)  # kept at open
        assert r.stats()["unreachable_bytes"] == sum(disk.nbytes_of(k) for k in tail) > 0
        # the disk tier is full: a new 2-chunk prompt evicts 2 chunks, the unreachable ones
        assert PrefixStore(r, NS).put(short_tokens(50, 2), short_kv(50, 2)) == 2
        assert [disk.contains(k) for k in tail] == [False, False]
        assert all(disk.contains(k) for k in roots)
        assert r.stats()["unreachable_bytes"] == 0
        r.check_integrity()
    finally:
        r.close()


def test_a_recomputed_parent_makes_unreachable_disk_chunks_reachable_again(tmp_path):
    cap = 16 * SLOT
    unreachable_tail_and_roots(tmp_path, cap, 2)
    r = reopen_disk_only(tmp_path, disk=cap)
    try:
        p = PrefixStore(r, NS)
        assert p.lookup(tokens(0)).num_hit_chunks == 0 and r.stats()["unreachable_bytes"] > 0
        assert p.put(tokens(0)[:2 * LAY.chunk_size], kv(0)[:, :, :2 * LAY.chunk_size]) == 2
        assert p.lookup(tokens(0)).num_hit_chunks == CHUNKS
        assert r.stats()["unreachable_bytes"] == 0
        assert torch.equal(p.get(tokens(0), CHUNKS * LAY.chunk_size), kv(0))
        # read again: no longer a first victim
        assert not any(disk_of(r).is_demoted(k) for k in NS.chunk_keys(tokens(0)))
    finally:
        r.close()


def test_with_a_remote_tier_a_disk_chunk_whose_parent_redis_holds_is_no_first_victim(
        tmp_path, redis_server):
    cap = 16 * SLOT
    s = store(tmp_path, cpu=8, disk=cap, remote_url=redis_server.url)
    spill_a_tail(s)  # every chunk is written behind to Redis too
    assert s.flush(10.0)
    s.close()
    cfg = StoreConfig(cpu_bytes=0, disk_bytes=cap, disk_path=str(tmp_path / "db"),
                      remote_url=redis_server.url, remote_timeout_s=10.0)  # (a loaded host)
    r = ChunkStore(cfg, [NS])
    try:
        tail = NS.chunk_keys(tokens(0))[2:]
        assert all(disk_of(r).contains(k) for k in tail)
        assert not any(disk_of(r).is_demoted(k) for k in tail)  # reachable through Redis
        assert PrefixStore(r, NS).lookup(tokens(0)).tiers == ("remote",) * 2 + ("disk",) * 2
    finally:
        r.close()


def test_a_shrink_at_open_evicts_the_unreachable_disk_chunks_first(tmp_path):
    roots = unreachable_tail_and_roots(tmp_path, 12 * SLOT, 10)
    cfg = StoreConfig(cpu_bytes=0, disk_bytes=10 * SLOT, disk_path=str(tmp_path / "db"),
                      allow_disk_shrink=True)  # 2 chunks too many
    r = ChunkStore(cfg, [NS])
    try:
        disk = disk_of(r)
        assert not any(disk.contains(k) for k in NS.chunk_keys(tokens(0)))
        assert all(disk.contains(k) for k in roots)
        assert r.stats()["unreachable_bytes"] == 0
        r.check_integrity()
    finally:
        r.close()

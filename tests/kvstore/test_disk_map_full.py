"""The disk tier's own eviction when lmdb's map is full (``DiskWriter._put_with_eviction``)
chooses and counts victims as the store's eviction does (``kvstore.movement.TierMover``):

- counted: ``evictions{disk}`` and, for a chunk no other tier holds, ``dropped_chunks``, so
  ``stored = resident + dropped + removed + stranded_removals`` holds after a map-full episode;
- chosen: no head evicted while its tail stays stored; a chunk demoted at open as unreachable
  whose parent is stored again is not taken first (``DiskTier.revive``), as in ``_pick``.

The lmdb map is made small (2-4 MiB) while the tier's capacity is large, so lmdb fills before
the store sees the tier as full: only the writer's own eviction makes room.
"""
from __future__ import annotations

import torch

import kvstore.tiers.disk as disk_mod
from kvstore.api import PrefixStore
from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore
from kvstore.tiers.disk import DiskTier

BIG = KVLayout(8, 4, 64, "float32", 16)  # 262144-byte chunks (random values: incompressible)
NS = Namespace("mapfull", BIG)
MAP = 2**21  # 2 MiB: about 6 such chunks


def _kv(seed: int, n_chunks: int) -> torch.Tensor:
    """[8, 2, 16 * n_chunks, 4, 64] float32 random KV."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 2, 16 * n_chunks, 4, 64, generator=g)


def _tokens(i: int, n_chunks: int) -> list[int]:
    return [1000 * (i + 1) + j for j in range(16 * n_chunks)]


def _identity(store: ChunkStore) -> tuple[int, int]:
    st = store.stats()
    return (st["stored_chunks"], st["num_resident_chunks"] + st["dropped_chunks"]
            + st["removed_chunks"] + st["stranded_removals"])


def test_map_full_eviction_counts_as_store_eviction(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod, "default_map_bytes", lambda capacity: MAP)
    cfg = StoreConfig(cpu_bytes=4 * BIG.chunk_bytes, disk_bytes=10**8,
                      disk_path=str(tmp_path / "db"), disk_codec="raw")
    store = ChunkStore(cfg, [NS])
    ps = PrefixStore(store, NS)
    disk = store.tiers[-1]
    try:
        for i in range(8):  # 8 prompts of 2 chunks (4 MiB) into a 2 MiB map
            assert ps.put(_tokens(i, 2), _kv(i, 2)) == 2
            assert disk.flush(30)
            stored, parts = _identity(store)
            assert stored == parts, (i, store.stats())
        st = store.stats()
        assert st["stored_chunks"] == 16
        assert st["dropped_writes"] == 0  # room was made by evicting, not by dropping writes
        assert st["evictions_by_tier"].get("disk", 0) > 0
        assert st["dropped_chunks"] == st["evictions_by_tier"]["disk"]  # the only tier
        assert st["num_resident_chunks"] == 16 - st["dropped_chunks"] >= 2
        assert st["stranded_removals"] == 0 and st["unreachable_bytes"] == 0
        for i in range(8):  # no head evicted while its tail stays: each prompt hits a prefix
            head, tail = ps.keys(_tokens(i, 2))
            assert not (disk.contains(tail) and not disk.contains(head)), i
            hit = ps.lookup(_tokens(i, 2)).num_hit_tokens
            assert hit == 16 * (disk.contains(head) + disk.contains(tail))
            if hit:
                got = ps.get(_tokens(i, 2), hit)
                assert torch.equal(got, _kv(i, 2)[:, :, :hit])
        assert ps.lookup(_tokens(7, 2)).num_hit_tokens == 32  # the newest prompt whole (LRU)
        store.check_integrity()
    finally:
        store.close()


def test_map_full_eviction_revives_a_reachable_demoted_chunk(tmp_path):
    """Chunks demoted at open as unreachable whose parent is stored again (``reachable``
    says so) go in their rank's turn, not first: the victims are the policy's oldest."""
    keys = Namespace("revive", BIG).chunk_keys(list(range(16 * 15)))
    data = {k: torch.randn(BIG.shape()) for k in keys}
    # reopening ranks the chunks in lmdb's key order: the orphans are the last two of the
    # first six, so an eviction that takes demoted chunks first takes them before the others
    first = sorted(keys[:6], key=bytes)
    plain, orphans = first[:4], first[4:]
    missing_parent = keys[-1]
    path = str(tmp_path / "db")
    t = DiskTier(path, capacity_bytes=10**8, map_bytes=3 * 2**20)  # 11 such chunks fit
    for k in first:
        t.put(k, data[k], missing_parent if k in orphans else None)
    assert t.flush(30)
    t.close()
    t = DiskTier(path, capacity_bytes=10**8, map_bytes=3 * 2**20)
    try:
        assert t.demote_unreachable()[0] == 2
        assert t.eviction_order()[:2] == orphans
        rank = list(t.policy._order())  # the policy's order without the demotions
        assert rank == first
        t.reachable = lambda k: True  # their parent was stored again (in another tier)
        evicted = []
        t.evicted = evicted.append
        gone = []
        for k in keys[6:14]:  # until the first map-full episode
            t.put(k, data[k], None)
            assert t.flush(30)
            gone = [k for k in first if not t.contains(k)]
            if gone:
                break
        assert 1 <= len(gone) <= 3, gone  # the map filled; fewer victims than plain chunks
        assert gone == plain[:len(gone)]  # the oldest, not the revived orphans
        assert all(t.contains(k) for k in orphans)
        assert evicted == gone  # each victim reported once, in order
        for k in keys[:14]:
            if t.contains(k):
                assert torch.equal(t.read(k), data[k])
        t.check_integrity()
    finally:
        t.close()

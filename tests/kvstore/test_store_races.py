"""Store-level races found while trying to break the daemon: a chunk removed while a get reads
it from the disk tier must stay removed (the hit's promotion must not bring it back), on both
read paths (``get_chunks`` and ``borrow_chunks().read_lower``). Tiny layout: 128-byte chunks,
a CPU tier of 2 chunks over a disk tier."""
import torch

from kvstore.config import StoreConfig
from kvstore.store import ChunkStore
from tests.kvstore.test_store_direct import CB, LAY, NS, kv

KEYS = NS.chunk_keys(list(range(4 * 4)))  # 4 chained keys


def spilled_store(tmp_path):
    """KEYS[0] and KEYS[1] spilled to disk, KEYS[2:4] in the CPU tier; promotion on hit."""
    s = ChunkStore(StoreConfig(cpu_bytes=2 * CB, page_bytes=CB, disk_bytes=64 << 20,
                               disk_path=str(tmp_path / "db"), promote_on_hit=True), [NS])
    s.put_chunks(NS, KEYS, [kv(i) for i in range(4)])
    assert s.flush(10)
    cpu, disk = s.tiers
    assert not cpu.contains(KEYS[0]) and disk.contains(KEYS[0])
    return s


def remove_during_disk_read(s, monkeypatch):
    disk = s.tiers[1]
    orig = disk.read

    def read(key, *a, **k):
        out = orig(key, *a, **k)
        assert s.remove(NS, [key]) == 1  # another client removes it mid-read (pinned: deferred)
        return out
    monkeypatch.setattr(disk, "read", read)


def test_get_chunks_of_a_chunk_removed_mid_read_returns_it_but_does_not_resurrect_it(
        tmp_path, monkeypatch):
    s = spilled_store(tmp_path)
    remove_during_disk_read(s, monkeypatch)
    (got,) = s.get_chunks(NS, KEYS[:1])
    assert torch.equal(got, kv(0))  # the read started before the removal: its bytes are whole
    assert s.exists(NS, KEYS[:1]) == [False]  # was [True]: promoted back into the CPU tier
    assert not s.tiers[0].contains(KEYS[0]) and not s.tiers[1].contains(KEYS[0])
    assert s.stats()["promotions"] == 0 and s.pin_count(KEYS[0]) == 0
    s.check_integrity()
    s.close()


def test_borrowed_read_lower_of_a_chunk_removed_mid_read_does_not_resurrect_it(
        tmp_path, monkeypatch):
    s = spilled_store(tmp_path)
    remove_during_disk_read(s, monkeypatch)
    with s.borrow_chunks(NS, KEYS[:1]) as b:
        assert b.lower == [0]
        b.read_lower()
        assert torch.equal(torch.cat(b.parts[0]).view(torch.float16).view(LAY.shape()), kv(0))
    assert s.exists(NS, KEYS[:1]) == [False]
    assert not s.tiers[0].contains(KEYS[0]) and not s.tiers[1].contains(KEYS[0])
    assert s.pin_count(KEYS[0]) == 0
    s.check_integrity()
    s.close()

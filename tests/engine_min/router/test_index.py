"""EngineIndex: snapshots and event batches -> the set of cached block hashes, the longest cached
prefix of a prompt, and resync on a gap, another epoch or a malformed batch (the index is left
unchanged then)."""
from __future__ import annotations

import pytest

from engine_min.block_hash import block_hashes
from engine_min.router.index import EngineIndex, ResyncNeeded

SEED = b"engine_min"
BS = 4
#: a prompt of 5 full blocks + 2 tokens, and another sharing its first 2 blocks
PROMPT = list(range(100, 122))
OTHER = PROMPT[:8] + [7, 7, 7, 7, 7, 7, 7, 7]
H = block_hashes(SEED, PROMPT, BS)      # 5 hashes
G = block_hashes(SEED, OTHER, BS)       # 4 hashes, G[:2] == H[:2]


def _snap(hashes, seq=0, epoch="e1"):
    return {"epoch": epoch, "seq": seq, "block_size": BS, "hash_seed": SEED.hex(),
            "medium": "GPU", "block_hashes": [h.hex() for h in hashes]}


def _stored(hashes, parent=None):
    return {"type": "BlockStored", "block_hashes": [h.hex() for h in hashes],
            "parent_block_hash": parent.hex() if parent else None,
            "token_ids": [0] * (BS * len(hashes)), "block_size": BS, "lora_id": None,
            "medium": "GPU"}


def _removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": [h.hex() for h in hashes], "medium": "GPU"}


def _answer(batches, epoch="e1"):
    return {"epoch": epoch, "latest_seq": batches[-1]["seq"] if batches else 0,
            "batches": batches}


def _batch(seq, *events):
    return {"seq": seq, "ts": 1.0, "events": list(events)}


def test_snapshot_then_batches_give_longest_prefix():
    assert G[:2] == H[:2] and G[2] != H[2]
    idx = EngineIndex()
    assert not idx.ready and idx.hit_blocks(H) == 0
    idx.load_snapshot(_snap(H[:2], seq=3))
    assert (idx.epoch, idx.seq, idx.block_size, idx.hash_seed) == ("e1", 3, BS, SEED)
    assert idx.hash_key == (SEED, BS)
    assert idx.hit_blocks(H) == 2 and idx.hit_blocks(G) == 2
    # batch 4: the rest of PROMPT is stored; batch 5: OTHER's third block; H[1] evicted
    n = idx.apply(_answer([_batch(4, _stored(H[2:], parent=H[1])),
                           _batch(5, _stored(G[2:3], parent=G[1]), _removed(H[1:2]))]))
    assert n == 2 and idx.seq == 5 and idx.num_blocks == 2 + 3 + 1 - 1
    assert idx.hit_blocks(H) == 1          # stops at the evicted H[1] though H[2:] are held
    assert idx.hit_blocks(G) == 1
    assert idx.hit_blocks(H[:1]) == 1 and idx.hit_blocks([]) == 0
    idx.check_integrity()
    # batches already applied are skipped; AllBlocksCleared empties the set
    cleared = {"type": "AllBlocksCleared"}
    assert idx.apply(_answer([_batch(5, _removed(H)), _batch(6, cleared)])) == 1
    assert idx.num_blocks == 0 and idx.seq == 6
    # an event type outside the contract is skipped
    assert idx.apply(_answer([_batch(7, {"type": "SomethingNew"}, _stored(H[:3]))])) == 1
    assert idx.hit_blocks(H) == 3
    idx.check_integrity()


def test_gap_epoch_and_malformed_batches_need_resync_and_change_nothing():
    idx = EngineIndex()
    idx.load_snapshot(_snap(H[:2], seq=10))
    before = set(idx.blocks)
    with pytest.raises(ResyncNeeded, match="gap: batch 12 after 10"):
        idx.apply(_answer([_batch(12, _stored(H[2:3]))]))
    # the gap is detected after a good batch: that one is not applied either
    with pytest.raises(ResyncNeeded, match="gap"):
        idx.apply(_answer([_batch(11, _stored(H[2:3])), _batch(13, _stored(H[3:4]))]))
    with pytest.raises(ResyncNeeded, match="epoch"):
        idx.apply(_answer([_batch(11, _stored(H[2:3]))], epoch="e2"))
    with pytest.raises(ResyncNeeded, match="malformed"):
        idx.apply(_answer([_batch(11, {"type": "BlockStored", "block_hashes": ["zz"]})]))
    with pytest.raises(ResyncNeeded, match="malformed"):
        idx.apply(_answer([{"seq": 11}]))
    assert idx.blocks == before and idx.seq == 10
    # resync: the snapshot of the restarted engine (new epoch, empty) replaces everything
    idx.load_snapshot(_snap([], seq=0, epoch="e2"))
    assert idx.epoch == "e2" and idx.num_blocks == 0 and idx.hit_blocks(H) == 0
    assert idx.apply(_answer([_batch(1, _stored(H[:1]))], epoch="e2")) == 1
    assert idx.hit_blocks(H) == 1
    idx.check_integrity()


def test_not_ready_and_bad_snapshots():
    idx = EngineIndex()
    with pytest.raises(ResyncNeeded, match="no snapshot"):
        idx.apply(_answer([_batch(1, _stored(H[:1]))]))
    for bad in ({**_snap(H), "hash_seed": "xyz"}, {**_snap(H), "block_size": 0},
                {k: v for k, v in _snap(H).items() if k != "epoch"},
                {**_snap(H), "block_hashes": "00"}, {**_snap(H), "seq": -1}):
        with pytest.raises(ValueError, match="malformed KV events snapshot"):
            idx.load_snapshot(bad)
        assert not idx.ready
    idx.load_snapshot(_snap(H, seq=4))
    idx.drop()
    assert not idx.ready and idx.num_blocks == 0 and idx.hit_blocks(H) == 0
    idx.check_integrity()

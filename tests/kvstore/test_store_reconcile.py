"""A store's counters reconcile: ``evictions{tier}`` counts each tier a chunk leaves (a
spilled or promoted chunk keeps a lower-tier copy), ``dropped_chunks`` the chunks evicted out
of every tier, ``removed_chunks`` those removed, and the ``resident_chunks`` gauge the distinct
chunks held, so that ``stored = resident + dropped + removed + stranded_removals`` after fills
that spill and drop, reads that promote, and removals (pinned ones included). The store-wide
gauges are in the Prometheus text."""
from __future__ import annotations

from kvstore.api import PrefixStore
from tests.kvstore.store_helpers import CB, NS, kv_for, make, prompt, put


def _sample(store, name: str) -> float:
    return store.metrics.registry.get_sample_value(name)


def _identity(store) -> tuple[int, int]:
    """``(stored, resident + dropped + removed + stranded)`` from the Prometheus registry,
    checked against ``stats()``."""
    st = store.stats()
    assert st["num_resident_chunks"] == _sample(store, "kvstore_resident_chunks")
    assert st["dropped_chunks"] == _sample(store, "kvstore_dropped_chunks_total")
    assert st["removed_chunks"] == _sample(store, "kvstore_removed_chunks_total")
    return (st["stored_chunks"], st["num_resident_chunks"] + st["dropped_chunks"]
            + st["removed_chunks"] + st["stranded_removals"])


def test_stored_is_resident_plus_dropped_plus_removed(tmp_path):
    store = make(tmp_path, cpu=4, disk=16 * CB)
    ps = PrefixStore(store, NS)
    try:
        for i in range(12):  # fills: the CPU tier spills to disk, the disk tier drops
            put(store, prompt(i, 3))
            stored, parts = _identity(store)
            assert stored == parts, (i, store.stats())
        st = store.stats()
        assert st["evictions_by_tier"]["cpu"] > 0 and st["spills_by_tier"]["cpu"] > 0
        assert st["dropped_chunks"] > 0  # some left every tier
        # per-tier evictions exceed the chunks that left the store: spilled ones stayed
        assert st["evictions"] > st["dropped_chunks"]
        held = [i for i in range(12) if ps.lookup(prompt(i, 3)).num_hit_tokens == 12]
        assert held
        for i in held:  # reads from disk promote to the CPU tier (the disk copy stays),
            got = ps.get(prompt(i, 3), 12)  # evicting others: a prompt may be gone by now
            assert got is None or bool((got == kv_for(prompt(i, 3))).all())
            assert _identity(store)[0] == _identity(store)[1]
        assert store.stats()["promotions"] > 0
        held = [i for i in range(12) if ps.lookup(prompt(i, 3)).num_hit_tokens == 12]
        assert _identity(store)[0] == _identity(store)[1]
        keys = ps.keys(prompt(held[0], 3))
        assert store.pin(NS, keys[:1]) == 1
        assert store.remove(NS, keys) == 3  # the pinned one leaves at its unpin
        stored, parts = _identity(store)
        assert stored == parts
        assert store.stats()["removed_chunks"] == 3
        assert store.unpin(NS, keys[:1]) == 1
        assert _identity(store)[0] == _identity(store)[1]
        n = store.stats()["num_resident_chunks"]
        assert store.clear(NS) == n
        assert _identity(store) == (store.stats()["stored_chunks"],) * 2
        assert store.stats()["num_resident_chunks"] == 0
    finally:
        store.close()


def test_store_wide_gauges_are_exported(tmp_path):
    store = make(tmp_path, cpu=8)
    try:
        put(store, prompt(0, 2))
        keys = PrefixStore(store, NS).keys(prompt(0, 2))
        store.pin(NS, keys[:1])
        text = store.metrics.exposition().decode()
        assert "kvstore_resident_chunks 2.0" in text
        assert "kvstore_pinned_chunks 1.0" in text
        assert "kvstore_namespaces 1.0" in text
        assert "kvstore_unreachable_bytes 0.0" in text
        assert "kvstore_dropped_chunks_total 0.0" in text
        assert "kvstore_removed_chunks_total 0.0" in text
    finally:
        store.close()

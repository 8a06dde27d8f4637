"""Which tiers the store's chunk counters and ``resident_chunks`` gauge cover when a remote
(Redis) tier is configured: the local tiers only (README "Store metrics"). A chunk evicted out
of every local tier counts in ``dropped_chunks`` though Redis still serves it; a chunk copied
from Redis into the top tier (``promotions{tier="remote"}``) is resident without being in
``stored_chunks``; removing a chunk held only in Redis does not count in ``removed_chunks``. So
``stored + promotions{remote} = resident + dropped + removed + stranded``."""
from __future__ import annotations

from tests.kvstore.remote_helpers import NS, make_store, prompt, same


def _counts(store) -> dict:
    st = store.stats()
    return {"stored": st["stored_chunks"], "resident": st["num_resident_chunks"],
            "dropped": st["dropped_chunks"], "removed": st["removed_chunks"],
            "stranded": st["stranded_removals"],
            "promoted_remote": st["promotions_by_tier"].get("remote", 0)}


def _balanced(c: dict) -> bool:
    return (c["stored"] + c["promoted_remote"]
            == c["resident"] + c["dropped"] + c["removed"] + c["stranded"])


def test_the_chunk_counters_cover_the_local_tiers_only(redis_server):
    a = make_store(redis_server.url, cpu_chunks=4)
    b = make_store(redis_server.url)
    try:
        prompts = [prompt(NS, i, 2) for i in range(4)]
        for keys, kvs in prompts:
            assert a.put_chunks(NS, keys, kvs) == 2
        assert a.flush(5.0)
        c = _counts(a)
        assert c == {"stored": 8, "resident": 4, "dropped": 4, "removed": 0, "stranded": 0,
                     "promoted_remote": 0}
        # "dropped" left the local tiers, not the store's reach: Redis serves them
        keys0, kvs0 = prompts[0]
        assert a.lookup_keys(NS, keys0).num_hit_chunks == 2
        assert a.lookup_keys(NS, keys0).tiers == ("remote", "remote")
        assert same(a.get_chunks(NS, keys0), kvs0)  # copied into the CPU tier, 2 others out
        c = _counts(a)
        assert c["promoted_remote"] == 2 and c["resident"] == 4 and c["dropped"] == 6
        assert c["stored"] == 8 and _balanced(c)
        # a chunk another store put is resident here after a read, never stored here
        keys9, kvs9 = prompt(NS, 9, 1)
        assert b.put_chunks(NS, keys9, kvs9) == 1 and b.flush(5.0)
        assert same(a.get_chunks(NS, keys9), kvs9)
        c = _counts(a)
        assert c["stored"] == 8 and c["promoted_remote"] == 3 and _balanced(c)
        # removing chunks held only in Redis removes them there, not counted in removed
        keys1 = prompts[1][0]
        local = [k for k in keys1 if any(t.contains(k) for t in a.tiers)]
        assert local == []
        assert a.remove(NS, keys1) == 2
        assert a.lookup_keys(NS, keys1).num_hit_chunks == 0
        c = _counts(a)
        assert c["removed"] == 0 and _balanced(c)
    finally:
        a.close()
        b.close()

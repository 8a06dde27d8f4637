"""ARC: T1/T2 order, the target moved by ghost hits, ghost bounds, and selection by name in
the store and the daemon's settings."""
import pytest

from kvstore.api import PrefixStore
from kvstore.daemon import config as serve_config
from kvstore.eviction import ARCPolicy, create_policy
from tests.kvstore.store_helpers import NS, kv_for, make, prompt


def _insert(p, *keys):
    for k in keys:
        p.on_insert(k, 10)
        p.check_integrity()


def _evict(p):
    v = p.next_victim()
    p.on_remove(v)
    p.check_integrity()
    return v


def test_ghost_hits_move_the_target_between_recency_and_frequency():
    p = create_policy("arc")
    assert isinstance(p, ARCPolicy)
    _insert(p, "a", "b", "c")
    p.on_access("a")  # a: T1 -> T2
    assert (list(p._t1), list(p._t2), p.p) == (["b", "c"], ["a"], 0.0)
    assert _evict(p) == "b"  # T1 holds more than its target (0 bytes): its LRU goes
    assert list(p._b1) == ["b"]
    _insert(p, "b")  # remembered by B1: T1 was too small, the target grows by one chunk
    assert (p.p, list(p._t2), list(p._b1)) == (10.0, ["a", "b"], [])
    # T1 (c, 10 bytes) is not over its target: T2's LRU goes first, where LRU would take c
    assert list(p._order()) == ["a", "b", "c"]
    assert _evict(p) == "a"
    assert list(p._b2) == ["a"]
    _insert(p, "a")  # remembered by B2: T2 was too small, the target shrinks back to 0
    assert (p.p, list(p._t2)) == (0.0, ["b", "a"])
    assert _evict(p) == "c"


def test_ghosts_stay_within_the_tracked_count():
    p = create_policy("arc")
    _insert(p, *[f"k{i}" for i in range(4)])
    for i in range(4, 40):  # a scan through a 4-key tier
        _evict(p)
        _insert(p, f"k{i}")
        assert len(p._t1) + len(p._b1) <= 4 and len(p._b1) + len(p._b2) <= 4
    assert len(p) == 4


def test_arc_tails_before_heads():
    p = create_policy("arc")
    p.on_insert("h", 10)
    p.on_insert("t", 10, parent="h")
    p.on_insert("x", 10)
    p.on_access("x")
    # order T1 = [h, t]: h is older but has a stored child, so t goes first
    assert _evict(p) == "t" and _evict(p) == "h" and _evict(p) == "x"


def test_store_runs_on_arc(tmp_path):
    store = make(cpu=3, cpu_policy="arc")
    ps = PrefixStore(store, NS)
    for i in range(5):  # one-chunk prompts through a 3-chunk CPU tier
        toks = prompt(i)
        assert ps.put(toks, kv_for(toks)) == 1
    assert [ps.lookup(prompt(i)).num_hit_tokens for i in range(5)] == [0, 0, 4, 4, 4]
    store.check_integrity()


def test_daemon_settings_take_arc():
    cfg = serve_config.resolve({"policy": "arc"}, {})
    assert cfg.store_config_kwargs()["cpu_policy"] == "arc"
    with pytest.raises(ValueError, match="'arcc'"):
        serve_config.resolve({"policy": "arcc"}, {})

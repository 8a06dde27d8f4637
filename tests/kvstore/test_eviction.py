"""Eviction policies: exact victim order, prefix awareness, the registry."""
import pytest

from kvstore.eviction import POLICIES, create_policy


def _victims(policy, n, can_evict=lambda k: True):
    out = []
    for _ in range(n):
        v = policy.next_victim(can_evict)
        out.append(v)
        if v is not None:
            policy.on_remove(v)
        policy.check_integrity()
    return out


def _fill(name, keys, accesses=()):
    p = create_policy(name)
    for k in keys:
        p.on_insert(k, 10)
    for k in accesses:
        p.on_access(k)
    p.check_integrity()
    return p


def test_registry():
    assert sorted(POLICIES) == ["arc", "fifo", "lfu", "lru", "s3fifo"]
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; choose one of"):
        create_policy("mru")
    p = create_policy("lru")
    p.on_insert("a", 1)
    with pytest.raises(KeyError):
        p.on_insert("a", 1)


def test_lru_order():
    p = _fill("lru", "abcd", accesses="ab")
    assert _victims(p, 5) == ["c", "d", "a", "b", None]


def test_fifo_ignores_access():
    p = _fill("fifo", "abcd", accesses="ab")
    assert _victims(p, 4) == ["a", "b", "c", "d"]


def test_lfu_order_ties_least_recent():
    p = _fill("lfu", "abcd", accesses="aabdd")
    # freqs: a=3, b=2, c=1, d=3 (d used after a)
    assert p.frequency("a") == 3 and p.frequency("c") == 1
    assert _victims(p, 4) == ["c", "b", "a", "d"]


def test_s3fifo_is_scan_resistant_where_lru_is_not():
    # 'hot' is read twice, then a scan of 20 one-time keys flows through a 10-key cache.
    for name, hot_survives in (("s3fifo", True), ("lru", False)):
        p = create_policy(name)
        p.on_insert("hot", 10)
        p.on_access("hot")
        p.on_access("hot")
        for i in range(20):
            if len(p) == 10:
                p.on_remove(p.next_victim())
            p.on_insert(f"scan{i}", 10)
            p.check_integrity()
        assert ("hot" in p) is hot_survives, name


def test_s3fifo_ghost_readmits_to_main():
    p = _fill("s3fifo", ["a"] + [f"x{i}" for i in range(9)])
    assert p.next_victim() == "a"  # small queue, never read
    p.on_remove("a")
    p.on_insert("a", 10)  # remembered by the ghost queue: straight to main
    assert "a" in p._main
    p.check_integrity()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_prefix_aware_tails_before_heads(name):
    p = create_policy(name)
    p.on_insert("A", 10)            # chain A <- B <- C (inserted in put order)
    p.on_insert("B", 10, "A")
    p.on_insert("C", 10, "B")
    p.on_insert("X", 10)            # an unrelated single chunk, newest
    # every policy would take A first; prefix awareness takes the tail C, then B, then A
    assert _victims(p, 4) == ["C", "B", "A", "X"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pins_respected_and_fallback_to_a_head(name):
    p = create_policy(name)
    p.on_insert("A", 10)
    p.on_insert("B", 10, "A")
    # B is pinned: A has a stored child, but it is the only candidate left
    assert p.next_victim(lambda k: k != "B") == "A"
    assert p.next_victim(lambda k: False) is None

"""Every policy (LRU, FIFO, LFU, and S3-FIFO and ARC with a heap per queue) picks a victim
with no stored child from heaps of leaves, not a scan: the victims must be exactly those of the scan (first evictable key in policy order
with no stored child, else the first evictable key), whatever the mix of inserts, accesses,
removals, refusals and children arriving before their parent."""
import random

import pytest

from kvstore.eviction import POLICIES, create_policy


def scan_victim(policy, can_evict):
    """The victim as the policy contract defines it, by a scan of ``_order``."""
    order = list(policy._order())
    for key in order:
        if not policy._children.get(key) and can_evict(key):
            return key
    return next((k for k in order if can_evict(k)), None)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_heap_victims_equal_the_scan_over_4000_random_events(name):
    rng = random.Random(7)
    p = create_policy(name)
    assert p.ranked
    tracked, checked, by_heap = [], 0, 0
    for step in range(4000):
        op = rng.random()
        if op < 0.45 or not tracked:
            key = step
            parent = rng.choice(tracked + [None, step + 1]) if tracked else None  # step + 1: a
            p.on_insert(key, 10, parent)  # child recorded before its parent is inserted
            tracked.append(key)
        elif op < 0.7:
            p.on_access(rng.choice(tracked))
        elif op < 0.8:
            key = tracked.pop(rng.randrange(len(tracked)))
            p.on_remove(key)
        else:
            refused = set(rng.sample(tracked, min(len(tracked), rng.randrange(4))))
            can = lambda k, r=refused: k not in r  # noqa: E731
            want = scan_victim(p, can)
            assert p.next_victim(can) == want
            checked += 1
            by_heap += want is not None and not p._children.get(want)
            if want is not None and rng.random() < 0.7:
                p.on_remove(want)
                tracked.remove(want)
        if step % 97 == 0:
            p.check_integrity()
    p.check_integrity()
    assert checked > 700 and by_heap > 600  # most victims came from the heap


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_chain_in_one_tier_gives_its_tail_and_the_heap_stays_bounded(name):
    p = create_policy(name)
    for i in range(2000):
        p.on_insert(i, 10, i - 1 if i else None)
    assert p.next_victim() == 1999  # the only key with no stored child
    assert p.next_victim(lambda k: k != 1999) == 0  # then the oldest key with a child
    assert p.next_victim(lambda k: k != 1999, leaves_only=True) is None
    for i in range(1999, 999, -1):  # evict tail first: each parent becomes a leaf in turn
        assert p.next_victim() == i
        p.on_remove(i)
    assert len(p) == 1000
    for _ in range(5000):  # accesses push new heap entries; stale ones are dropped
        p.on_access(999)
    assert sum(len(h) for h in p._heaps) <= 2 * len(p) + 65
    p.check_integrity()

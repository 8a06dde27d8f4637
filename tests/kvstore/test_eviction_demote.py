"""Demotion in every eviction policy (LRU, LFU, FIFO, S3-FIFO, ARC): a demoted key with no
stored child is the next victim before any other key, oldest demotion first, whatever the
policy's own order; a demoted key with stored children waits for them; a read lifts the
demotion; a removal forgets it. Exact victims on hand-made sequences, then the heap-based
choice against a scan of the contract over random events."""
import random

import pytest

from kvstore.eviction import POLICIES, create_policy

NAMES = sorted(POLICIES)


def fresh(name, keys=("a", "b", "c", "d")):
    """A policy holding ``keys`` (10 bytes each, no parents), inserted in order."""
    p = create_policy(name)
    for k in keys:
        p.on_insert(k, 10)
    return p


@pytest.mark.parametrize("name", NAMES)
def test_a_demoted_leaf_goes_first_even_if_most_recently_used(name):
    p = fresh(name)
    natural = p.next_victim()
    p.on_access("d")                      # d: the newest and just read (last in LRU order)
    p.on_access("d")                      # (twice: LFU ranks it highest, S3-FIFO/ARC promote it)
    assert p.next_victim() != "d"
    assert p.demote("d") is True
    assert p.is_demoted("d") and p.num_demoted == 1
    assert p.next_victim() == "d"
    p.check_integrity()
    p.on_remove("d")
    assert not p.is_demoted("d") and p.num_demoted == 0    # remove forgets it
    assert p.next_victim() == natural
    p.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_demoted_leaves_go_oldest_demotion_first_and_respect_can_evict(name):
    p = fresh(name)
    assert p.demote("c") and p.demote("a") and p.demote("c")  # c again keeps its first place
    assert p.next_victim() == "c"
    assert p.next_victim(lambda k: k != "c") == "a"           # c pinned: the next demoted one
    assert p.next_victim(lambda k: k not in ("a", "c")) not in ("a", "c")
    assert p.demote("zz") is False                            # untracked: ignored
    p.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_a_demoted_parent_waits_for_its_children(name):
    p = create_policy(name)
    p.on_insert("p0", 10)               # piece 0
    p.on_insert("p1", 10, "p0")         # piece 1 (child of piece 0)
    p.on_insert("x", 10)                # another prompt's chunk
    p.demote("p0")
    assert p.next_victim() != "p0"      # p0 has a stored child: a leaf goes first
    assert p.next_victim(leaves_only=True) in ("p1", "x")
    p.demote("p1")
    assert p.next_victim() == "p1"      # the demoted leaf
    p.on_remove("p1")
    assert p.next_victim() == "p0"      # now a leaf, demoted before x
    p.check_integrity()
    # with only children-holding keys refused otherwise, the demoted parent is the second
    # choice before the policy's own order
    q = create_policy(name)
    q.on_insert("r", 10)
    q.on_insert("s", 10)
    q.on_insert("r1", 10, "r")
    q.on_insert("s1", 10, "s")
    q.demote("s")
    assert q.next_victim(lambda k: k in ("r", "s")) == "s"
    q.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_a_read_lifts_the_demotion(name):
    p = fresh(name)
    natural = p.next_victim()
    p.demote(natural)
    other = next(k for k in "abcd" if k != natural)
    p.demote(other)
    assert p.next_victim() == natural
    p.on_access(natural)                # it proved useful: back in the policy's order
    assert not p.is_demoted(natural) and p.is_demoted(other)
    assert p.next_victim() == other
    p.check_integrity()


@pytest.mark.parametrize("name", NAMES)
def test_a_demoted_parent_whose_child_comes_and_goes_twice_is_found_once_a_leaf(name):
    p = create_policy(name)
    p.on_insert("p", 10)
    p.on_insert("y", 10)
    p.demote("p")
    for _ in range(2):
        p.on_insert("k", 10, "p")
        assert p.next_victim(lambda k: k != "k") == "y"
        p.on_remove("k")
        assert p.next_victim() == "p"
        p.check_integrity()


def scan_victim(p, can_evict):
    """The victim as the contract defines it, by scans: demoted leaves (oldest demotion
    first), then leaves in policy order, then demoted keys, then keys in policy order."""
    order = list(p._order())
    demoted = sorted(p._demoted, key=p._demoted.__getitem__)
    for keys in (demoted, order):
        for k in keys:
            if not p._children.get(k) and can_evict(k):
                return k
    return next((k for k in demoted + order if can_evict(k)), None)


@pytest.mark.parametrize("name", NAMES)
def test_victims_equal_the_scan_over_3000_random_events_with_demotions(name):
    rng = random.Random(11)
    p = create_policy(name)
    tracked, checked, demoted_victims = [], 0, 0
    for step in range(3000):
        op = rng.random()
        if op < 0.4 or not tracked:
            parent = rng.choice(tracked + [None]) if tracked else None
            p.on_insert(step, 10, parent)
            tracked.append(step)
        elif op < 0.55:
            p.on_access(rng.choice(tracked))
        elif op < 0.7:
            p.demote(rng.choice(tracked))
        elif op < 0.78:
            key = tracked.pop(rng.randrange(len(tracked)))
            p.on_remove(key)
        else:
            refused = set(rng.sample(tracked, min(len(tracked), rng.randrange(3))))
            can = lambda k, r=refused: k not in r  # noqa: E731
            want = scan_victim(p, can)
            assert p.next_victim(can) == want
            checked += 1
            demoted_victims += want is not None and p.is_demoted(want)
            if want is not None and rng.random() < 0.7:
                p.on_remove(want)
                tracked.remove(want)
        if step % 101 == 0:
            p.check_integrity()
    p.check_integrity()
    assert checked > 500 and demoted_victims > 100

"""The batched calls (``on_access_many``, ``on_insert_chain``, ``evict_until``) make exactly
the decisions of the per-event calls they stand for: two instances of each policy get the same
random event sequence, one batched and one event by event, and must name the same victims in
the same order (exact lists) and keep the same order of keys throughout."""
import random

import pytest

from kvstore.eviction import POLICIES, create_policy


def per_event_evict(policy, nbytes, can_evict, leaves_only):
    """What ``evict_until`` stands for: ``next_victim`` then ``on_remove`` until enough."""
    victims, freed = [], 0
    while freed < nbytes:
        v = policy.next_victim(can_evict, leaves_only)
        if v is None:
            break
        freed += policy._nbytes[v]
        policy.on_remove(v)
        victims.append(v)
    return victims


def per_event_chain(policy, keys, sizes, parent):
    for k, n in zip(keys, sizes):
        policy.on_insert(k, n, parent)
        parent = k


def random_events(seed, steps):
    """A random sequence of batched events over integer keys (sizes 1..30 bytes)."""
    rng = random.Random(seed)
    tracked: list[int] = []
    next_key = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.35 or not tracked:
            n = rng.randint(1, 12)
            keys = list(range(next_key, next_key + n))
            next_key += n
            parent = rng.choice(tracked + [None, next_key + 3])  # (next_key + 3: a parent
            sizes = [rng.randint(1, 30) for _ in keys]  # inserted after its child)
            tracked.extend(keys)
            yield "chain", (keys, sizes, parent)
        elif op < 0.6:
            keys = rng.sample(tracked, min(len(tracked), rng.randint(1, 8))) + [-1]  # -1: unknown
            yield "access", (keys,)
        elif op < 0.85:
            refused = set(rng.sample(tracked, min(len(tracked), rng.randrange(3))))
            yield "evict", (rng.randint(0, 120), refused, rng.random() < 0.5)
        elif op < 0.93:
            yield "demote", (rng.choice(tracked),)
        else:
            key = rng.choice(tracked)
            yield "remove", (key,)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_batched_calls_name_the_same_victims_as_per_event_calls(name):
    batched, single = create_policy(name), create_policy(name)
    num_victims = 0
    for step, (op, args) in enumerate(random_events(seed=11, steps=3000)):
        if op == "chain":
            batched.on_insert_chain(*args)
            per_event_chain(single, *args)
        elif op == "access":
            batched.on_access_many(args[0])
            for k in args[0]:
                single.on_access(k)
        elif op == "evict":
            nbytes, refused, leaves_only = args
            can = lambda k, r=refused: k not in r  # noqa: E731
            got = batched.evict_until(nbytes, can, leaves_only)
            want = per_event_evict(single, nbytes, can, leaves_only)
            assert got == want, f"step {step}: {got} != {want}"
            num_victims += len(got)
        elif op == "demote":
            assert batched.demote(args[0]) == single.demote(args[0])
        else:
            batched.on_remove(args[0])
            single.on_remove(args[0])
        assert list(batched._order()) == list(single._order()), f"step {step}"
        if step % 101 == 0:
            batched.check_integrity()
    batched.check_integrity()
    single.check_integrity()
    assert batched.keys() == single.keys()
    assert num_victims > 1000  # the evictions did real work


@pytest.mark.parametrize("name", sorted(n for n, cls in POLICIES.items()
                                        if cls.victims_ignore_inserts))
def test_room_for_a_whole_chain_first_equals_room_before_each_key(name):
    # A tier may evict for a whole chain of new keys, then insert it at once, when the
    # policy's victims ignore inserts: the victims are those of evicting before each key
    # (sparing the key's parent, as a prefix store must).
    rng = random.Random(3)
    whole, each = create_policy(name), create_policy(name)
    stored, next_key = [], 0
    for _ in range(400):
        n = rng.randint(1, 10)
        keys = list(range(next_key, next_key + n))
        next_key += n
        sizes = [rng.randint(1, 20) for _ in keys]
        parent = rng.choice(stored) if stored and rng.random() < 0.7 else None
        if stored and rng.random() < 0.5:
            whole.on_access_many(stored[-3:])
            each.on_access_many(stored[-3:])
        budget = 300
        got = whole.evict_until(whole.tracked_bytes + sum(sizes) - budget,
                                lambda k, p=parent: k != p, True)
        whole.on_insert_chain(keys, sizes, parent)
        want = []
        for k, size in zip(keys, sizes):
            want += each.evict_until(each.tracked_bytes + size - budget,
                                     lambda v, p=parent: v != p, True)
            each.on_insert(k, size, parent)
            parent = k
        assert got == want
        assert list(whole._order()) == list(each._order())
        stored = sorted(whole.keys())
    whole.check_integrity()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_bad_chain_is_refused_whole(name):
    p = create_policy(name)
    p.on_insert_chain([1, 2, 3], [10, 10, 10])
    with pytest.raises(KeyError):
        p.on_insert_chain([4, 5, 2], [1, 1, 1], 3)  # 2 is tracked
    with pytest.raises(KeyError):
        p.on_insert_chain([6, 7, 6], [1, 1, 1], 3)  # 6 twice
    with pytest.raises(ValueError):
        p.on_insert_chain([8, 9], [1], 3)
    assert p.keys() == {1, 2, 3} and p.tracked_bytes == 30
    assert p.children(1) == {2} and p.children(2) == {3} and not p.has_children(3)
    assert p.next_victim() == 3  # the chain's only leaf
    assert p.evict_until(15) == [3, 2]
    assert p.evict_until(0) == [] and p.keys() == {1}
    p.check_integrity()

"""S3-FIFO's and ARC's ``on_request`` run their hooks inline; they must make the per-event
calls' decisions. Two instances of each get the same prompts of a replayed prefix cache: a
prompt's stored head is read, and its missing keys (new ones, or keys evicted earlier, so
that the ghost lists are hit) are stored, once through ``on_request`` and once event by event
(``on_access`` per hit, then per key ``evict_until`` sparing its parent and ``on_insert``).
The victims (exact lists), the keys stored, the order, the queues, the ghosts, S3-FIFO's
frequencies and ARC's target ``p`` must agree after every prompt."""
import random

import pytest

from kvstore.eviction import create_policy
from tests.kvstore.test_eviction_leaf_first import _admission, per_event_request


def replayed_prompts(seed, steps, num_roots=12):
    """Prompts over a fixed random prefix tree, re-asked often (so evicted keys come back):
    each a path from a root, 1..12 keys; sizes 1..40 per key, fixed per key."""
    rng = random.Random(seed)
    paths: list[list[int]] = [[k] for k in range(num_roots)]
    size = {k: rng.randint(1, 40) for k in range(num_roots)}
    next_key = num_roots
    for _ in range(steps):
        base = rng.choice(paths)
        if rng.random() < 0.4 and len(base) < 12:  # a new turn: the path grows
            grown = base + list(range(next_key, next_key + rng.randint(1, 3)))
            for k in grown[len(base):]:
                size[k] = rng.randint(1, 40)
            next_key = grown[-1] + 1
            paths.append(grown)
            base = grown
        yield base[:rng.randint(1, len(base))] if rng.random() < 0.3 else base, size


def _state(policy):
    """Everything the policy's later decisions depend on, as plain values."""
    if policy.name == "s3fifo":
        own = (list(policy._small), list(policy._main), list(policy._ghost),
               sorted(policy._freq.items()), policy._small_bytes, policy._total_bytes)
    else:
        own = (list(policy._t1), list(policy._t2), list(policy._b1), list(policy._b2),
               policy.p, policy._t1_bytes, policy._total_bytes)
    return own, list(policy._order()), dict(policy._ranks)


@pytest.mark.parametrize("admission", [False, True])
@pytest.mark.parametrize("budget", [50, 150, 600])
@pytest.mark.parametrize("name", ["s3fifo", "arc"])
def test_inline_requests_match_per_event_calls_with_keys_coming_back(name, budget, admission):
    fast, slow = create_policy(name), create_policy(name)
    asked_fast, asked_slow = [], []  # with a filter: the same questions, same verdicts
    admit_fast = _admission(asked_fast) if admission else None
    admit_slow = _admission(asked_slow) if admission else None
    num_victims = num_back = 0
    moved = 0  # prompts after which S3-FIFO's M held keys, or ARC's target p was above 0
    evicted: set = set()
    for step, (prompt, size) in enumerate(replayed_prompts(seed=11, steps=3000)):
        hits = []
        for k in prompt:
            if k not in fast:
                break
            hits.append(k)
        new = prompt[len(hits):]
        sizes = [size[k] for k in new]
        num_back += sum(1 for k in new if k in evicted)
        got = fast.on_request(hits, new, sizes, budget - fast.tracked_bytes, admit_fast)
        want_victims, want_stored = per_event_request(slow, hits, new, sizes,
                                                      budget - slow.tracked_bytes, admit_slow)
        assert asked_fast == asked_slow, f"step {step}"
        assert got.victims == want_victims, f"step {step}"
        assert got.num_stored == want_stored, f"step {step}"
        assert got.freed_bytes == sum(size[k] for k in got.victims)
        assert _state(fast) == _state(slow), f"step {step}"
        assert fast.tracked_bytes <= budget
        evicted.update(got.victims)
        num_victims += len(got.victims)
        moved += bool(fast._main) if name == "s3fifo" else fast.p > 0
        if step % 101 == 0:
            fast.check_integrity()
    fast.check_integrity()
    slow.check_integrity()
    # real work: evictions, evicted keys coming back, and M holding keys (read in S, or
    # remembered by the ghost) or ARC's target moving, for a good share of the prompts
    assert num_victims > 1000 // (1 + admission) and num_back > 500 and moved > 300
    if admission:  # the filter was asked often and said no often
        assert len(asked_fast) > 300
        assert sum(1 for k, v, _ in asked_fast if (7 * k + 13 * v) % 3 == 0) > 100


@pytest.mark.parametrize("name", ["s3fifo", "arc"])
def test_a_request_whose_only_leaf_is_its_parent_stores_nothing(name):
    # one stored chain 1 2 3; a request reading all of it and adding 4 with no room: the only
    # leaf is 3, the parent of 4, which is spared, so nothing goes and nothing is stored
    p = create_policy(name)
    p.on_request([], [1, 2, 3], [10, 10, 10], 30)
    got = p.on_request([1, 2, 3], [4], [10], 0)
    assert got.victims == [] and got.num_stored == 0 and p.keys() == {1, 2, 3}
    got = p.on_request([1], [5], [10], 0)  # 3 goes (tail first), 5 stored under 1
    assert got.victims == [3] and got.num_stored == 1 and p.keys() == {1, 2, 5}
    p.check_integrity()

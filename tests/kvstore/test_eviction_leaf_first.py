"""``on_request`` makes the per-event calls' decisions. LRU, FIFO and LFU serve it from a
leaf-first index (victims popped from the front of an ordered dict, no heap); every policy is
driven through random prefix trees twice, once request by request and once event by event
(``on_access`` per stored key, head first, then per new key ``evict_until`` sparing its
parent and ``on_insert``), and must name the same victims in the same order (exact lists),
store the same keys and keep the same order."""
import random

import pytest

from kvstore.eviction import POLICIES, create_policy


def per_event_request(policy, hits, keys, sizes, free, admit=None):
    """What ``on_request`` stands for, through the per-event calls."""
    for k in hits:
        policy.on_access(k)
    parent = hits[-1] if hits else None
    victims, stored = [], 0
    for k, n in zip(keys, sizes):
        if n > free:
            if admit is not None:
                victim = policy.next_victim(lambda v, p=parent: v != p, True)
                if victim is None or not admit(k, victim, len(policy)):
                    break
            before = policy.tracked_bytes
            victims += policy.evict_until(n - free, lambda v, p=parent: v != p, True)
            free += before - policy.tracked_bytes
            if n > free:
                break
        policy.on_insert(k, n, parent)
        free -= n
        stored += 1
        parent = k
    return victims, stored


def random_requests(seed, steps, max_new=8):
    """Requests over a random prefix tree: the stored head of an earlier prompt (any prefix
    of it, often all of it, sometimes nothing new after it), then new keys; sizes 1..40."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    next_key = 0
    for _ in range(steps):
        if prompts and rng.random() < 0.8:
            base = rng.choice(prompts)
            head = base[:rng.randint(1, len(base))] if rng.random() < 0.7 else base
        else:
            head = []
        n = rng.choice((0, 1, 2, 3, max_new)) if head else rng.randint(1, max_new)
        new = list(range(next_key, next_key + n))
        next_key += n
        sizes = [rng.randint(1, 40) for _ in new]
        prompts.append(head + new)
        yield head, new, sizes


def _stored_head(policy, prompt):
    """The leading keys of ``prompt`` the policy tracks (what a prefix lookup hits)."""
    out = []
    for k in prompt:
        if k not in policy:
            break
        out.append(k)
    return out


def _admission(log):
    """A deterministic admission verdict that refuses about a third of the inserts, logging
    what it was asked."""
    def admit(key, victim, num_keys):
        log.append((key, victim, num_keys))
        return (key * 7 + victim * 13) % 3 != 0
    return admit


@pytest.mark.parametrize("admission", [False, True])
@pytest.mark.parametrize("budget", [60, 400])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_requests_name_the_same_victims_as_per_event_calls(name, budget, admission):
    fast, slow = create_policy(name), create_policy(name)
    asked_fast, asked_slow = [], []
    admit_fast = _admission(asked_fast) if admission else None
    admit_slow = _admission(asked_slow) if admission else None
    used = {"fast": 0, "slow": 0}
    num_victims = 0
    for step, (head, new, sizes) in enumerate(random_requests(seed=7, steps=2500)):
        hits = _stored_head(fast, head)
        assert hits == _stored_head(slow, head)
        if len(hits) < len(head):  # the prompt's head is partly gone: store from there
            new, sizes = [], []
        got = fast.on_request(hits, new, sizes, budget - used["fast"], admit_fast)
        want_victims, want_stored = per_event_request(slow, hits, new, sizes,
                                                      budget - used["slow"], admit_slow)
        assert asked_fast == asked_slow, f"step {step}"
        assert got.victims == want_victims, f"step {step}"
        assert got.num_stored == want_stored, f"step {step}"
        used["fast"] += sum(sizes[:got.num_stored]) - got.freed_bytes
        used["slow"] = slow.tracked_bytes
        assert used["fast"] == fast.tracked_bytes == used["slow"] <= budget
        assert list(fast._order()) == list(slow._order()), f"step {step}"
        num_victims += len(got.victims)
        if step % 97 == 0:
            fast.check_integrity()
    fast.check_integrity()
    slow.check_integrity()
    assert fast.keys() == slow.keys()
    assert num_victims > (300 if budget > 100 else 1000) // (1 + admission)  # real work
    if admission:  # the filter was asked often and said no often
        assert len(asked_fast) > 300
        assert sum(1 for k, v, _ in asked_fast if (7 * k + 13 * v) % 3 == 0) > 60
    if name in ("lru", "fifo", "lfu"):
        assert fast._leaf_first is not None  # served by the index all along


@pytest.mark.parametrize("name", ["lru", "fifo", "lfu"])
def test_the_index_is_left_for_the_heaps_on_any_other_event(name):
    # after any per-event call the policy keeps heaps again, with the same order and victims
    for leave in ("access", "insert", "remove", "next_victim", "children", "demote"):
        a, b = create_policy(name), create_policy(name)
        for p in (a, b):
            p.on_request([], [1, 2, 3], [10, 10, 10], 100)
            p.on_request([1], [4, 5], [10, 10], 70)
            p.on_request([1, 2], [], [], 50)
        assert a._leaf_first is not None
        if leave == "access":
            a.on_access(4)
        elif leave == "insert":
            a.on_insert(9, 5, 5)
        elif leave == "remove":
            a.on_remove(3)
        elif leave == "next_victim":
            assert a.next_victim() == 3  # the oldest leaf (LRU: 5 was stored later)
        elif leave == "children":
            assert a.children(1) == {2, 4}
        else:
            assert a.demote(2)
        assert a._leaf_first is None
        a.check_integrity()
        if leave in ("next_victim", "children"):  # queries: nothing else changed
            assert list(a._order()) == list(b._order()) and a.next_victim() == b.next_victim()


def test_lru_index_evicts_tail_first_and_keeps_a_reread_prefix():
    # prompt A = 1 2 3, prompt B = 1 4 (shares head 1); A's head 1 2 read again; then a new
    # prompt needs 3 chunks of room: the least recently used leaves go, each tail first
    p = create_policy("lru")
    p.on_request([], [1, 2, 3], [10, 10, 10], 60)
    p.on_request([1], [4], [10], 30)
    p.on_request([1, 2], [], [], 20)
    assert list(p._leaf_first) == [3, 4, 2, 1]  # every key after its children
    assert list(p._order()) == [3, 4, 1, 2]  # LRU order (ranks): 1 and 2 read last
    got = p.on_request([], [7, 8, 9], [10, 10, 10], 20)
    assert got.victims == [3] and got.num_stored == 3 and got.freed_bytes == 10
    assert list(p._leaf_first) == [4, 2, 1, 9, 8, 7]
    got = p.on_request([], [11], [30], 0)  # 4, then A's reread head, tail first
    assert got.victims == [4, 2, 1] and got.num_stored == 1
    p.check_integrity()


def test_fifo_index_moves_a_reread_head_only_when_it_gets_a_child():
    # FIFO's reads change nothing: prompt A = 1 2 read again stays before the younger 5,
    # and goes first, tail first; a request's parent is spared even when nothing fits
    p = create_policy("fifo")
    p.on_request([], [1, 2], [10, 10], 100)
    p.on_request([], [5], [10], 80)
    p.on_request([1, 2], [], [], 70)
    assert list(p._leaf_first) == [2, 1, 5]
    got = p.on_request([], [9], [20], 0)
    assert got.victims == [2, 1] and got.num_stored == 1 and got.freed_bytes == 20
    got = p.on_request([5], [6], [30], 0)  # 9 goes, 5 is spared, 6 still does not fit
    assert got.victims == [9] and got.num_stored == 0 and p.keys() == {5}
    p.on_request([5], [6], [10], 20)  # 5 gets a child: placed after it
    assert list(p._leaf_first) == [6, 5]
    p.check_integrity()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_bad_request_changes_nothing(name):
    p = create_policy(name)
    p.on_request([], [1, 2, 3], [10, 10, 10], 30)
    before = (list(p._order()), p.keys())
    with pytest.raises(KeyError):
        p.on_request([1], [4, 4], [1, 1], 0)  # 4 twice
    with pytest.raises(KeyError):
        p.on_request([1], [5, 2], [1, 1], 0)  # 2 is tracked
    with pytest.raises(ValueError):
        p.on_request([1], [6, 7], [1], 0)
    assert (list(p._order()), p.keys()) == before
    p.check_integrity()


@pytest.mark.parametrize("name", ["lru", "fifo", "lfu"])
def test_a_request_whose_head_is_not_a_root_chain_takes_the_general_path(name):
    # the index relies on each request's stored head being a chain from a root; a head
    # starting mid-chain is served by the heaps instead, with the per-event decisions
    fast, slow = create_policy(name), create_policy(name)
    for p in (fast, slow):
        p.on_request([], [1, 2, 3], [10, 10, 10], 40)
    assert fast.on_request([2, 3], [4], [10], 10).victims == []
    assert fast._leaf_first is None
    per_event_request(slow, [2, 3], [4], [10], 10)
    assert list(fast._order()) == list(slow._order())
    assert fast.on_request([], [5], [20], 0).victims == \
        per_event_request(slow, [], [5], [20], 0)[0]
    fast.check_integrity()


@pytest.mark.parametrize("name", ["lru", "fifo", "lfu"])
def test_integrity_check_catches_a_child_placed_after_its_parent(name):
    p = create_policy(name)
    p.on_request([], [1, 2, 3], [10, 10, 10], 100)
    p.on_request([], [4], [10], 70)
    p.check_integrity()
    index = p._buckets[1] if name == "lfu" else p._leaf_first
    index.move_to_end(3)  # 3 (the leaf of 1 2 3) after its parent 2
    with pytest.raises(AssertionError, match="before a child|rank order"):
        p.check_integrity()


@pytest.mark.parametrize("name", ["lru", "fifo", "lfu"])
def test_a_request_over_budget_with_nothing_new_evicts_as_the_per_event_calls(name):
    # a tier over its budget (free bytes < 0) with a fully stored prompt: the general path
    # evicts leaves other than the prompt's last key
    fast, slow = create_policy(name), create_policy(name)
    for p in (fast, slow):
        p.on_request([], [1, 2], [10, 10], 40)
        p.on_request([], [3], [10], 20)
    got = fast.on_request([1, 2], [], [], -5)
    slow.on_access_many([1, 2])
    assert got.victims == slow.evict_until(5, lambda v: v != 2, True) == [3]
    assert got.freed_bytes == 10 and list(fast._order()) == list(slow._order())
    fast.check_integrity()


def test_lfu_index_evicts_the_least_used_leaf_tail_first():
    # prompt A = 1 2 3 read twice more (1 2 3 used 3 times), B = 1 4 (4 once, 1 once more),
    # C = 7 8 (once each): C goes first, tail first, then B's tail, then A's, tail first
    p = create_policy("lfu")
    p.on_request([], [1, 2, 3], [10, 10, 10], 200)
    p.on_request([1, 2, 3], [], [], 170)
    p.on_request([1, 2, 3], [], [], 170)
    p.on_request([1], [4], [10], 170)
    p.on_request([], [7, 8], [10, 10], 160)
    assert [p.frequency(k) for k in (1, 2, 3, 4, 7, 8)] == [4, 3, 3, 1, 1, 1]
    assert list(p._buckets[1]) == [4, 8, 7] and list(p._buckets[3]) == [3, 2]
    got = p.on_request([], [9], [50], 140 - 140)
    assert got.victims == [4, 8, 7, 3, 2] and got.num_stored == 1
    p.check_integrity()

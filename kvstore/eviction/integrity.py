"""``EvictionPolicy.check_integrity``: the policy's indexes checked against each other (the
size, parent, child, rank and queue dicts, the order, the leaf heaps or the leaf-first index,
the demotions). O(n log n); for tests and debugging."""
from __future__ import annotations

from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from kvstore.eviction.base import EvictionPolicy

_ABSENT = object()


def check_policy(policy: EvictionPolicy) -> None:
    """Raise ``AssertionError`` if ``policy``'s indexes disagree with each other."""
    name, sizes, ranks, queue = policy.name, policy._nbytes, policy._ranks, policy._queue
    ordered = list(policy._order())
    assert len(ordered) == len(set(ordered)) == len(sizes), \
        f"{name}: order has {len(ordered)} keys, tracking {len(sizes)}"
    assert set(ordered) == set(sizes), f"{name}: order and index disagree"
    for parent, kids in policy._children.items():
        assert kids, f"{name}: empty child set kept for {parent!r}"
        for kid in kids:
            assert policy._parent.get(kid) == parent, f"{name}: child index stale for {kid!r}"
    assert set(ranks) == set(sizes), f"{name}: ranks and index disagree"
    pos = {q: i for i, q in enumerate(policy._queues())}
    assert sorted(pos) == list(range(policy.num_queues)), f"{name}: queues {list(pos)}"
    by_rank = sorted(sizes, key=lambda k: (pos[queue.get(k, 0)], ranks[k]))
    assert by_rank == ordered, f"{name}: ranks do not order the keys as the policy does"
    leaves = {k for k in sizes if not policy._children.get(k)}
    if policy._leaf_first is not None:
        policy._index_ops.check_index(policy)
    else:
        live = {k for q, h in enumerate(policy._heaps) for r, k in h
                if ranks.get(k, _ABSENT) == r and queue.get(k, 0) == q}
        assert leaves <= live, f"{name}: {len(leaves - live)} leaves missing from the heaps"
        assert policy._heap_entries == sum(len(h) for h in policy._heaps), \
            f"{name}: heap entry count drifted"
    demoted = policy._demoted
    assert set(demoted) <= set(sizes), f"{name}: untracked key demoted"
    live_demoted = {k for s, k in policy._demoted_heap if demoted.get(k) == s}
    assert {k for k in demoted if k in leaves} <= live_demoted, \
        f"{name}: a demoted leaf is missing from the demoted heap"

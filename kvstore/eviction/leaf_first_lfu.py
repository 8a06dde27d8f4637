"""LFU's leaf-first index: victims popped from the front of the lowest frequency bucket.

The LRU/FIFO argument (``leaf_first``) per frequency bucket. While every event comes through
``on_request`` and each request's stored head is a chain from a root, LFU keeps its buckets
(frequency -> ``OrderedDict`` of keys) in leaf-first order: a request removes its stored head
from the buckets (each read raises a key's frequency by one), evicts, appends its new keys
to bucket 1 last to first and puts its stored head in the buckets of their new frequencies,
last to first. A key's frequency is never below a child's (every request reading the child
reads the key), and equals it only when both were stored by one request and read by the same
requests since, so both entered every bucket by the same request, the child first: in each
bucket every key comes after its children there, the lowest bucket's first key is a leaf, and
of one request's keys in a bucket (one chain) only the lowest can be a leaf, so the bucket's
leaves stand in rank order (frequency, then the request that raised it there).

Ranks (``frequency << 40 | clock``) are kept as the per-event calls set them; the frequency
dict and the child sets are not, and are rebuilt when the policy leaves the index (``leave``).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import accumulate, islice, repeat, takewhile
from typing import TYPE_CHECKING, Hashable, Sequence

from kvstore.eviction import leaf_first
from kvstore.eviction.batched import Admit, Request

if TYPE_CHECKING:
    from kvstore.eviction.lfu import LFUPolicy

Key = Hashable
_ONE = 1 << 40  # frequency 1, clock 0


def request(policy: LFUPolicy, hits: Sequence[Key], keys: Sequence[Key],
            nbytes: Sequence[int], free_bytes: int, admit: Admit | None = None) -> Request | None:
    """``EvictionPolicy.on_request`` through LFU's leaf-first buckets; None (nothing
    changed) as ``leaf_first.request``.

    Raises:
        ValueError, KeyError: as ``on_request`` (nothing changed).
    """
    buckets, ranks, sizes, parents = policy._buckets, policy._ranks, policy._nbytes, policy._parent
    if not leaf_first.servable(policy, hits, keys, nbytes, free_bytes):
        return None
    nh = len(hits)
    if nh:
        first = leaf_first._tick(policy, nh)
        hit_ranks = []
        for i, key in enumerate(hits):  # read head first: one more use each
            f = ranks[key] >> 40
            bucket = buckets[f]
            del bucket[key]
            if not bucket:
                del buckets[f]
            hit_ranks.append((f + 1) << 40 | (first + i))
        ranks.update(zip(hits, hit_ranks))

    def evict(need: int) -> tuple[list[Key], int]:  # the lowest buckets' first keys
        victims: list[Key] = []
        freed = 0
        while freed < need and buckets:
            f = min(buckets)
            bucket = buckets[f]
            rest = need - freed
            n = len(list(takewhile(rest.__gt__, accumulate(map(sizes.__getitem__, bucket)))))
            some = list(islice(bucket, n + 1))
            deque(map(bucket.__delitem__, some), 0)
            if not bucket:
                del buckets[f]
            freed += sum(map(sizes.pop, some))
            victims += some
        deque(map(parents.__delitem__, victims), 0)
        deque(map(ranks.__delitem__, victims), 0)
        return victims, freed

    def evict_each(need: int) -> tuple[list[Key], int]:  # the same, a key at a time
        victims: list[Key] = []  # (with a filter: usually one victim per call)
        freed = 0
        while freed < need and buckets:
            f = min(buckets)
            bucket = buckets[f]
            pop_first = bucket.popitem
            while freed < need and bucket:
                key = pop_first(False)[0]
                freed += sizes.pop(key)
                del parents[key]
                del ranks[key]
                victims.append(key)
            if not bucket:
                del buckets[f]
        return victims, freed

    def first_victim() -> Key | None:
        return next(iter(buckets[min(buckets)])) if buckets else None

    victims, freed, stored = leaf_first.make_room(keys, nbytes, free_bytes,
                                                  evict if admit is None else evict_each,
                                                  first_victim, len(sizes), admit)
    if stored:
        chain = keys[:stored] if stored < len(keys) else keys
        sizes.update(zip(chain, nbytes))
        parents[chain[0]] = hits[-1] if nh else None
        parents.update(zip(chain[1:], chain))
        first = leaf_first._tick(policy, stored)
        ranks.update(zip(chain, range(_ONE + first, _ONE + first + stored)))
        bucket = buckets.get(1)
        if bucket is None:
            bucket = buckets[1] = OrderedDict()
        bucket.update(zip(reversed(chain), repeat(None)))
    for key in reversed(hits):
        f = ranks[key] >> 40
        bucket = buckets.get(f)
        if bucket is None:
            bucket = buckets[f] = OrderedDict()
        bucket[key] = None
    return Request(victims, stored, freed)


def leave(policy: LFUPolicy) -> None:
    """Rebuild the frequency dict, the buckets in rank order and the child sets."""
    ranks = policy._ranks
    policy._freq = {k: r >> 40 for k, r in ranks.items()}
    buckets: dict[int, OrderedDict] = {}
    for key in sorted(ranks, key=ranks.__getitem__):
        f = ranks[key] >> 40
        bucket = buckets.get(f)
        if bucket is None:
            bucket = buckets[f] = OrderedDict()
        bucket[key] = None
    policy._buckets = buckets
    leaf_first.rebuild_children(policy)


def check_index(policy: LFUPolicy) -> None:
    """Raise ``AssertionError`` unless the buckets are a leaf-first index (see the module
    docstring), closed under parent, with no frequency dict, child sets or demotions kept."""
    name, sizes, ranks = policy.name, policy._nbytes, policy._ranks
    assert policy._leaf_first is policy._buckets and not policy._freq \
        and not policy._children and not policy._demoted, f"{name}: stale LFU indexes kept"
    children = leaf_first.children_of(policy)
    in_buckets = 0
    for f, bucket in policy._buckets.items():
        assert bucket, f"{name}: empty bucket {f}"
        seen: set = set()
        for key in bucket:
            assert ranks[key] >> 40 == f, f"{name}: {key!r} in bucket {f}"
            assert all(c in seen or ranks[c] >> 40 < f for c in children.get(key, ())), \
                f"{name}: {key!r} comes before a child in bucket {f}"
            assert all(ranks[c] >> 40 <= f for c in children.get(key, ())), \
                f"{name}: a child of {key!r} is used more often than it"
            seen.add(key)
        leaves = [k for k in bucket if k not in children]
        assert leaves == sorted(leaves, key=ranks.__getitem__), \
            f"{name}: bucket {f}'s leaves are not in rank order"
        in_buckets += len(bucket)
    assert in_buckets == len(sizes) == len(ranks), f"{name}: buckets and tracked keys disagree"

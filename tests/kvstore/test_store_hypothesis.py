"""Property test: random op sequences on a 3-tier store against a simple model.

The model knows the KV each prompt should have, the explicit pins, and which keys were
removed. After every step: ``check_integrity()``; every returned chunk is bit-exact; pinned
keys are never evicted; pin counts match; no tier exceeds its capacity.
"""
import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.config import StoreConfig
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAY = KVLayout(1, 1, 4, "float16", 2)  # 32-byte chunks
NS = Namespace("prop", LAY)
PROMPTS = st.integers(0, 5)
LENGTHS = st.integers(1, 3)


def tokens(i, n):
    return [100 * i + j for j in range(2 * n)]


def kv_of(toks):
    t = torch.tensor(toks, dtype=torch.float16).view(1, 1, -1, 1, 1)  # [1, 1, T, 1, 1]
    return t + torch.arange(8, dtype=torch.float16).view(1, 2, 1, 1, 4) / 8  # [1, 2, T, 1, 4]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp()
        cfg = StoreConfig(gpu_bytes=2 * 64, cpu_bytes=3 * 64, disk_bytes=5 * (32 + 146),
                          disk_path=self.dir, page_bytes=64, cpu_policy="s3fifo")
        self.store = ChunkStore(cfg, [NS])
        self.pins: dict = {}      # key -> explicit pins the model expects
        self.removed: set = set()  # keys removed (maybe still pinned, then invisible)

    def keys(self, i, n):
        return NS.chunk_keys(tokens(i, n))

    @rule(i=PROMPTS, n=LENGTHS)
    def put(self, i, n):
        toks = tokens(i, n)
        stored = self.store.put_chunks(NS, self.keys(i, n), [kv_of(toks[2 * c:2 * c + 2]) for c in range(n)])
        assert 0 <= stored <= n
        self.removed -= set(self.keys(i, n))

    @rule(i=PROMPTS, n=LENGTHS)
    def get(self, i, n):
        toks = tokens(i, n)
        for c, got in enumerate(self.store.get_chunks(NS, self.keys(i, n))):
            if got is not None:
                assert torch.equal(got, kv_of(toks[2 * c:2 * c + 2]))

    @rule(i=PROMPTS, n=LENGTHS)
    def lookup(self, i, n):
        keys = self.keys(i, n)
        r = self.store.lookup_keys(NS, keys)
        present = self.store.exists(NS, keys)
        assert present[:r.num_hit_chunks] == [True] * r.num_hit_chunks
        assert r.num_hit_chunks == n or not present[r.num_hit_chunks]

    @rule(i=PROMPTS, n=LENGTHS)
    def remove(self, i, n):
        keys = self.keys(i, n)
        expect = sum(self.store.exists(NS, keys))
        assert self.store.remove(NS, keys) == expect
        self.removed |= set(keys)

    @rule(i=PROMPTS, n=LENGTHS)
    def pin(self, i, n):
        keys = self.keys(i, n)
        present = self.store.exists(NS, keys)
        assert self.store.pin(NS, keys) == sum(present)
        for k, p in zip(keys, present):
            if p:
                self.pins[k] = self.pins.get(k, 0) + 1

    @rule(i=PROMPTS, n=LENGTHS)
    def unpin(self, i, n):
        keys = self.keys(i, n)
        expect = sum(1 for k in keys if self.pins.get(k))
        assert self.store.unpin(NS, keys) == expect
        for k in keys:
            if self.pins.get(k):
                self.pins[k] -= 1

    @rule()
    def clear(self):
        self.store.clear()
        self.removed |= {k for i in range(6) for k in self.keys(i, 3)}

    @invariant()
    def consistent(self):
        self.store.check_integrity()
        for k, n in self.pins.items():
            assert self.store.pin_count(k) == n
            if n and k not in self.removed:
                assert self.store.exists(NS, [k]) == [True], "a pinned chunk was evicted"
        for t in self.store.stats()["tiers"].values():
            assert 0 <= t["used_bytes"] <= t["capacity_bytes"]

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestStoreMachine = StoreMachine.TestCase

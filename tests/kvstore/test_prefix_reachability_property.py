"""Property test: random puts (in random call splits), gets, lookups, removes, pins, flushes and
restarts over prompts drawn from a random prefix tree, on small stores of one to three tiers
(so every put evicts, spills and promotes), with reachability recounted by brute force after
every step:

* puts go through ``put_chunks`` or, as the daemon's, through page reservations;
* every stored chunk records its true parent in every tier that holds it, whatever call
  stored it, and after a restart (the disk header);
* ``unreachable_bytes`` equals the bytes of the stored chunks whose ancestors are not all
  stored (recounted from the true parents, not the store's records);
* no step other than a remove or a restart (which loses the memory tiers) strands a chunk
  that was reachable before it: eviction never leaves a stored chunk without its parent;
* lookups agree with presence, gets are bit-exact, ``check_integrity`` holds.
"""
import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.api import chain_parents
from kvstore.codec import HEADER_BYTES_MAX
from kvstore.config import StoreConfig
from kvstore.direct import Reservation
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.store import ChunkStore

LAY = KVLayout(1, 1, 4, "float32", 4)  # 128-byte chunks
NS = Namespace("reach-prop", LAY)
CHUNK = 128
SLOT = CHUNK + HEADER_BYTES_MAX
#: (gpu chunks, cpu chunks, disk chunks); 0 = no such tier
CONFIGS = [(0, 4, 0), (0, 0, 4), (0, 2, 3), (2, 2, 3), (0, 3, 5)]
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=6)  # a path in a 3-ary tree
SPLITS = st.lists(st.integers(1, 3), min_size=1, max_size=6)


def tokens(path):
    return [10 * label + j for label in path for j in range(4)]


def calls(keys, split):
    """A prompt's keys cut into put calls of ``split`` sizes (the rest in a last call): yields
    (keys of the call, their true parents: the first one's is the key before the call)."""
    i = 0
    for size in split + [len(keys)]:
        part = keys[i:i + size]
        if not part:
            return
        yield part, chain_parents(part, keys[i - 1] if i else None)
        i += size


def value(key):
    return torch.full(LAY.shape(), float(int.from_bytes(key.prefix_hash[:2], "little")))


class ReachabilityMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.store = None
        self.parent: dict = {}  # every key ever put -> its true parent
        self.stranded: set = set()  # unreachable stored keys after the last step
        self.may_strand = False

    @initialize(cfg=st.sampled_from(CONFIGS), policy=st.sampled_from(["lru", "lfu", "s3fifo"]))
    def open(self, cfg, policy):
        self.cfg, self.policy = cfg, policy
        self._open()

    def _open(self):
        gpu, cpu, disk = self.cfg
        self.store = ChunkStore(StoreConfig(
            gpu_bytes=gpu * CHUNK, cpu_bytes=cpu * CHUNK, disk_bytes=disk * SLOT,
            disk_path=self.dir if disk else None, page_bytes=CHUNK, gpu_policy=self.policy,
            cpu_policy=self.policy, disk_policy=self.policy), [NS])

    def teardown(self):
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def keys(self, path):
        keys = NS.chunk_keys(tokens(path))
        for i, k in enumerate(keys):
            self.parent[k] = keys[i - 1] if i else None
        return keys

    # ---- steps --------------------------------------------------------------------------------
    @rule(path=PROMPTS, split=SPLITS)
    def put(self, path, split):
        for part, parents in calls(self.keys(path), split):
            n = self.store.put_chunks(NS, part, [value(k) for k in part], parents)
            assert 0 <= n <= len(part)

    @rule(path=PROMPTS, split=SPLITS)
    def put_direct(self, path, split):
        """As the daemon puts: reserve each chunk's pages just before its bytes arrive (one
        key at a time), fill them, commit the batch (no room: a tensor for a lower tier, or
        dropped)."""
        for part, parents in calls(self.keys(path), split):
            items = []
            for k, p in zip(part, parents):
                (item,) = self.store.reserve_chunks(NS, [k], [p])
                if isinstance(item, Reservation):
                    src = value(k).reshape(-1).view(torch.uint8)
                    pos = 0
                    for v in item.views:
                        v.copy_(src[pos:pos + v.numel()])
                        pos += v.numel()
                elif item is None and self.store.has_lower_tiers:
                    item = value(k)
                items.append(item)
            self.store.commit_chunks(NS, part, items, parents)

    @rule(path=PROMPTS)
    def get(self, path):
        keys = self.keys(path)
        for k, got in zip(keys, self.store.get_chunks(NS, keys)):
            if got is not None:
                assert torch.equal(got, value(k))

    @rule(path=PROMPTS)
    def lookup(self, path):
        keys = self.keys(path)
        hits = self.store.lookup_keys(NS, keys).num_hit_chunks
        present = self.store.exists(NS, keys)
        assert present[:hits] == [True] * hits and (hits == len(keys) or not present[hits])

    @rule(path=PROMPTS, at=st.integers(0, 5))
    def remove(self, path, at):
        keys = self.keys(path)
        self.store.remove(NS, keys[min(at, len(keys) - 1):][:1])
        self.may_strand = True

    @rule(path=PROMPTS)
    def pin(self, path):
        self.store.pin(NS, self.keys(path))

    @rule()
    def unpin_all(self):
        for k in list(self.parent):
            while self.store.unpin(NS, [k]):
                pass

    @rule()
    def flush(self):
        self.store.flush()

    @precondition(lambda self: self.cfg[2] > 0)
    @rule()
    def restart(self):
        self.store.close()
        self._open()
        self.may_strand = True  # the memory tiers are gone

    # ---- brute force ----------------------------------------------------------------------------
    @invariant()
    def reachability_is_exact_and_eviction_strands_nothing(self):
        if self.store is None:
            return
        s = self.store
        s.flush()  # a disk value's size changes when the writer commits it: count after that
        s.check_integrity()
        doomed = s._doomed
        present = {k for t in s.tiers for k in t.keys()} - doomed
        for t in s.tiers:
            for k in t.keys():
                assert t.parent_of(k) == self.parent[k], (t.name, k)

        def reachable(k):
            seen = set()
            while k is not None:
                if k not in present or k in seen:
                    return False
                seen.add(k)
                k = self.parent[k]
            return True

        stranded = {k for k in present if not reachable(k)}
        want = sum(t.nbytes_of(k) for t in s.tiers for k in t.keys() if k in stranded)
        assert s.unreachable_bytes() == want
        assert s.stats()["unreachable_bytes"] == want
        if not self.may_strand:
            assert stranded <= self.stranded, f"a step stranded {stranded - self.stranded}"
        self.stranded, self.may_strand = stranded, False


ReachabilityMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestReachability = ReachabilityMachine.TestCase

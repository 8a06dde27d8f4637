"""Scheduler on a tiny pool without a model: budgets, chunked prefill, decode-first, FCFS,
preemption by recompute and the connector seams (exact block ids and token counts)."""
import pytest

from engine_min.block_manager import BlockManager
from engine_min.sampler import SamplingParams
from engine_min.scheduler import Scheduler
from engine_min.sequence import Sequence, SequenceStatus
from tests.engine_min.null_connector import NullConnector

BS = 4


def make(num_blocks=9, budget=8, max_seqs=4, connector=None, caching=True):
    bm = BlockManager(num_blocks, BS, caching)
    return Scheduler(bm, budget, max_seqs, connector), bm


def add(s, rid, n, start=0):
    seq = Sequence(rid, list(range(start, start + n)), SamplingParams())
    s.add(seq)
    return seq


def run_step(s):
    """Schedule, then do what the engine does after the forward (sampled token = 7)."""
    out = s.schedule()
    for it in out.scheduled:
        samples = it.samples
        it.seq.num_computed_tokens += it.num_new_tokens
        s.bm.cache_blocks(it.seq)
        if samples:
            it.seq.token_ids.append(7)
    s.bm.check_integrity()
    return out


def plan(out):
    return [(it.seq.request_id, it.num_new_tokens) for it in out.scheduled]


def test_chunked_prefill_under_token_budget_and_decode_first():
    s, bm = make(budget=8)
    a, b = add(s, "a", 6), add(s, "b", 10, start=100)
    assert plan(run_step(s)) == [("a", 6), ("b", 2)]        # b's prefill is chunked
    assert plan(run_step(s)) == [("a", 1), ("b", 7)]        # decode first, then the chunk
    assert plan(run_step(s)) == [("a", 1), ("b", 1)]        # b's last prompt token: samples
    assert a.num_output_tokens == 3 and b.num_output_tokens == 1
    assert a.block_table == [1, 2] and b.block_table == [3, 4, 5]


def test_fcfs_admission_stops_at_first_that_does_not_fit():
    s, bm = make(num_blocks=5, budget=64)                  # 4 usable blocks
    add(s, "a", 12)                                         # 3 blocks
    add(s, "b", 8, start=50)                                # 2 blocks: does not fit
    add(s, "c", 2, start=90)                                # would fit, but FCFS waits for b
    assert plan(run_step(s)) == [("a", 12)]
    assert [q.request_id for q in s.waiting] == ["b", "c"]


def test_max_num_seqs():
    s, _ = make(budget=64, max_seqs=2)
    for i in range(3):
        add(s, f"r{i}", 3, start=10 * i)
    assert plan(run_step(s)) == [("r0", 3), ("r1", 3)]
    assert len(s.waiting) == 1


def test_preemption_by_recompute_of_newest():
    s, bm = make(num_blocks=4, budget=64, caching=False)   # 3 usable blocks
    add(s, "a", 4)
    b = add(s, "b", 4, start=50)
    assert plan(run_step(s)) == [("a", 4), ("b", 4)]        # 1 block each, both sample a token
    assert plan(run_step(s)) == [("a", 1)]                  # a takes block 3; b needs one: preempted
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert s.num_preemptions == 1 and list(s.waiting) == [b]
    assert b.token_ids == list(range(50, 54)) + [7]         # its output is kept and recomputed


class RecordingConnector(NullConnector):
    """Offers 4 external tokens and records the calls the scheduler makes (the worker side,
    which the scheduler never calls, does nothing)."""

    def __init__(self):
        self.calls = []

    def get_num_new_matched_tokens(self, seq, num_computed):
        self.calls.append(("match", seq.request_id, num_computed))
        return 4, False

    def update_state_after_alloc(self, seq, block_ids, num_external):
        self.calls.append(("alloc", seq.request_id, list(block_ids), num_external,
                           seq.num_computed_tokens))

    def request_finished(self, seq, block_ids):
        self.calls.append(("finished", seq.request_id, list(block_ids)))


def test_connector_seams_at_admission_and_finish():
    conn = RecordingConnector()
    s, bm = make(budget=64, connector=conn)
    a = add(s, "a", 10)
    out = run_step(s)
    # 0 local hits + 4 external -> 6 tokens computed this step, blocks for all 10
    assert plan(out) == [("a", 6)] and out.num_external_tokens == {"a": 4}
    assert conn.calls == [("match", "a", 0), ("alloc", "a", [1, 2, 3], 4, 4)]
    assert a.num_cached_tokens == 4
    s.finish(a, "stop")
    assert conn.calls[-1] == ("finished", "a", [1, 2, 3]) and bm.num_free_blocks == 8


def test_connector_never_covers_the_last_token():
    conn = RecordingConnector()
    s, _ = make(budget=64, connector=conn)
    add(s, "a", 3)                                          # offers 4 > 3 - 1
    assert plan(run_step(s)) == [("a", 1)]


# ---- prefix-cache counters under preemption: each request counted once ---------------------
class Drive:
    """Scheduler + block manager (+ optional real connector over an in-process store) with a
    stand-in forward: sampled token = 5, finish at ``max_tokens``. Records every admission as
    (request_id, tokens looked up, engine prefix-cache hit tokens, connector tokens loaded,
    re-admission?)."""

    def __init__(self, num_blocks, connector=None, caching=True):
        import torch
        self.bm = BlockManager(num_blocks, BS, caching)
        self.s = Scheduler(self.bm, 512, 32, connector)
        self.conn, self.admissions = connector, []
        self.kv = torch.zeros(2, 2, num_blocks, BS, 1, 2)  # [L, 2, blocks, BS, H, D]
        if connector is not None:
            connector.register_kv_caches(self.kv, BS)

    def run(self, seqs, max_steps=300):
        for q in seqs:
            self.s.add(q)
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                break
            waiting = {id(q) for q in self.s.waiting}
            out = self.s.schedule()
            if self.conn is not None:
                self.conn.start_load_kv(out, self.kv)
                self.conn.wait_for_load()
                self.conn.save(out, self.kv)
            for it in out.scheduled:
                q = it.seq
                if id(q) in waiting:
                    ext = out.num_external_tokens.get(q.request_id, 0)
                    self.admissions.append((q.request_id, q.num_tokens, q.num_cached_tokens - ext,
                                            ext, q.num_preemptions > 0))
                samples = it.samples
                q.num_computed_tokens += it.num_new_tokens
                self.bm.cache_blocks(q)
                if samples:
                    q.token_ids.append(5)
                    if q.num_output_tokens >= q.sampling.max_tokens:
                        self.s.finish(q, "length")
            self.bm.check_integrity()
        assert not self.s.has_unfinished()
        if self.conn is not None:
            assert self.conn.wait_for_save(30)

    def counted(self, readmitted: bool) -> tuple[int, int]:
        """(tokens looked up, engine hit tokens) summed over first admissions (False) or
        re-admissions (True): what the block manager's counters must read."""
        rows = [a for a in self.admissions if a[4] == readmitted]
        return sum(a[1] for a in rows), sum(a[2] for a in rows)


def random_prompts(lengths, seed=0):
    import random
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


def _store():
    from kvstore.config import StoreConfig
    from kvstore.store import ChunkStore
    return ChunkStore(StoreConfig(cpu_bytes="1MiB"))


def _conn(store):
    from connectors.engine_min import EngineMinConnector
    return EngineMinConnector(store, chunk_size=4, deadline_s=30.0, owns_store=False)


def test_one_preemption_counts_each_prompt_once():
    # 11 blocks of 4 (10 usable); prompts of 8, 8 and 12 random tokens (28 in all), 8 output
    # tokens each. c (newest) is preempted once when a needs its fourth block, and re-admitted
    # with 12 + 5 = 17 tokens, finding its own 2 freed blocks. Before the fix: queries 45, hits 8.
    d = Drive(11)
    a, b, c = (Sequence(r, p, SamplingParams(max_tokens=8))
               for r, p in zip("abc", random_prompts([8, 8, 12])))
    d.run([a, b, c])
    assert d.s.num_preemptions == 1 and c.num_preemptions == 1
    assert (d.bm.num_query_tokens, d.bm.num_hit_tokens) == (28, 0)
    assert (d.bm.num_preempted_query_tokens, d.bm.num_preempted_hit_tokens) == (17, 8)
    assert d.admissions == [("a", 8, 0, 0, False), ("b", 8, 0, 0, False),
                            ("c", 12, 0, 0, False), ("c", 17, 8, 0, True)]
    assert c.num_cached_tokens == 8        # usage.cached_tokens: its last admission, as before
    assert d.bm.num_free_blocks == 10


def test_one_preemption_counts_once_in_the_connector_too():
    # The same three requests on a connector-backed engine whose store already holds a's prompt
    # (saved by an earlier engine): a loads min(8, 8 - 1) = 7 tokens at its first admission.
    # Engine: 28 queried, 0 hit; connector: 28 queried, 7 hit, each request once.
    store = _store()
    prompts = random_prompts([8, 8, 12])
    first = _conn(store)
    Drive(11, first).run([Sequence("a0", prompts[0], SamplingParams(max_tokens=1))])
    first.close()
    conn = _conn(store)
    d = Drive(11, conn)
    a, b, c = (Sequence(r, p, SamplingParams(max_tokens=8)) for r, p in zip("abc", prompts))
    d.run([a, b, c])
    st = conn.get_stats()
    assert d.s.num_preemptions == 1 and c.num_preemptions == 1
    assert (d.bm.num_query_tokens, d.bm.num_hit_tokens) == (28, 0)
    assert (st["external_prefix_cache_queries"], st["external_prefix_cache_hits"]) == (28, 7)
    assert [x for x in d.admissions if not x[4]] == [
        ("a", 8, 0, 7, False), ("b", 8, 0, 0, False), ("c", 12, 0, 0, False)]
    conn.close()
    store.close()


@pytest.mark.parametrize("caching, engine_counts, store_counts", [
    (True, (60, 32), (60, 0)),      # P is in the engine's cache: the store adds nothing past it
    (False, (0, 0), (60, 32)),      # the engine's cache off: P comes from the store
])
def test_many_preemptions_with_a_shared_prefix_count_each_request_once(
        caching, engine_counts, store_counts):
    # w (a shared 8-token prefix P + 4 tokens) runs first, so P's 2 blocks are cached (and
    # stored). Then four requests P + 4 own tokens (12 each) with 16 output tokens on a 10-block
    # pool: each first admission finds P (8 tokens), and they preempt each other 4 times.
    # Counted once per request: 12 + 4 * 12 = 60 queried, 0 + 4 * 8 = 32 hit, by whichever
    # cache holds P; re-admissions only in the engine's preempted counters.
    store = _store()
    conn = _conn(store)
    d = Drive(11, conn, caching)
    p, *own = random_prompts([8, 4, 4, 4, 4, 4], seed=3)
    d.run([Sequence("w", p + own[0], SamplingParams(max_tokens=1))])
    reqs = [Sequence(f"r{i}", p + own[i], SamplingParams(max_tokens=16)) for i in range(1, 5)]
    d.run(reqs)
    assert d.s.num_preemptions == 4 and all(r.num_output_tokens == 16 for r in reqs)
    hit = (8, 0) if caching else (0, 8)
    assert [x for x in d.admissions if not x[4]] == \
        [("w", 12, 0, 0, False)] + [(f"r{i}", 12, *hit, False) for i in range(1, 5)]
    assert len([x for x in d.admissions if x[4]]) == 4
    assert (d.bm.num_query_tokens, d.bm.num_hit_tokens) == engine_counts
    st = conn.get_stats()
    assert (st["external_prefix_cache_queries"], st["external_prefix_cache_hits"]) == store_counts
    if caching:
        assert engine_counts == d.counted(False)
        assert (d.bm.num_preempted_query_tokens, d.bm.num_preempted_hit_tokens) == \
            d.counted(True) == (81, 56)  # 4 re-admissions, mostly their own freed blocks
    conn.close()
    store.close()

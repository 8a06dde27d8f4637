"""Scheduler on a tiny pool without a model: budgets, chunked prefill, decode-first, FCFS,
preemption by recompute and the connector seams (exact block ids and token counts)."""
from engine_min.block_manager import BlockManager
from engine_min.sampler import SamplingParams
from engine_min.scheduler import Scheduler
from engine_min.sequence import Sequence, SequenceStatus

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


class RecordingConnector:
    """Offers 4 external tokens and records the calls the scheduler makes."""

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

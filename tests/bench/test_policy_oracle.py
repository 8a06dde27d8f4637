"""The reuse oracle (an admission bound) and the reuse-by-feature report, on hand-made traces
and on a slice of the Mooncake conversation trace."""
import json
from pathlib import Path

import pytest

from bench.policy_belady import belady_hit_tokens
from bench.policy_oracle import ReuseOracle
from bench.policy_replay import PolicyReplay
from bench.policy_reuse import main as reuse_main, reuse_by_feature
from bench.policy_sim import tier_capacities
from bench.policy_trace import from_rows
from kvstore.eviction import POLICIES

TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
CONV = TRACES / "mooncake_conversation_trace.jsonl"
needs_traces = pytest.mark.skipif(not CONV.exists(), reason=f"trace files not found in {TRACES}")


def _single_chunk_rows(text: str):
    return from_rows("hand", [([ord(c)], [1]) for c in text])


@pytest.mark.parametrize("tiers", [[20], [10, 10]])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_oracle_refuses_what_no_later_row_reads(name, tiers):
    # "a a b c b d b a", room for 2 chunks (in one tier, or CPU 1 over disk 1): a and b are
    # stored while there is room; c and d are read once, so the oracle refuses them and a
    # and b stay: every policy then hits a, b, b, a (4 rows; LRU alone hits 3). Over two
    # tiers c and d are refused by both, and a's promotion from disk in the last row too (no
    # row reads it after that one): 5 refusals
    sim = PolicyReplay(_single_chunk_rows("aabcbdba"), name, tiers, token_bytes=10,
                       admission="oracle")
    res = sim.run()
    sim.check_integrity()
    assert list(res.row_hit_tokens) == [0, 1, 0, 0, 1, 0, 1, 1]
    assert res.refused == (2 if len(tiers) == 1 else 5)
    assert set().union(*(t.nbytes for t in sim.tiers)) == {ord("a"), ord("b")}
    plain = PolicyReplay(_single_chunk_rows("aabcbdba"), "lru", [20], token_bytes=10).run()
    assert sum(plain.row_hit_tokens) == 3


def test_oracle_tracks_the_row_being_served():
    trace = from_rows("t", [([1, 2], [1, 1]), ([1, 3], [1, 1]), ([1, 2], [1, 1])])
    oracle = ReuseOracle(trace)
    oracle.record_many([1, 2])  # row 0: 1 and 2 are read again, 3 is read later (row 1)
    assert oracle.admit(1, 0) and oracle.admit(2, 0) and oracle.admit(3, 0)
    assert not oracle.admit(99, 0)  # a key the trace never reads
    oracle.record(1)
    oracle.record(3)  # row 1: 3 is not read after it
    assert oracle.admit(1, 0) and oracle.admit(2, 0) and not oracle.admit(3, 0)
    oracle.record_many([1, 2])  # row 2: nothing is read after it
    assert not oracle.admit(1, 0) and not oracle.admit(2, 0)


@needs_traces
def test_oracle_lies_between_its_policy_and_beladys_bound_on_a_trace_slice():
    from bench.policy_trace import load_chunk_trace
    trace = load_chunk_trace("mooncake-conv", TRACES, limit=600)
    unique = trace.unique_tokens()
    cap = tier_capacities(unique, 0.1, 1, 0.25)
    bound = belady_hit_tokens(trace, cap[0], 1)
    for name in ("lru", "fifo"):
        plain = PolicyReplay(trace, name, cap, 1).run()
        sim = PolicyReplay(trace, name, cap, 1, "oracle")
        oracle = sim.run()
        sim.check_integrity()
        assert plain.hit_tokens < oracle.hit_tokens <= bound, name
        assert oracle.refused > 0


def test_reuse_by_feature_counts_a_hand_made_trace(tmp_path):
    # row 0: new 1, 2 (depth 0; both read again); row 1: hit 1, new 3 (depth 1: 1 was first
    # read by row 0); row 2: hit 1, 2, new 4 (partial: 1 token; depth 1); row 3: new 5
    trace = from_rows("t", [([1, 2], [2, 2]), ([1, 3], [2, 2]), ([1, 2, 4], [2, 2, 1]),
                            ([5], [2])])
    doc = reuse_by_feature(trace)
    assert doc["overall"] == [5, 2]
    assert doc["by_depth"] == {0: [3, 2], 1: [2, 0]}
    assert doc["by_new_chunks"] == {1: [3, 0], 2: [2, 2]}
    assert doc["by_partial"] == {False: [4, 2], True: [1, 0]}
    assert doc["read_once"] == 3  # 3, 4, 5; 1 is read by rows 0-2, 2 by rows 0 and 2
    assert doc["gap_rows_median"] == 1  # gaps: 1 -> 1, 1, 2 -> 2: sorted [1, 1, 2]


@needs_traces
def test_reuse_cli_writes_its_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert reuse_main(["--trace", "mooncake-conv", "--limit", "300", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["trace"] == "mooncake-conv" and set(doc["by_partial"]) <= {"true", "false"}
    n, again = doc["overall"]
    assert 0 < again < n
    assert sum(v[0] for v in doc["by_depth"].values()) == n
    assert sum(v[1] for v in doc["by_new_chunks"].values()) == again
    assert "read again by a later row" in capsys.readouterr().out

"""The eviction simulator: Belady's textbook count, hand-worked policy tables, the infinite-
capacity hit rate against the trace's own reuse, the bound above every policy, the CLI."""
import json
from pathlib import Path

import pytest

from bench.policy_belady import belady_hit_tokens, next_uses
from bench.policy_replay import PolicyReplay
from bench.policy_sim import main, tier_capacities
from bench.policy_trace import from_rows, load_chunk_trace
from bench.traces import load_mooncake
from kvstore.eviction import POLICIES

TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
CONV = TRACES / "mooncake_conversation_trace.jsonl"
needs_traces = pytest.mark.skipif(not CONV.exists(), reason=f"trace files not found in {TRACES}")


def _single_chunk_rows(text: str):
    """One row per character, each a one-chunk prompt of 1 token keyed by the character."""
    return from_rows("hand", [([ord(c)], [1]) for c in text])


def test_belady_textbook_reference_string():
    # Silberschatz's reference string, 3 frames: OPT (demand paging) takes 9 faults, so 11
    # of 20 hit. With bypass, 4 (never used again) and the second 7 are not stored, so 0
    # stays for position 10 and 12 hit.
    s = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    trace = from_rows("ref", [([k], [1]) for k in s])
    assert belady_hit_tokens(trace, capacity_bytes=3, token_bytes=1, bypass=False) == 11
    assert belady_hit_tokens(trace, capacity_bytes=3, token_bytes=1) == 12
    assert belady_hit_tokens(trace, capacity_bytes=10, token_bytes=1) == 20 - len(set(s))
    assert belady_hit_tokens(trace, capacity_bytes=0, token_bytes=1) == 0
    assert next_uses(trace)[:4] == [17, 4, 13, 8]


def test_belady_keeps_prefixes_closed():
    # two prompts share head 1; capacity for 2 chunks: MIN keeps the head and one tail
    rows = [([1, 2], [1, 1]), ([1, 3], [1, 1]), ([1, 2], [1, 1]), ([1, 3], [1, 1])]
    trace = from_rows("prefix", rows)
    # row 0: miss 1, 2; row 1: hit 1, miss 3 (not stored: 2 is needed sooner); row 2: hit
    # 1, 2; row 3: hit 1, miss 3
    assert belady_hit_tokens(trace, 2, 1) == 1 + 2 + 1


# Access string "a a b c b d b a", one chunk per row, a tier of 2 chunks. Hit (1) or miss
# (0) per row, worked by hand:
#   lru:    a- a+ b- c-(evict a) b+ d-(evict c) b+ a-(evict d)
#   fifo:   a- a+ b- c-(evict a) b+ d-(evict b) b-(evict c) a-(evict d)
#   lfu:    a- a+(a=2) b- c-(evict b) b-(evict c) d-(evict b) b-(evict d) a+
#   s3fifo: a- a+(a read) b- c-(a to main; b, unread in small, evicted to the ghost)
#           b-(c evicted; the ghost keeps only as many names as main holds: c, so b goes to
#           small) d-(evict b) b-(evict d) a+
#   arc:    a- a+(a to T2) b- c-(T1 over its target 0: evict b) b-(evict c) d-(evict b)
#           b-(evict d) a+
HAND = {
    "lru": [0, 1, 0, 0, 1, 0, 1, 0],
    "fifo": [0, 1, 0, 0, 1, 0, 0, 0],
    "lfu": [0, 1, 0, 0, 0, 0, 0, 1],
    "s3fifo": [0, 1, 0, 0, 0, 0, 0, 1],
    "arc": [0, 1, 0, 0, 0, 0, 0, 1],
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_decisions_match_the_hand_worked_table(name):
    trace = _single_chunk_rows("aabcbdba")
    sim = PolicyReplay(trace, name, [20], token_bytes=10)
    res = sim.run()
    sim.check_integrity()
    assert list(res.row_hit_tokens) == HAND[name]
    assert res.hit_tokens == sum(HAND[name]) and res.total_tokens == 8
    assert res.spilled_bytes == 0


# The same string with the TinyLFU admission filter (requests recorded at each row's start):
# a is requested twice by row 1, b once by row 3; c (row 3) and d (row 5) are requested once
# and lose against any victim (a: 2; b: 1 at row 3, a tie, 2 at row 5), so the tier keeps a
# and b and rows 4, 6, 7 hit, whatever the policy's victim.
HAND_TINYLFU = [0, 1, 0, 0, 1, 0, 1, 1]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_admission_decisions_match_the_hand_worked_table(name):
    sim = PolicyReplay(_single_chunk_rows("aabcbdba"), name, [20], token_bytes=10,
                       admission="tinylfu")
    res = sim.run()
    sim.check_integrity()
    assert list(res.row_hit_tokens) == HAND_TINYLFU
    assert res.refused == 2  # c and d
    assert set(sim.tiers[0].nbytes) == {ord("a"), ord("b")}


def test_admission_keeps_a_chunk_asked_once_off_the_disk():
    # CPU 1 chunk over disk 1 chunk, LRU, "aabbccc". Without a filter every eviction spills
    # (a at row 2, b at row 4: 20 bytes). With TinyLFU: b (1 request) loses to a (2) in CPU
    # and goes to the empty disk (the one disk write, 10 bytes); b's promotion ties a (2 vs
    # 2): refused; c's first two requests lose (or tie) in both tiers; the third beats a
    # (3 > 2), and a's spill ties b on the full disk: refused, a leaves. 7 refusals.
    rows = _single_chunk_rows("aabbccc")
    plain = PolicyReplay(rows, "lru", [10, 10], token_bytes=10).run()
    assert list(plain.row_hit_tokens) == [0, 1, 0, 1, 0, 1, 1]
    assert plain.spilled_bytes == 20
    sim = PolicyReplay(rows, "lru", [10, 10], token_bytes=10, admission="tinylfu")
    res = sim.run()
    sim.check_integrity()
    assert list(res.row_hit_tokens) == [0, 1, 0, 1, 0, 0, 0]
    assert (res.refused, res.spilled_bytes) == (7, 10)
    assert [set(t.nbytes) for t in sim.tiers] == [{ord("c")}, {ord("b")}]
    with pytest.raises(ValueError, match="unknown admission filter"):
        PolicyReplay(rows, "lru", [10], token_bytes=10, admission="lfu")


def test_two_tiers_spill_and_promote():
    # CPU holds 1 chunk, disk 2: b's insert spills a to disk; reading a hits the disk and
    # promotes it, which spills b (held by the CPU only) to disk too
    trace = _single_chunk_rows("aba")
    sim = PolicyReplay(trace, "lru", [10, 20], token_bytes=10)
    res = sim.run()
    sim.check_integrity()
    assert list(res.row_hit_tokens) == [0, 0, 1]
    assert res.top_hit_tokens == 0  # a was served by the disk
    assert res.spilled_bytes == 20  # a, then b
    assert set(sim.tiers[0].nbytes) == {ord("a")}
    assert set(sim.tiers[1].nbytes) == {ord("a"), ord("b")}


def test_prefix_rule_evicts_tails_not_heads():
    # a 3-chunk prompt into a 2-chunk tier: the head is kept, the last chunk is refused
    # (making room would evict its own ancestors), and the next read of the prompt hits 2
    rows = [([1, 2, 3], [1, 1, 1]), ([1, 2, 3], [1, 1, 1])]
    for name in sorted(POLICIES):
        sim = PolicyReplay(from_rows("p", rows), name, [2], token_bytes=1)
        res = sim.run()
        sim.check_integrity()
        assert list(res.row_hit_tokens) == [0, 2], name


def _independent_reuse(records) -> tuple[int, int]:
    """Token-weighted prefix reuse in arrival order, per 512-token hash block: (hit, total)."""
    seen, hit, total = set(), 0, 0
    for rec in records:
        n = len(rec.hash_ids)
        sizes = [512] * (n - 1) + [rec.input_length - 512 * (n - 1)]
        total += rec.input_length
        reusing = True
        for h, t in zip(rec.hash_ids, sizes):
            reusing = reusing and h in seen
            hit += t if reusing else 0
        seen.update(rec.hash_ids)
    return hit, total


@needs_traces
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_infinite_capacity_equals_the_traces_own_reuse(name, tmp_path):
    records = load_mooncake(CONV, limit=400)
    hit, total = _independent_reuse(records)
    assert 0.05 * total < hit < total  # the conversation trace does reuse
    rows = [(list(r.hash_ids), [512] * (len(r.hash_ids) - 1)
             + [r.input_length - 512 * (len(r.hash_ids) - 1)]) for r in records]
    trace = from_rows("conv400", rows)
    unique = trace.unique_tokens()
    for caps in ([unique], [unique // 4, unique]):  # one tier; CPU over a disk that holds all
        res = PolicyReplay(trace, name, caps, token_bytes=1).run()
        assert (res.hit_tokens, res.total_tokens) == (hit, total)
    assert belady_hit_tokens(trace, unique, 1) == hit


@needs_traces
def test_belady_bounds_every_policy_on_a_trace_slice():
    records = load_mooncake(CONV, limit=300)
    rows = [(list(r.hash_ids), [512] * (len(r.hash_ids) - 1)
             + [r.input_length - 512 * (len(r.hash_ids) - 1)]) for r in records]
    trace = from_rows("conv300", rows)
    unique = trace.unique_tokens()
    nxt = next_uses(trace)
    for f in (0.05,):
        bound = belady_hit_tokens(trace, int(f * unique), 1, nxt)
        for name in sorted(POLICIES):
            for tiers in (1, 2):
                sim = PolicyReplay(trace, name, tier_capacities(unique, f, tiers, 0.25), 1)
                res = sim.run()
                sim.check_integrity()
                assert 0 < res.hit_tokens <= bound, (name, f, tiers)


@needs_traces
def test_azure_has_no_prefix_information_so_nothing_hits():
    trace = load_chunk_trace("azure-code", TRACES)
    assert trace.num_rows == 8819 and len(set(trace.keys)) == len(trace.keys)
    assert belady_hit_tokens(trace, trace.unique_tokens(), 1) == 0


def _random_prefix_rows(seed: int, num_rows: int):
    """Rows that share prefixes: each extends (or cuts) an earlier row's chain by new ids, a
    few new prompts, a few chunks over the tier (500 tokens)."""
    import random
    rng = random.Random(seed)
    rows, next_id = [], 0
    for _ in range(num_rows):
        if rows and rng.random() < 0.8:
            base = rng.choice(rows)[0]
            head = base[:rng.randint(1, len(base))]
        else:
            head = []
        n = rng.randint(0 if head else 1, 8)
        ids = head + list(range(next_id, next_id + n))
        next_id += n
        rows.append((ids, [rng.choice((16, 16, 16, 7, 500)) for _ in ids]))
    # a row's token counts must not change with the row: give each id one count
    tokens: dict[int, int] = {}
    return [(ids, [tokens.setdefault(k, t) for k, t in zip(ids, ts)]) for ids, ts in rows]


@pytest.mark.parametrize("admission", ["none", "tinylfu"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_one_tier_batched_replay_equals_the_per_event_replay(name, admission):
    # the one-tier replay drives the policies through their batched calls; the general
    # (per-event) row path must give the same hits per row, refusals and final contents
    trace = from_rows("random", _random_prefix_rows(5, 1500))
    for capacity in (40, 300, 2000):
        fast = PolicyReplay(trace, name, [capacity], 1, admission)
        slow = PolicyReplay(trace, name, [capacity], 1, admission)
        slow._row_one_tier = slow._row
        a, b = fast.run(), slow.run()
        assert a.row_hit_tokens == b.row_hit_tokens and a.refused == b.refused
        assert fast.tiers[0].nbytes == slow.tiers[0].nbytes
        assert list(fast.tiers[0].policy._order()) == list(slow.tiers[0].policy._order())
        fast.check_integrity()
        assert 0 < a.hit_tokens < a.total_tokens


def test_from_rows_refuses_unchained_ids():
    with pytest.raises(ValueError, match="not chained"):
        from_rows("bad", [([1, 2], [1, 1]), ([3, 2], [1, 1])])
    with pytest.raises(ValueError, match="row 0"):
        from_rows("bad", [([1, 2], [1])])
    with pytest.raises(ValueError, match="unknown trace 'nope'"):
        load_chunk_trace("nope", TRACES)


@needs_traces
def test_cli_writes_the_json_the_issue_names_and_a_png(tmp_path, capsys):
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    assert main(["--trace", "mooncake-synth", "--policy", "lru", "--policy", "arc",
                 "--fractions", "0.3,1.0", "--limit", "400", "--json", str(out), "--png", str(png),
                 "--admission", "none", "--admission", "tinylfu"]) == 0
    doc = json.loads(out.read_text())
    assert {"trace", "default_policy", "infinite_hit_rate", "curves", "belady",
            "accesses_per_s"} <= set(doc)
    assert doc["trace"] == "mooncake-synth" and doc["default_policy"] == "lru"
    assert doc["default_admission"] == "none"
    assert set(doc["curves"]) == {"lru", "arc", "lru+tinylfu", "arc+tinylfu"}
    assert set(doc["belady"]) == {"0.3", "1.0"}
    for name in ("lru", "arc"):
        assert doc["refused"][name] == {"0.3": 0, "1.0": 0}
        assert doc["refused"][name + "+tinylfu"]["1.0"] == 0  # everything fits: no victim
    for name in doc["curves"]:
        assert doc["curves"][name]["1.0"] == pytest.approx(doc["infinite_hit_rate"])
        assert doc["curves"][name]["0.3"] <= doc["belady"]["0.3"]
        assert doc["two_tier"][name]["0.3"]["disk_bytes_written"] > 0
    assert doc["accesses_per_s"] > 0
    assert png.stat().st_size > 10_000
    assert "| belady |" in capsys.readouterr().out

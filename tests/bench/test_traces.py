"""Trace loaders on the real trace files, the hash-id -> tokens map and the scaling rules."""
from pathlib import Path

import pytest

from bench.traces import (AzureReplay, MooncakeReplay, arrival_times, block_tokens,
                          ideal_hit_tokens, load_azure, load_mooncake, mooncake_prompt,
                          scaled_lengths)

TRACES = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
CONV = TRACES / "mooncake_conversation_trace.jsonl"
SYNTH = TRACES / "mooncake_synthetic_trace.jsonl"
AZ_CONV = TRACES / "azure_llm_2023_conv.csv"
AZ_CODE = TRACES / "azure_llm_2023_code.csv"
pytestmark = pytest.mark.skipif(not CONV.exists(), reason=f"trace files not found in {TRACES}")


def test_mooncake_files_load_whole():
    conv = load_mooncake(CONV)
    assert len(conv) == 12031
    assert conv[-1].timestamp_ms == 3536999
    assert (conv[0].timestamp_ms, conv[0].input_length, conv[0].output_length) == (0, 6758, 500)
    assert conv[0].hash_ids == tuple(range(14))
    synth = load_mooncake(SYNTH)
    assert len(synth) == 3993
    assert (synth[2].timestamp_ms, synth[2].input_length, len(synth[2].hash_ids)) == (40, 23769,
                                                                                     47)


def test_mooncake_scaling_and_prompt():
    rec = load_mooncake(CONV, limit=2)[1]  # 7322 tokens = 14 full blocks + 154
    sizes, n_out = scaled_lengths(rec, 16)
    assert sizes == [16] * 14 + [5]          # round(154 * 16 / 512) = 5
    assert n_out == 15                       # round(490 * 16 / 512)
    prompt = mooncake_prompt(rec, 16)
    assert len(prompt) == 229
    assert prompt[:16] == block_tokens(0, 16)
    assert prompt[-5:] == block_tokens(27, 16)[:5]
    assert scaled_lengths(rec, 512) == ([512] * 14 + [154], 490)  # as published


def test_block_tokens_deterministic():
    assert block_tokens(0, 4) == (35224, 31341, 20048, 6800)
    assert block_tokens(1, 4) == (4205, 15825, 22175, 3811)
    assert block_tokens(0, 4, seed=1) == (14275, 23855, 31536, 9714)


def test_shared_hash_ids_share_tokens():
    reqs = MooncakeReplay(str(CONV), tokens_per_block=16, limit=3).requests()
    assert reqs[0].prompt[:16] == reqs[1].prompt[:16] == reqs[2].prompt[:16]
    assert reqs[0].prompt[16:32] != reqs[1].prompt[16:32]
    assert [r.session for r in reqs] == ["h0-1", "h0-14", "h0-28"]


def test_ideal_hit_tokens_follow_the_trace():
    recs = load_mooncake(CONV, limit=60)
    assert ideal_hit_tokens(recs, 16) == [0] + [16] * 59  # only the root block is shared early
    assert ideal_hit_tokens(recs, 16, align=256) == [0] * 60
    full = load_mooncake(CONV, limit=2000)
    total = sum(sum(scaled_lengths(r, 16)[0]) for r in full)
    assert round(sum(ideal_hit_tokens(full, 16)) / total, 3) == 0.294


def test_arrival_times_burst_and_spread():
    ts = [0, 0, 0, 3000, 3000, 6000]
    assert arrival_times(ts, 1.0, "spread") == [0.0, 1.0, 2.0, 3.0, 4.5, 6.0]
    assert arrival_times(ts, 0.5, "burst") == [0.0, 0.0, 0.0, 1.5, 1.5, 3.0]
    with pytest.raises(ValueError, match="mode"):
        arrival_times(ts, 1.0, "poisson")


def test_mooncake_replay_time_scale_and_limit():
    reqs = MooncakeReplay(str(CONV), tokens_per_block=16, time_scale=0.1, limit=40,
                          mode="burst", max_output_tokens=8).requests()
    assert len(reqs) == 40
    assert reqs[-1].arrival_s == pytest.approx(1.2)  # 12 s into the trace, ten times faster
    assert max(r.max_tokens for r in reqs) == 8


def test_azure_loads_as_arrivals():
    conv = load_azure(AZ_CONV)
    assert len(conv) == 19366
    assert conv[1].arrival_s == pytest.approx(4.314579)
    assert (conv[2].context_tokens, conv[2].generated_tokens) == (879, 55)
    assert conv[-1].arrival_s == pytest.approx(3501.721937)
    code = load_azure(AZ_CODE, limit=2)
    assert [(r.context_tokens, r.generated_tokens) for r in code] == [(4808, 10), (3180, 8)]
    reqs = AzureReplay(str(AZ_CONV), length_scale=0.125, limit=3, max_output_tokens=16).requests()
    assert [(len(r.prompt), r.max_tokens) for r in reqs] == [(47, 6), (50, 14), (110, 7)]
    assert reqs[0].prompt[:8] != reqs[1].prompt[:8]


def test_bad_trace_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 1 hash ids for input_length 600"):
        load_mooncake(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: bad Mooncake row"):
        load_mooncake(bad)
    csv = tmp_path / "bad.csv"
    csv.write_text("time,a,b\n")
    with pytest.raises(ValueError, match="unexpected header"):
        load_azure(csv)
    with pytest.raises(ValueError, match="tokens_per_block"):
        MooncakeReplay(str(CONV), tokens_per_block=0)
    with pytest.raises(FileNotFoundError):
        load_mooncake(tmp_path / "missing.jsonl")


def test_session_sampling_keeps_whole_conversations():
    wl = MooncakeReplay(str(CONV), tokens_per_block=16, sessions=3, limit=None,
                        max_input_tokens=100)
    recs = wl.records()
    assert [(r.timestamp_ms, r.hash_ids[:2], len(r.hash_ids)) for r in recs] == [
        (216000, (0, 14517), 39), (555000, (0, 14517), 39), (1476000, (0, 80530), 14),
        (2921999, (0, 151198), 133)]
    # the second turn reuses 38 blocks of the first (38 * 16 = 608 tokens)
    assert ideal_hit_tokens(recs, 16) == [0, 608, 16, 16]
    assert ideal_hit_tokens(recs, 16, align=64) == [0, 576, 0, 0]
    assert ideal_hit_tokens(recs, 16, 1, max_input_tokens=100) == [0, 99, 16, 16]
    reqs = wl.requests()
    assert [len(r.prompt) for r in reqs] == [100] * 4
    assert reqs[1].prompt == reqs[0].prompt
    with pytest.raises(ValueError, match="sessions"):
        MooncakeReplay(str(CONV), sessions=0)

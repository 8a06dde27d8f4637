"""``python -m bench.codec --quick`` on the real model: the JSON has every codec's figures, the
raw disk tier reproduces recompute exactly, and the lossy codecs store about a quarter of the
fp32 KV's bytes (kivi: under half of fp16's) with errors within their stated bounds."""
from __future__ import annotations

import json

from bench.codec import main


def test_quick_codec_bench_reports_every_codec(tmp_path):
    out = tmp_path / "codec.json"
    res = main(["--quick", "--max-tokens", "4", "--cold", "--ttft-rounds", "1",
                "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["num_prompts"] == 3 and res["kv_dtype"] == "float32"
    fields = {"bytes_ratio_vs_fp16", "bytes_ratio_vs_stored_dtype", "token_agreement",
              "prompt_exact_rate", "max_abs_error", "mean_abs_error", "encode_gbps",
              "decode_gbps", "disk_hit_ttft_s", "within_error_bound"}
    assert set(res["codecs"]) == {"raw", "int8", "fp8", "kivi"}
    for row in res["codecs"].values():
        assert fields <= set(row)
        assert row["loaded_tokens"] == (3 + 3 + 2) * 64  # full chunks of 208, 208, 176 tokens
        assert row["encode_gbps"] > 0 and row["decode_gbps"] > 0
        assert row["within_error_bound"] is True   # each codec's stated bound, on real KV
        assert row["wire_get_gbps"] > 0             # gets from a local daemon, this wire codec
        # --cold: one round, 3 prompts, a cold hit (data file evicted: nothing of it left in
        # the page cache) then a warm one each
        assert len(row["disk_hit_ttft_cold_runs_s"]) == len(row["disk_hit_ttft_warm_runs_s"]) == 3
        assert row["cold_resident_bytes_max"] == 0 < row["data_file_bytes"]
        assert row["disk_hit_ttft_cold_s"] > 0 and row["disk_hit_ttft_warm_s"] > 0
    raw, int8, fp8, kivi = (res["codecs"][c] for c in ("raw", "int8", "fp8", "kivi"))
    # raw: bit-exact, fp32 stored whole (2x fp16), so generation equals recompute's
    assert raw["max_abs_error"] == 0 and raw["token_agreement"] == 1.0
    assert raw["prompt_exact_rate"] == 1.0
    assert 2.0 <= raw["bytes_ratio_vs_fp16"] < 2.01
    # on the daemon's wire: raw sends the fp32 bytes, each lossy codec its payload
    assert raw["wire_bytes_ratio_vs_fp16"] == 2.0
    assert 0.515 < int8["wire_bytes_ratio_vs_fp16"] < 0.52
    assert 0.515 < fp8["wire_bytes_ratio_vs_fp16"] < 0.52
    assert 0.484 < kivi["wire_bytes_ratio_vs_fp16"] < 0.485
    # int8 / fp8 at chunk_size 64, head_dim 64: 1 byte per value + 1/32 fp16 scales per value
    for row in (int8, fp8):
        assert 0.515 < row["bytes_ratio_vs_fp16"] < 0.52
        assert 0 < row["mean_abs_error"] < row["max_abs_error"]
    # int8's step is amax/127 of a channel or token (amax <= kv_abs_max): error <= half of it
    assert int8["max_abs_error"] <= int8["kv_abs_max"] / 127 / 2 * 1.001
    assert fp8["max_abs_error"] <= fp8["kv_abs_max"] / 16
    # kivi: K 8 bits + 2 bytes per 64 values, V 7 bits + 2 bytes per 64 values, header counted;
    # a prompt's first chunk also keeps its 4 attention-sink tokens in fp16 (4 of 64 tokens)
    n, first = kivi["chunks_measured"], kivi["first_chunks_measured"]
    assert 0 < first < n   # the disk tier's distinct full chunks, some of them first chunks
    sinks = first / n * 4 / 64
    assert 0.484 + sinks < kivi["bytes_ratio_vs_fp16"] < 0.49 + sinks
    # the two kinds alone: the README's per-chunk 0.484x, and a first chunk's
    assert 0.484 < kivi["bytes_ratio_vs_fp16_next_chunk"] < 0.485
    assert 0.546 < kivi["bytes_ratio_vs_fp16_first_chunk"] < 0.548
    assert 0 < kivi["mean_abs_error"] < kivi["max_abs_error"]
    # K's step is amax / 127 of a channel over 64 tokens, V's amax / 63 of a token's 64
    # channels, rounded up to fp16: error <= half a step
    assert kivi["max_abs_error"] <= kivi["kv_abs_max"] / 63 * (1 + 2 ** -10) / 2 * 1.001

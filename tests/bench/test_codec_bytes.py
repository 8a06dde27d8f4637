"""``bench.codec``'s byte ratios name what they measure: ``bytes_ratio_vs_fp16`` is over the
sampled chunks, a mix of prompts' first chunks (kivi keeps their sink tokens in fp16: 0.547x)
and chunks with a parent (0.484x, the README's per-chunk figure), so ``--quick``'s few short
prompts print about 0.51; ``bytes_ratio_vs_fp16_next_chunk`` and ``_first_chunk`` are the two
kinds alone."""
import pytest
import torch

from bench.codec import codec_figures


def _kv(seed: int) -> torch.Tensor:
    """A chunk shaped as SmolLM2-135M's in engine_min: [30 layers, K/V, 64 tokens, 3 heads,
    64] fp32."""
    return torch.randn(30, 2, 64, 3, 64, generator=torch.Generator().manual_seed(seed))


def test_kivi_names_the_per_chunk_and_the_first_chunk_ratios():
    kvs = [_kv(i) for i in range(4)]
    first = [True, False, False, False]
    got = codec_figures(kvs, "kivi", first)
    assert 0.484 < got["bytes_ratio_vs_fp16_next_chunk"] < 0.485
    assert 0.546 < got["bytes_ratio_vs_fp16_first_chunk"] < 0.548
    # the mix: 1 first chunk of 4, chunks of one size
    mix = (got["bytes_ratio_vs_fp16_first_chunk"] + 3 * got["bytes_ratio_vs_fp16_next_chunk"]) / 4
    assert got["bytes_ratio_vs_fp16"] == pytest.approx(mix, rel=1e-12)
    assert (got["chunks_measured"], got["first_chunks_measured"]) == (4, 1)


def test_without_first_chunks_the_first_chunk_ratio_is_none_and_int8_has_one_ratio():
    kvs = [_kv(i) for i in range(2)]
    kivi = codec_figures(kvs, "kivi", [False, False])
    assert kivi["bytes_ratio_vs_fp16_first_chunk"] is None
    assert kivi["bytes_ratio_vs_fp16"] == kivi["bytes_ratio_vs_fp16_next_chunk"]
    int8 = codec_figures(kvs, "int8", [True, False])   # no sink tokens: both kinds alike
    assert int8["bytes_ratio_vs_fp16_first_chunk"] == pytest.approx(
        int8["bytes_ratio_vs_fp16_next_chunk"], rel=1e-3)
    assert 0.515 < int8["bytes_ratio_vs_fp16_next_chunk"] < 0.52

"""bench.codec_fake: the fake-quantized formats and their byte formula (no model)."""
import pytest
import torch

from bench.codec_fake import (VARIANTS, Variant, apply_variant, fake_quant,
                               fake_quant_diffused)


def _kv(L=2, T=64, H=3, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, T, H, D, generator=g)                       # [L, 2, T, H, D]


def test_fake_quant_symmetric_exact_values_and_bytes():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [2.0, 1.0, -2.0, 0.5]])
    out, nbytes = fake_quant(x, 8, -1, True)                             # one scale per row
    s = torch.tensor([1 / 127, 2 / 127]).half().float()[:, None]
    assert torch.equal(out, (x / s).round() * s)
    assert out[0, 0] == pytest.approx(1.0, abs=1e-3) and out[1, 2] == pytest.approx(-2.0, abs=2e-3)
    assert nbytes == 8 + 2 * 2                                           # 8 codes + 2 fp16 scales


def test_fake_quant_asymmetric_bound_and_bytes():
    x = _kv()[0, 1]                                                      # [T, H, D]
    out, nbytes = fake_quant(x, 7, -1, False)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / 127
    assert bool(((out - x).abs() <= step * 0.51 + 2e-3 * hi.abs()).all())  # half a step (+fp16 zero)
    assert nbytes == (x.numel() * 7 + 7) // 8 + 64 * 3 * 2 * 2           # codes + scale, zero per token
    with pytest.raises(ValueError):
        fake_quant(x, 1, -1, True)


def test_kivi_like_byte_formula():
    kv = _kv()
    _, nbytes = apply_variant(kv, VARIANTS["kivi-like"], 0)
    per_layer = (64 * 3 * 64 + 3 * 64 * 2) + (64 * 3 * 64 * 7 // 8 + 64 * 3 * 2 * 2)
    assert nbytes == 2 * per_layer
    assert nbytes / (2 * kv.numel()) == 0.4921875


def test_cast_variants_and_sinks():
    kv = _kv()
    out, nbytes = apply_variant(kv, VARIANTS["fp16"], 0)
    assert torch.equal(out, kv.half().float()) and nbytes == 2 * kv.numel()
    var = VARIANTS["k8-v7-sink4"]
    first, b0 = apply_variant(kv, var, 0)
    later, b1 = apply_variant(kv, var, 64)                               # no sink in chunk 2
    assert torch.equal(first[:, :, :4], kv[:, :, :4].half().float())
    assert not torch.equal(later[:, :, :4], kv[:, :, :4].half().float())
    _, plain = apply_variant(kv, Variant("x", k_bits=8, v_bits=7), 64)
    assert b1 == plain
    # chunk 1: 4 fp16 tokens + per layer K over 60 tokens, V per token over 60 tokens
    per_layer = (60 * 192 + 192 * 2) + (60 * 192 * 7 // 8 + 60 * 3 * 4)
    assert b0 == 4 * 2 * 2 * 192 * 2 + 2 * per_layer


def test_k_outliers_kept_and_counted():
    kv = _kv()
    kv[:, 0, :, 1, 5] *= 40                                              # an outlier key channel
    out, nbytes = apply_variant(kv, Variant("o", k_bits=7, k_outliers=1, v_bits=7,
                                            v_symmetric=True), 64)
    assert torch.equal(out[:, 0, :, 1, 5], kv[:, 0, :, 1, 5].half().float())
    k_bytes = 64 * 192 * 7 // 8 + 192 * 2 - 64 * 3 * 7 // 8 + 64 * 3 * 2 + 3
    v_bytes = 64 * 192 * 7 // 8 + 64 * 3 * 2
    assert nbytes == 2 * (k_bytes + v_bytes)


def test_layer_bits_override():
    kv = _kv()
    var = Variant("l", k_bits=8, v_bits=7, v_symmetric=True, layer_bits={0: (8, 8)})
    out, nbytes = apply_variant(kv, var, 64)
    ref8, _ = fake_quant(kv[0, 1], 8, -1, True)
    ref7, _ = fake_quant(kv[1, 1], 7, -1, True)
    assert torch.equal(out[0, 1], ref8) and torch.equal(out[1, 1], ref7)
    assert nbytes == (64 * 192 + 384) * 2 + (64 * 192 + 384) + (64 * 192 * 7 // 8 + 384)


def test_diffused_rounding_keeps_running_sum():
    v = _kv(seed=3)[0, 1]                                                # [T, H, D]
    diff, nb = fake_quant_diffused(v, 7)
    plain, nb_plain = fake_quant(v, 7, -1, True)
    assert nb == nb_plain
    s = (v.abs().amax(-1, keepdim=True) / 63).half().float()
    run_diff = (diff - v).cumsum(0).abs()
    run_plain = (plain - v).cumsum(0).abs()
    assert float(run_diff.max()) <= float(s.max())                        # about one step
    assert float(run_diff.max()) < float(run_plain.max()) / 2


def _rope_config():
    from types import SimpleNamespace
    return SimpleNamespace(head_dim=64, rope_theta=100000.0, rope_scaling=None)


def test_prerope_keys_are_quantized_at_their_pre_rope_values():
    from bench.codec_fake import _rotate, set_rotary
    set_rotary(_rope_config())
    kv = _kv()
    pre = kv[:, 0].clone()                                              # [L, T, H, D] pre-RoPE keys
    for layer in range(kv.shape[0]):
        kv[layer, 0] = _rotate(pre[layer], 128, inverse=False)          # chunk starts at 128
    assert torch.allclose(_rotate(kv[0, 0], 128, inverse=True), pre[0], atol=1e-5)
    var = Variant("r", k_bits=8, v_bits=7, v_symmetric=True, k_prerope=True)
    out, nbytes = apply_variant(kv, var, 128)
    plain, nplain = apply_variant(kv, Variant("p", k_bits=8, v_bits=7, v_symmetric=True), 128)
    assert nbytes == nplain                                             # same codes and scales
    want = _rotate(fake_quant(pre[1], 8, 0, True)[0], 128, inverse=False)
    assert torch.allclose(out[1, 0], want, atol=1e-5)
    assert torch.equal(out[:, 1], plain[:, 1])                          # values untouched
    assert not torch.allclose(out[:, 0], plain[:, 0], atol=1e-4)        # a different rounding


def test_fp16_tokens_leave_the_key_ranges_and_are_counted():
    kv = _kv(L=1)
    kv[0, 0, 10] *= 50.0                                                # token 10 stretches every channel
    base = Variant("b", k_bits=8, v_bits=7, v_symmetric=True)
    var = Variant("t", k_bits=8, v_bits=7, v_symmetric=True, fp16_tokens=1)
    out, nbytes = apply_variant(kv, var, 64)
    ref, nref = apply_variant(kv, base, 64)
    assert torch.equal(out[0, :, 10], kv[0, :, 10].half().float())       # kept whole, K and V
    others = torch.arange(64) != 10
    err = (out[0, 0, others] - kv[0, 0, others]).abs().max()
    err_ref = (ref[0, 0, others] - kv[0, 0, others]).abs().max()
    assert err < err_ref / 10                                            # ranges without token 10
    assert nbytes == nref + 2 * 3 * 64 * 2 + 1                           # K+V fp16 + 1 index byte

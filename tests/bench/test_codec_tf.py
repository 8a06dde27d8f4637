"""bench.codec_tf's format specs, one-layer variants and per-position figures (no model)."""
import pytest
import torch

from bench.codec_fake import apply_variant
from bench.codec_tf import compare, layer_only, parse_spec, quantizer


def test_parse_spec_and_its_bytes():
    v = parse_spec("k8a-v7-s4-V8@0.29-K7@3")
    assert (v.k_bits, v.k_asym, v.v_bits, v.v_symmetric, v.sinks) == (8, True, 7, True, 4)
    assert v.layer_bits == {0: (8, 8), 29: (8, 8), 3: (7, 7)}
    assert parse_spec("fp16") is None and parse_spec("k8") is None
    r = parse_spec("k8a-v7-s4-r-t2")
    assert (r.k_prerope, r.fp16_tokens, r.sinks) == (True, 2, 4)
    assert (v.k_prerope, v.fp16_tokens) == (False, 0)
    kv = torch.randn(2, 2, 64, 3, 64, generator=torch.Generator().manual_seed(0))
    _, plain = apply_variant(kv, parse_spec("k8-v7"), 64)
    _, more = apply_variant(kv, parse_spec("k8-v7-V8@1"), 64)
    assert more - plain == 64 * 3 * 64 // 8                  # one more bit per V value of layer 1
    with pytest.raises(ValueError, match="unknown variant"):
        quantizer("nope")


def test_layer_only_touches_one_layer_and_part():
    kv = torch.randn(3, 2, 64, 3, 64, generator=torch.Generator().manual_seed(1))
    out = layer_only(kv, 1, 4, None)
    assert torch.equal(out[0], kv[0]) and torch.equal(out[2], kv[2])
    assert torch.equal(out[1, 1], kv[1, 1]) and not torch.equal(out[1, 0], kv[1, 0])
    got, nbytes = quantizer("L1V4")(kv, 0)
    assert torch.equal(got[1, 0], kv[1, 0]) and not torch.equal(got[1, 1], kv[1, 1])
    assert torch.equal(got[1, 1, :4], kv[1, 1, :4])            # a sequence's sinks: exact
    later, _ = quantizer("L1V4")(kv, 64)                        # a later chunk: no sinks
    assert not torch.equal(later[1, 1, :4], kv[1, 1, :4])
    assert nbytes == kv.numel() * 2


def test_compare_margin_change_kl_and_flips():
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 1.01]])
    got = torch.tensor([[2.0, 1.5, 0.0], [0.0, 1.02, 1.01]])
    r = compare(ref, got)
    assert r["dmargin"].tolist() == pytest.approx([0.5, 0.02])
    assert r["flip"].tolist() == [False, True]
    assert r["margin"].tolist() == pytest.approx([1.0, 0.01])
    assert float(compare(ref, ref)["kl"].abs().max()) < 1e-6 and float(r["kl"][0]) > 0.01

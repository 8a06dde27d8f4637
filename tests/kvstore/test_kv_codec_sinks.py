"""``kivi`` sink tokens (``kvstore.kv_grouped``, ``kvstore.kv_codec``): the first tokens of a
prompt's first chunk kept in fp16 (fp32 when they overflow it) after the codes (which code
them as 0, so they leave the other tokens' K steps alone), decoded as stored; exact sizes; the stored value of a chunk with no parent keeps them and one
with a parent does not; payloads without sinks are the old bytes; tails that lie are refused."""
import os

import numpy as np
import pytest
import torch

from kvstore import kv_casts, kv_codec, kv_grouped, kv_grouped_decode
from kvstore.codec import _TRAILER, pack_value, unpack_value

SHAPE = (2, 2, 16, 2, 8)  # [num_layers, k/v, chunk_size, num_kv_heads, head_dim]
N = kv_codec.SINK_TOKENS
KEY, PARENT = bytes(range(48)), bytes(range(1, 49))
FIXTURE = os.path.join(os.path.dirname(__file__), "data", "kv_codec_v1.npz")


def kv_of(dtype=torch.float32, seed=0, shape=SHAPE):
    """Random KV with an outlier key channel and large first tokens (as attention sinks are)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=g)
    kv[:, 0, :, 0, 3] *= 30
    kv[:, :, :2] *= 8
    return kv.to(dtype)


def round_trip(kv, sink_tokens):
    payload = kv_codec.encode(kv, "kivi", sink_tokens)
    return payload, kv_codec.decode(payload, "kivi", kv.dtype, tuple(kv.shape))


def zeroed(kv, n=N):
    """``kv`` with its first ``n`` tokens of K and V set to 0 (what the codes of a payload
    with ``n`` sinks encode)."""
    z = kv.clone()
    z[:, :, :n] = 0
    return z


def test_sink_bit_count_byte_and_sizes():
    """K mode bit 2 set, the count before the 7 parameter bytes, the steps and codes those of
    the chunk with the sinks set to 0, sizes exactly nbytes's: L * 2 * n * H * D fp16 values +
    1 byte more than without sinks."""
    kv = kv_of()
    plain, _ = round_trip(zeroed(kv), 0)
    payload, _ = round_trip(kv, N)
    L, _, T, H, D = SHAPE
    assert payload.size == plain.size + L * 2 * N * H * D * 2 + 1
    assert payload.size == kv_codec.payload_nbytes("kivi", SHAPE, 2, N)
    assert payload.size == kv_grouped.nbytes(kv_codec.KIVI_PARAMS, SHAPE, 2, N, 2)
    assert payload[-5] == plain[-5] | 4 and payload[-8] == N
    assert np.array_equal(np.delete(payload[-7:], 2), np.delete(plain[-7:], 2))
    body = plain.size - 7                                  # steps and codes: the same bytes
    assert np.array_equal(payload[:body], plain[:body])
    sinks = payload[body:body + L * 2 * N * H * D * 2].view("<f2").reshape(L, 2, N, H, D)
    assert np.array_equal(sinks, kv[:, :, :N].numpy().astype(np.float16))
    # more sink tokens than the chunk has: all of its tokens, the count says how many
    short = kv[:, :, :3]
    p3 = kv_codec.encode(short, "kivi", N)
    assert p3[-8] == 3 and p3.size == kv_codec.payload_nbytes("kivi", tuple(short.shape), 2, 3)
    assert kv_codec.payload_nbytes("int8", SHAPE, 2, N) == kv_codec.payload_nbytes("int8", SHAPE)
    with pytest.raises(ValueError, match="0-255"):
        kv_codec.encode(kv, "kivi", 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sinks_decode_as_stored_and_the_rest_within_the_kivi_bound(dtype):
    kv = kv_of(dtype)
    _, out = round_trip(kv, N)
    _, plain = round_trip(kv, 0)
    x = kv.float()
    # the sink tokens: x in fp16, then in the chunk's dtype; the other tokens as when the
    # sinks are 0 (left out of their K channels' ranges)
    assert torch.equal(out[:, :, :N], x[:, :, :N].half().to(dtype))
    assert torch.equal(out[:, :, N:], round_trip(zeroed(kv), 0)[1][:, :, N:])
    assert not torch.equal(plain[:, :, :N], out[:, :, :N])
    # the large first tokens no longer set the K steps of the other tokens of their channels
    k_with, k_without = (kv_codec.error_bound(kv, "kivi", n)[:, 0, N:] for n in (0, N))
    assert bool((k_without <= k_with).all()) and float(k_without.sum()) < 0.5 * float(k_with.sum())
    half_ulp = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
    bound = kv_codec.error_bound(kv, "kivi", N) + out.float().abs() * half_ulp[dtype] + 1e-12
    err = (out.float() - x).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    # the sink bound is fp16's, far below the kivi step where the tokens are large
    sink_bound = kv_codec.error_bound(kv, "kivi", N)[:, :, :N]
    assert float(sink_bound.max()) < float(kv_codec.error_bound(kv, "kivi")[:, :, :N].max()) / 4
    if dtype == torch.float32:
        assert float(err[:, :, :N].max()) > 0             # fp16 rounding: not the identity


def test_small_sinks_round_within_fp16_subnormal_spacing():
    kv = kv_of() * 1e-6                                    # fp16 subnormals (below 6.1e-5)
    _, out = round_trip(kv, N)
    err = (out - kv).abs()[:, :, :N]
    assert torch.equal(out[:, :, :N], kv[:, :, :N].half().float())
    assert bool((err <= kv_codec.error_bound(kv, "kivi", N)[:, :, :N]).all())
    assert float(err.max()) > 2.0 ** -27                   # the subnormal term is needed


def test_a_sink_beyond_fp16_is_stored_fp32_exactly():
    kv = kv_of()
    kv[1, 1, 2, 0, 5] = 1e5                                # a V sink fp16 cannot hold
    payload, out = round_trip(kv, N)
    assert payload[-5] & 12 == 12 and payload[-1] == 1     # sinks fp32; scales fp32 too
    assert payload.size == kv_codec.payload_nbytes("kivi", SHAPE, 4, N, 4)
    assert torch.equal(out[:, :, :N], kv[:, :, :N])
    assert bool(((out - kv).abs() <= kv_codec.error_bound(kv, "kivi", N)
                 + out.abs() * 2 ** -24).all())
    assert float(kv_codec.error_bound(kv, "kivi", N)[1, 1, 2, 0, 5]) == pytest.approx(
        1e5 * 2 ** -24, rel=1e-3)


def test_decoding_in_blocks_of_layers_keeps_the_sinks(monkeypatch):
    kv = kv_of(shape=(5, 2, 64, 2, 16))
    payload, whole = round_trip(kv, N)
    assert kv_grouped_decode.Decoder(payload, tuple(kv.shape)).blockable
    monkeypatch.setattr(kv_casts, "BLOCK_ELEMS", kv[0].numel())
    assert len(kv_casts.layer_blocks(5, kv[0].numel())) == 5
    out = kv_codec.decode(payload, "kivi", torch.float32, tuple(kv.shape))
    assert torch.equal(out, whole) and torch.equal(out[:, :, :N], kv[:, :, :N].half().float())


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_stored_value_without_parent_keeps_the_sinks_and_one_with_a_parent_does_not(dtype):
    kv = kv_of(getattr(torch, dtype))
    raw = kv.reshape(-1).view(torch.uint8).numpy()
    first = pack_value(KEY, None, raw, dtype, SHAPE, "kivi")
    later = pack_value(KEY, PARENT, raw, dtype, SHAPE, "kivi")
    h1, r1 = unpack_value(first, KEY)
    h2, r2 = unpack_value(later, KEY)
    got1 = torch.from_numpy(r1).view(kv.dtype).view(SHAPE)
    got2 = torch.from_numpy(r2).view(kv.dtype).view(SHAPE)
    assert torch.equal(got1[:, :, :N], kv[:, :, :N].half().to(kv.dtype))
    assert torch.equal(got1, round_trip(kv, N)[1]) and torch.equal(got2, round_trip(kv, 0)[1])
    assert not torch.equal(got2[:, :, :N], got1[:, :, :N])
    assert len(first) - h1.payload_offset - _TRAILER.size == kv_codec.payload_nbytes(
        "kivi", SHAPE, 2, N)
    assert len(later) - h2.payload_offset - _TRAILER.size == kv_codec.payload_nbytes("kivi", SHAPE)
    # int8 and fp8 ignore sinks: a parentless value is the same size
    for codec in ("int8", "fp8"):
        a, b = pack_value(KEY, None, raw, dtype, SHAPE, codec), pack_value(KEY, PARENT, raw,
                                                                            dtype, SHAPE, codec)
        assert len(b) - len(a) == len(PARENT)


def test_fixture_payloads_have_no_sinks_and_read_as_before():
    with np.load(FIXTURE) as f:
        names = [k for k in f.files if k.endswith(".kivi.payload")]
        assert len(names) == 5
        for k in names:
            assert kv_grouped.read_sinks(f[k]) == (0, np.dtype(np.float16))
            assert f[k][-5] & 12 == 0


def test_tails_that_claim_sinks_wrongly_are_refused():
    kv = kv_of()
    plain, _ = round_trip(kv, 0)
    payload, _ = round_trip(kv, N)
    bad = plain.copy()
    bad[-5] |= 4                                           # claims sinks: too short for them
    with pytest.raises(ValueError, match="needs"):
        kv_codec.decode(bad, "kivi", torch.float32, SHAPE)
    bad = payload.copy()
    bad[-8] = 0                                            # a count of none
    with pytest.raises(ValueError, match="records none"):
        kv_codec.decode(bad, "kivi", torch.float32, SHAPE)
    bad = plain.copy()
    bad[-5] |= 8                                           # fp32 sinks without sinks
    with pytest.raises(ValueError, match="parameter block"):
        kv_codec.decode(bad, "kivi", torch.float32, SHAPE)
    bad = payload.copy()
    bad[-5] |= 16                                          # an unknown k_mode bit
    with pytest.raises(ValueError, match="parameter block"):
        kv_codec.decode(bad, "kivi", torch.float32, SHAPE)
    bad = payload.copy()
    bad[-2] |= 4                                           # sink bits are k_mode's only
    with pytest.raises(ValueError, match="parameter block"):
        kv_codec.decode(bad, "kivi", torch.float32, SHAPE)
    with pytest.raises(ValueError, match="needs"):       # one sink byte missing
        kv_codec.decode(np.delete(payload, plain.size - 7), "kivi", torch.float32, SHAPE)
    with pytest.raises(ValueError, match="needs"):       # sinks dropped, the bit kept
        kv_codec.decode(np.concatenate([payload[:plain.size - 7], payload[-8:]]), "kivi",
                        torch.float32, SHAPE)
    bad = payload.copy()
    bad[-8] = 17                                           # more sinks than the chunk's tokens
    with pytest.raises(ValueError, match="chunk_size is 16"):
        kv_codec.decode(bad, "kivi", torch.float32, SHAPE)
    with pytest.raises(ValueError, match="records none"):
        kv_grouped.read_sinks(np.array([8, 64, 5, 7, 64, 1, 0], dtype=np.uint8))

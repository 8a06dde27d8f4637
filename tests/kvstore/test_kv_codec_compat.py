"""Lossy payloads stay readable and encoders stay bit-stable: ``data/kv_codec_v1.npz`` holds
chunks with the payloads the earlier (slower) encoder wrote and the xxh3 of what its decoder
returned (``data/make_kv_codec_fixture.py``; ``kivi`` with V asymmetric, as it was then),
``data/kv_codec_v2.npz`` the ``kivi`` payloads with V symmetric (today's parameters);
today's decoder must return the same bits, and today's encoder, given the parameters a
payload records, write the same bytes. Also the bit-level casts of ``kvstore.kv_casts``
against torch's, and decoding in several blocks of layers against one block."""
import os

import numpy as np
import pytest
import torch

from kvstore import kv_casts, kv_codec, kv_grouped, kv_grouped_decode
from kvstore.codec import checksum

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "kv_codec_v1.npz")
FIXTURE_V2 = os.path.join(os.path.dirname(__file__), "data", "kv_codec_v2.npz")
CASES = ("real_f32", "odd_f16", "odd_bf16", "special_f32", "big_f32")


@pytest.fixture(scope="module")
def fixture():
    with np.load(FIXTURE) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def fixture_v2():
    with np.load(FIXTURE_V2) as f:
        return {k: f[k] for k in f.files}


def _case(fx, name):
    dtype = getattr(torch, str(fx[f"{name}.dtype"]))
    shape = tuple(int(v) for v in fx[f"{name}.shape"])
    kv = torch.from_numpy(fx[f"{name}.input"].copy()).view(dtype).view(shape)
    return kv, dtype, shape


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _check_payload(fx, name, codec, monkeypatch):
    kv, dtype, shape = _case(fx, name)
    payload = fx[f"{name}.{codec}.payload"]
    out = kv_codec.decode(payload, codec, dtype, shape)
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert checksum(_bits(out)) == int(fx[f"{name}.{codec}.decoded_xxh3"])
    if codec == "kivi":                       # encode with the parameters it records
        monkeypatch.setattr(kv_codec, "KIVI_PARAMS", kv_grouped.read_params(payload)[0])
        monkeypatch.setattr(kv_codec, "KIVI_LAYER_BITS", {})
    assert kv_codec.encode(kv, codec).tobytes() == payload.tobytes()


@pytest.mark.parametrize("codec", kv_codec.LOSSY_CODECS)
@pytest.mark.parametrize("name", CASES)
def test_stored_payloads_decode_bit_identically(fixture, name, codec, monkeypatch):
    _check_payload(fixture, name, codec, monkeypatch)


@pytest.mark.parametrize("name", CASES)
def test_kivi_payloads_with_symmetric_values_decode_bit_identically(fixture, fixture_v2, name,
                                                                  monkeypatch):
    """Today's kivi parameters write the v2 payloads; v1's kivi payloads record V with a zero
    point and both parts' steps as 8-bit codes (k_mode 2: symmetric; v_mode 1: along
    channels), v2's V symmetric and fp16/fp32 steps (mode bits 1 symmetric, 5 fp steps)."""
    v1, v2 = fixture[f"{name}.kivi.payload"], fixture_v2[f"{name}.kivi.payload"]
    assert kv_grouped.read_params(v2)[0] == kv_codec.KIVI_PARAMS
    assert v1[-7:-1].tolist() == [8, 64, 2, 7, 64, 1]
    assert v2[-7:-1].tolist() == [8, 64, 2 | 32, 7, 64, 1 | 2 | 32]
    assert np.array_equal(fixture_v2[f"{name}.input"], fixture[f"{name}.input"])
    _check_payload(fixture_v2, name, "kivi", monkeypatch)


def test_fixture_covers_the_edge_cases(fixture):
    """The fixture exercises fp32 scales (code 1), e4m3 subnormal codes and all-zero groups."""
    assert fixture["big_f32.int8.payload"][-1] == 1 and fixture["big_f32.kivi.payload"][-1] == 1
    n = int(np.prod(fixture["special_f32.shape"]))
    codes = fixture["special_f32.fp8.payload"][-1 - n:-1] & 0x7F
    assert ((codes > 0) & (codes < 8)).sum() > 50 and (codes == 0).sum() > 50


@pytest.mark.parametrize("codec", kv_codec.LOSSY_CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_blocks_of_layers_change_nothing(monkeypatch, codec, dtype):
    """Encode and decode cut in blocks of 1 or 2 layers give the bytes and bits of one block
    (a chunk of 5 layers; kivi with a layer's codes in whole bytes, so it is cut too)."""
    kv = (torch.randn((5, 2, 64, 2, 16), generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    kv[1, 0, :, 0, 2] *= 40                                    # an outlier key channel
    shape = tuple(kv.shape)
    whole = kv_codec.encode(kv, codec)
    dec = kv_codec.decode(whole, codec, dtype, shape)
    for per_block in (1, 2):
        monkeypatch.setattr(kv_casts, "BLOCK_ELEMS", per_block * kv[0].numel())
        assert len(kv_casts.layer_blocks(5, kv[0].numel())) == -(-5 // per_block)
        assert kv_codec.encode(kv, codec).tobytes() == whole.tobytes()
        assert np.array_equal(_bits(kv_codec.decode(whole, codec, dtype, shape)), _bits(dec))
    assert kv_grouped_decode.Decoder(kv_codec.encode(kv, "kivi"), shape).blockable


def _e4m3_inputs() -> np.ndarray:
    """Every e4m3 value, the midpoints between neighbours (ties), one fp32 ulp either side
    of each, fp32 subnormals and random values below 464 in magnitude, both signs."""
    vals = np.sort(np.unique(kv_casts.E4M3_TABLE[np.isfinite(kv_casts.E4M3_TABLE)]))
    pos = vals[vals >= 0]
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    nxt = np.concatenate([mids, [np.float32(464) * (1 - 2 ** -23)]])
    around = np.concatenate([nxt, np.nextafter(nxt, np.float32(0)), np.nextafter(nxt, np.float32(1e9)),
                             pos, np.nextafter(pos[1:], np.float32(0)), np.nextafter(pos, np.float32(1e9))])
    g = np.random.default_rng(0)
    rand = np.concatenate([g.uniform(0, 463.9, 200_000), 2.0 ** g.uniform(-30, -5, 200_000),
                           np.array([1e-45, 1e-40, 2.0 ** -126, 0.0])]).astype(np.float32)
    x = np.concatenate([around, rand]).astype(np.float32)
    x = x[x < 464]
    return np.concatenate([x, -x])


def test_to_e4m3_matches_torch():
    x = _e4m3_inputs()
    out = np.empty(x.size, dtype=np.uint8)
    kv_casts.to_e4m3(x, out)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(out, want)


def test_to_bf16_bits_matches_torch():
    g = np.random.default_rng(1)
    u = g.integers(0, 2 ** 32, 400_000, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32)
    x = np.concatenate([x[np.isfinite(x)], np.array([np.inf, -np.inf, 3.4028235e38, -0.0, 0.0],
                                                   dtype=np.float32)])
    for tie in (0x3F808000, 0x3F818000, 0x7F7F8000):          # ties: to even, and to inf
        x = np.append(x, np.array([tie], dtype=np.uint32).view(np.float32))
    out = np.empty(x.size, dtype=np.uint16)
    kv_casts.to_bf16_bits(x, out)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out, want)
    kv_casts.to_bf16_bits(np.array([np.nan], dtype=np.float32), out[:1])
    assert out[0] == 0x7FC0

"""Lossy KV codecs (``kvstore.kv_codec``) and their stored values (``kvstore.codec``): round
trips within each codec's stated bound on random and on structured KV (outlier key channels),
exact sizes, fallbacks, headers that lie, and the namespace field that accepts loss."""
import numpy as np
import pytest
import torch

from kvstore import kv_codec, kv_grouped, kv_grouped_decode
from kvstore.codec import CODECS, HEADER_BYTES_MAX, CorruptChunkError, _FIXED, _TRAILER, \
    checksum, pack_value, unpack_header, unpack_value
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

KEY = bytes(range(48))
SHAPE = (2, 2, 16, 2, 8)  # [num_layers, k/v, chunk_size, num_kv_heads, head_dim]
ULP = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def random_kv(dtype=torch.float32, seed=0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def outlier_kv(dtype=torch.float32):
    """Keys with two outlier channels (head_dim index 3 of head 0 and 5 of head 1, 50x the
    others), values without."""
    kv = random_kv(torch.float32, 1)
    kv[:, 0, :, 0, 3] *= 50
    kv[:, 0, :, 1, 5] *= 50
    return kv.to(dtype)


def assert_within_bound(kv, codec):
    out = kv_codec.decode(kv_codec.encode(kv, codec), codec, kv.dtype, tuple(kv.shape))
    assert out.dtype == kv.dtype and tuple(out.shape) == tuple(kv.shape)
    err = (kv.float() - out.float()).abs()
    # the stated bound, plus the rounding of x̂ to the chunk's dtype (half an ulp of x̂; for a
    # subnormal x̂, half the subnormal spacing)
    half_ulp = torch.clamp(out.float().abs(), min=torch.finfo(kv.dtype).tiny) * ULP[kv.dtype]
    bound = kv_codec.error_bound(kv, codec) + half_ulp + 1e-12
    assert bool((err <= bound).all()), float((err - bound).max())
    return out, err


@pytest.mark.parametrize("codec", kv_codec.LOSSY_CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_within_the_stated_bound(codec, dtype):
    for kv in (random_kv(dtype), outlier_kv(dtype), random_kv(dtype, 2) * 1e-3):
        out, err = assert_within_bound(kv, codec)
        assert 0 < float(err.max())             # lossy: not the identity


def test_int8_bound_is_half_a_scale_and_fp8_is_relative_to_the_group_amax():
    kv = random_kv()
    _, err = assert_within_bound(kv, "int8")
    v_scale = kv[:, 1].abs().amax(-1, keepdim=True).half().float() / 127  # roughly the stored one
    assert bool((err[:, 1] <= v_scale * 0.5 * (1 + 2 ** -10)).all())
    _, err = assert_within_bound(kv, "fp8")
    amax = kv.abs().amax(-1, keepdim=True)                              # per (layer, kv, token, head)
    assert bool((err <= amax / 16 + 1e-6).all())


def test_int8_keys_per_channel_scales_keep_normal_channels_precise_beside_outliers():
    kv = outlier_kv()
    out, err = assert_within_bound(kv, "int8")
    normal = torch.ones(SHAPE[2:], dtype=torch.bool)                    # [T, H, D]
    normal[:, 0, 3] = normal[:, 1, 5] = False
    k_err = err[:, 0]                                                   # [L, T, H, D]
    # per-channel: a normal channel's step is its own amax/127 (~0.03), not the outliers'
    # (~1.3); a per-token key scale would have errors up to ~0.65 on every channel
    assert float(k_err[:, normal].max()) < 0.02
    assert float(k_err[:, ~normal].max()) > 0.1


def test_exact_values_of_a_small_int8_chunk():
    kv = torch.zeros(1, 2, 2, 1, 2)                      # [L, k/v, T, H, D]
    kv[0, 0, :, 0, 0] = torch.tensor([1.0, -0.5])        # K channel 0: amax 1
    kv[0, 1, 0, 0, :] = torch.tensor([2.54, -1.27])      # V token 0: amax 2.54; K channel 1,
    payload = kv_codec.encode(kv, "int8")                # V token 1: all zero
    assert len(payload) == kv_codec.payload_nbytes("int8", (1, 2, 2, 1, 2)) == 4 + 4 + 8 + 1
    # scales: amax / 127 rounded up to fp16 (1/127 = 0.0078740 -> 0.0078812; 2.54/127 = 0.02
    # -> 0.0200043); K per channel [L, H, D], then V per token [L, T, H]; 0 for zero groups
    assert np.frombuffer(payload[:8], np.float16).tolist() == [
        0.00788116455078125, 0.0, 0.0200042724609375, 0.0]
    # values [k/v, T, D]: 1/0.0078812 = 126.9 -> 127, -0.5/0.0078812 = -63.4 -> -63,
    # -1.27/0.0200043 = -63.49 -> -63
    assert payload[8:16].view(np.int8).tolist() == [127, 0, -63, 0, 127, -63, 0, 0]
    assert payload[-1] == 0                              # fp16 scales
    out = kv_codec.decode(payload, "int8", torch.float32, (1, 2, 2, 1, 2))
    assert out.flatten().tolist() == [127 * 0.00788116455078125, 0.0, -63 * 0.00788116455078125,
                                      0.0, 127 * 0.0200042724609375, -63 * 0.0200042724609375,
                                      0.0, 0.0]


def test_payload_sizes_and_ratio_to_fp16():
    shape = (30, 2, 256, 3, 64)   # SmolLM2-135M, chunk_size 256
    n = 30 * 2 * 256 * 3 * 64
    assert kv_codec.payload_nbytes("int8", shape) == n + 2 * (30 * 3 * 64 + 30 * 256 * 3) + 1
    assert kv_codec.payload_nbytes("fp8", shape) == n + 2 * (30 * 2 * 256 * 3) + 1
    assert kv_codec.payload_nbytes("int8", shape) / (2 * n) == pytest.approx(
        0.5 + (1 / 256 + 1 / 64) / 2, abs=1e-6)
    kv = random_kv(shape=(2, 2, 256, 3, 64))
    assert len(kv_codec.encode(kv, "int8")) == kv_codec.payload_nbytes("int8", tuple(kv.shape))


def test_scales_switch_to_fp32_when_fp16_cannot_hold_them():
    kv = random_kv() * 1e7                               # amax/127 > 65504
    payload = kv_codec.encode(kv, "int8")
    assert payload[-1] == 1 and len(payload) == kv_codec.payload_nbytes("int8", SHAPE, 4)
    assert_within_bound(kv, "int8")
    assert kv_codec.encode(random_kv(), "int8")[-1] == 0


def test_bad_input_is_refused():
    bad = random_kv()
    bad[0, 1, 3, 0, 0] = float("inf")
    for codec in kv_codec.LOSSY_CODECS:
        with pytest.raises(ValueError, match="non-finite"):
            kv_codec.encode(bad, codec)
    with pytest.raises(ValueError, match="unknown lossy codec"):
        kv_codec.encode(random_kv(), "int4")
    with pytest.raises(ValueError, match=r"num_layers, 2"):
        kv_codec.encode(torch.zeros(2, 3, 4, 1, 2), "int8")
    with pytest.raises(ValueError, match="needs"):
        kv_codec.decode(kv_codec.encode(random_kv(), "int8")[1:], "int8", torch.float32, SHAPE)


def _raw(kv):
    return kv.reshape(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("codec", kv_codec.LOSSY_CODECS)
def test_stored_value_records_the_codec_and_the_checksum_of_the_decoded_bytes(codec):
    kv = outlier_kv(torch.float16)
    value = pack_value(KEY, None, _raw(kv), "float16", SHAPE, codec)
    h, raw = unpack_value(value, KEY)
    sinks = kv_codec.SINK_TOKENS if codec == "kivi" else 0  # no parent: kivi keeps the sinks
    want = kv_codec.decode(kv_codec.encode(kv, codec, sinks), codec, torch.float16, SHAPE)
    assert h.codec == codec and CODECS.index(codec) == {"int8": 3, "fp8": 4, "kivi": 5}[codec]
    assert h.raw_nbytes == kv.numel() * 2 and h.checksum == checksum(_raw(want))
    assert np.array_equal(raw, _raw(want))
    assert len(value) == (h.payload_offset + kv_codec.payload_nbytes(codec, SHAPE, 2, sinks)
                          + _TRAILER.size)


def test_a_chunk_a_lossy_codec_cannot_encode_is_stored_exactly():
    kv = random_kv(torch.float16)
    kv[0, 0, 0, 0, 0] = float("nan")
    value = pack_value(KEY, None, _raw(kv), "float16", SHAPE, "int8", fallback="auto")
    h, raw = unpack_value(value, KEY)
    assert h.codec in ("raw", "shuffle-lz4") and np.array_equal(raw, _raw(kv))
    f8 = torch.zeros(SHAPE, dtype=torch.float8_e4m3fn)
    h, _ = unpack_value(pack_value(KEY, None, _raw(f8), "float8_e4m3fn", SHAPE, "fp8"), KEY)
    assert h.codec == "raw"


def _with_codec(value: bytes, codec: str) -> bytes:
    """``value`` with its header's codec replaced and a valid trailer (a consistent liar)."""
    body = bytearray(value[:-_TRAILER.size])
    body[_FIXED.size - 5 * 4 - 8 - 8 - 2] = CODECS.index(codec)  # the codec byte
    return bytes(body) + _TRAILER.pack(checksum(bytes(body)))


def test_a_header_that_lies_about_its_codec_is_a_miss():
    kv = random_kv(torch.float16)
    for stored, claimed in (("raw", "int8"), ("raw", "fp8"), ("int8", "fp8"), ("fp8", "int8"),
                            ("int8", "raw"), ("raw", "kivi"), ("kivi", "int8"), ("int8", "kivi"),
                            ("kivi", "fp8"), ("kivi", "raw")):
        value = _with_codec(pack_value(KEY, None, _raw(kv), "float16", SHAPE, stored), claimed)
        assert unpack_header(value).codec == claimed
        with pytest.raises(CorruptChunkError):
            unpack_value(value, KEY)
    good = pack_value(KEY, None, _raw(kv), "float16", SHAPE, "int8")
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1
    with pytest.raises(CorruptChunkError, match="checksum"):
        unpack_value(bytes(flipped), KEY)


def test_namespace_lossy_codec_is_in_the_digest_only_when_set():
    lay = KVLayout(2, 2, 8, "float16", 16)
    exact, lossy = Namespace("m", lay), Namespace("m", lay, lossy_codec="int8")
    assert "lossy_codec" not in exact.to_dict() and lossy.to_dict()["lossy_codec"] == "int8"
    # the bit-exact namespace's digest is the one it had before the field existed
    assert exact.digest == Namespace.from_dict({k: v for k, v in exact.to_dict().items()}).digest
    assert exact.ns_id != lossy.ns_id != Namespace("m", lay, lossy_codec="fp8").ns_id
    toks = list(range(32))
    assert not set(exact.chunk_keys(toks)) & set(lossy.chunk_keys(toks))
    assert Namespace.from_dict(lossy.to_dict()) == lossy
    assert "lossy_codec=int8" in lossy.describe()
    with pytest.raises(ValueError, match="unknown lossy_codec"):
        Namespace("m", lay, lossy_codec="int4")


# --- kivi: grouped asymmetric codes at fewer than 8 bits (kvstore.kv_grouped) -----------------

P = kv_grouped.PartParams


def test_pack_bits_puts_code_i_at_bit_bits_times_i_little_endian():
    codes = np.array([1, 2, 3, 4, 5, 6, 7, 0, 5], dtype=np.uint8)
    packed = kv_grouped.pack_bits(codes, 3)
    # 8 codes in 3 bytes, then the 9th zero-padded to 8 codes: 2 groups of 3 bytes
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes[:8]))  # 0o07654321
    assert packed.tolist() == list(word.to_bytes(3, "little")) + [5, 0, 0]
    rng = np.random.default_rng(0)
    for bits in range(1, 9):
        for n in (1, 8, 13, 1000):
            c = rng.integers(0, 2 ** bits, n, dtype=np.uint8)
            p = kv_grouped.pack_bits(c, bits)
            assert p.size == -(-n // 8) * bits
            assert np.array_equal(kv_grouped.unpack_bits(p, bits, n), c)


def test_exact_payload_of_a_small_kivi_chunk():
    kv = np.zeros((1, 2, 2, 1, 2), dtype=np.float32)     # [L, k/v, T, H, D]
    kv[0, 0, :, 0, 0] = [1.0, -0.5]                      # K channel 0 over 2 tokens
    kv[0, 1, 0, 0, :] = [2.5, -1.0]                      # V token 0 over 2 channels
    kv[0, 1, 1, 0, :] = [0.25, 0.75]                     # V token 1
    params = kv_grouped.GroupParams(P(2, 2, "tokens"), P(3, 2, "channels"))
    payload = kv_grouped.encode(kv, params)
    assert payload.size == kv_grouped.nbytes(params, kv.shape) == (4 + 2 + 4) * 2 + 2 + 3 + 7
    # K per channel [L, 1, H, D]: mins (fp16) -0.5 and 0; needed steps 1.5 / 3 = 0.5 and 0:
    # base 0.5 (fp32), step codes 0 (0.5 * 2**0) and 255 (the smallest step, for a zero range)
    assert payload[:4].view(np.float16).tolist() == [-0.5, 0.0]
    assert payload[4:6].tolist() == [0, 255] and payload[6:10].view("<f4").tolist() == [0.5]
    # V per token [L, T, H, 1]: mins -1 and 0.25; needed steps 3.5 / 7 = 0.5 and 0.5 / 7 =
    # 0.0714: base 0.5, codes 0 and floor(-16 * log2(0.0714 / 0.5)) = 44 (step 0.0743 >= 0.0714)
    assert payload[10:14].view(np.float16).tolist() == [-1.0, 0.25]
    assert payload[14:16].tolist() == [0, 44] and payload[16:20].view("<f4").tolist() == [0.5]
    step = float(kv_grouped.step_table(0.5)[44])
    assert step == pytest.approx(0.5 * 2 ** (-44 / 16)) and step >= 0.5 / 7
    # K codes [T, D] = [[3, 0], [0, 0]] at 2 bits; V codes [[7, 0], [0, 7]] at 3 bits
    # (0.5 / 0.0743 = 6.73 -> 7)
    assert payload[20:22].tolist() == [3, 0]
    assert payload[22:25].tolist() == list((7 | 7 << 9).to_bytes(3, "little"))
    assert payload[25:].tolist() == [2, 2, 0, 3, 2, 1, 0]  # params (mode 1: along channels)
    out = np.empty_like(kv)
    kv_grouped_decode.decode(payload, kv.shape, out)
    assert out[0, 0].ravel().tolist() == [1.0, 0.0, -0.5, 0.0]
    assert out[0, 1, 0].ravel().tolist() == [2.5, -1.0]
    assert out[0, 1, 1].ravel().tolist() == [0.25, np.float32(0.25) + np.float32(7 * step)]


def test_exact_payload_of_symmetric_values():
    """V symmetric at 3 bits (c = 3): a step per token, codes ``rint(x / s) + 3`` in [0, 6]."""
    kv = np.zeros((1, 2, 2, 1, 2), dtype=np.float32)     # [L, k/v, T, H, D]
    kv[0, 1, 0, 0, :] = [3.0, -1.0]                      # V token 0 over 2 channels
    kv[0, 1, 1, 0, :] = [0.25, -0.75]                    # V token 1
    params = kv_grouped.GroupParams(P(2, 2, "tokens", True), P(3, 2, "channels", True))
    payload = kv_grouped.encode(kv, params)
    assert payload.size == kv_grouped.nbytes(params, kv.shape) == (2 + 4) * 2 + 2 + 3 + 7
    # K all zero: step codes 0 and base 0; V needs amax / 3 = 1.0 and 0.25: base 1.0, codes 0
    # and 32 (1.0 * 2**(-32 / 16) = 0.25 exactly)
    assert payload[:6].tolist() == [0, 0, 0, 0, 0, 0]
    assert payload[6:8].tolist() == [0, 32] and payload[8:12].view("<f4").tolist() == [1.0]
    # K codes all c = 1 at 2 bits (0b01 each; 8 codes in 2 bytes, zero-padded); V codes
    # [[6, 2], [4, 0]] at 3 bits
    assert payload[12:14].tolist() == [0b01010101, 0]
    assert payload[14:17].tolist() == list((6 | 2 << 3 | 4 << 6 | 0 << 9).to_bytes(3, "little"))
    assert payload[17:].tolist() == [2, 2, 2, 3, 2, 3, 0]  # modes 2 (symmetric), 3 (+ channels)
    out = np.empty_like(kv)
    kv_grouped_decode.decode(payload, kv.shape, out)
    assert out[0, 0].ravel().tolist() == [0.0] * 4
    assert out[0, 1].ravel().tolist() == [3.0, -1.0, 0.25, -0.75]
    lying = payload.copy()
    lying[-2] = 1                                          # claims a minimum per V group
    with pytest.raises(ValueError, match="needs"):
        kv_grouped_decode.decode(lying, kv.shape, out)
    # fp_steps (kivi's): the same steps stored as fp16 in place of step codes and base
    params = kv_grouped.GroupParams(P(2, 2, "tokens", True, True), P(3, 2, "channels", True, True))
    fp = kv_grouped.encode(kv, params)
    assert fp.size == kv_grouped.nbytes(params, kv.shape) == 2 * 2 + 2 * 2 + 2 + 3 + 7
    assert fp[:4].view(np.float16).tolist() == [0.0, 0.0]
    assert fp[4:8].view(np.float16).tolist() == [1.0, 0.25]
    assert fp[8:13].tolist() == payload[12:17].tolist()   # the same codes
    assert fp[13:].tolist() == [2, 2, 2 | 32, 3, 2, 3 | 32, 0]
    kv_grouped_decode.decode(fp, kv.shape, out)
    assert out[0, 1].ravel().tolist() == [3.0, -1.0, 0.25, -0.75]
    for mode_at in (-5, -2):                   # K or V claims step codes: the size differs
        bad = fp.copy()
        bad[mode_at] &= ~32 & 0xFF
        with pytest.raises(ValueError, match="needs"):
            kv_grouped_decode.decode(bad, kv.shape, out)


def test_kivi_bytes_are_under_half_of_fp16_with_scales_and_header(monkeypatch):
    n64 = 30 * 2 * 64 * 3 * 64                            # SmolLM2-135M, chunk_size 64
    shape = (30, 2, 64, 3, 64)
    # K 8 bits + an fp16 step per channel and 64 tokens; V 7 bits + an fp16 step per token
    # over 64 channels (both symmetric: no minimum); 7 bytes of parameters
    assert kv_codec.payload_nbytes("kivi", shape) == (
        n64 // 2 * (8 + 7) // 8 + 2 * (30 * 3 * 64) + 2 * (30 * 64 * 3) + 7)
    assert (kv_codec.payload_nbytes("kivi", shape) + HEADER_BYTES_MAX) / (2 * n64) < 0.4845
    big = (30, 2, 256, 3, 64)
    assert kv_codec.payload_nbytes("kivi", big) / (2 * n64 * 4) < 0.4845
    # the measured alternative: K with a zero point (an fp16 minimum too) and per-layer bits
    # (15 per K and V value on average); per run of layers 7 bytes of parameters and 5 of
    # run table, + 2
    k = kv_codec.KIVI_PARAMS.k
    monkeypatch.setattr(kv_codec, "KIVI_PARAMS", kv_grouped.GroupParams(
        kv_grouped.PartParams(k.bits, k.group, k.along, False, k.fp_steps), kv_codec.KIVI_PARAMS.v))
    monkeypatch.setattr(kv_codec, "KIVI_LAYER_BITS", {30: kv_codec.KIVI_LAYER_BITS_30})
    per_layer = [kv_codec.KIVI_LAYER_BITS_30.get(i, (8, 7)) for i in range(30)]
    assert sum(k + v for k, v in per_layer) <= 30 * 15
    runs = kv_codec.kivi_runs(30)
    assert [p.k.bits for n, p in runs for _ in range(n)] == [k for k, _ in per_layer]
    assert kv_codec.payload_nbytes("kivi", shape) == (
        sum(64 * 3 * 64 * (k + v) // 8 for k, v in per_layer) + 4 * (30 * 3 * 64)
        + 2 * (30 * 64 * 3) + 12 * len(runs) + 2)
    assert (kv_codec.payload_nbytes("kivi", shape) + HEADER_BYTES_MAX) / (2 * n64) < 0.4845
    other = (24, 2, 64, 3, 64)                            # another model: K8, V7 in every layer
    assert kv_codec.payload_nbytes("kivi", other) == (
        n64 // 30 * 24 // 2 * (8 + 7) // 8 + 4 * (24 * 3 * 64) + 2 * (24 * 64 * 3) + 7)


def test_kivi_odd_shapes_and_other_parameters_round_trip_within_the_bound():
    kv = random_kv(shape=(3, 2, 50, 2, 37)) * 3           # groups that do not divide T or D
    x = kv.numpy()
    for params in (kv_codec.KIVI_PARAMS, kv_grouped.GroupParams(P(7, 10, "tokens"), P(5, 24, "channels")),
                   kv_grouped.GroupParams(P(1, 5, "channels"), P(3, 7, "tokens")),
                   kv_grouped.GroupParams(P(8, 64, "tokens", True), P(2, 9, "channels", True))):
        payload = kv_grouped.encode(x, params)
        out = np.empty_like(x)
        kv_grouped_decode.decode(payload, x.shape, out)
        err = np.abs(out - x)
        assert (err <= kv_grouped.steps(x, params) / 2 * (1 + 2 ** -12) + np.abs(out) * 2 ** -24).all()
        assert err.max() > 0


def test_kivi_payloads_record_their_parameters(monkeypatch):
    """A payload written with other parameters (an older setting) still decodes."""
    kv = outlier_kv()
    old = kv_grouped.GroupParams(P(8, 16, "tokens"), P(8, 16, "channels"))
    monkeypatch.setattr(kv_codec, "KIVI_PARAMS", old)
    payload = kv_codec.encode(kv, "kivi")
    bound = kv_codec.error_bound(kv, "kivi")
    monkeypatch.undo()
    assert kv_codec.KIVI_PARAMS != old
    out = kv_codec.decode(payload, "kivi", torch.float32, SHAPE)
    assert bool(((out - kv).abs() <= bound + out.abs() * 2 ** -24).all())
    bad = payload.copy()
    bad[-4] = 17                                          # v_bits 17: not a parameter block
    with pytest.raises(ValueError, match="parameter block"):
        kv_codec.decode(bad, "kivi", torch.float32, SHAPE)
    with pytest.raises(ValueError, match="needs"):
        kv_codec.decode(payload[1:], "kivi", torch.float32, SHAPE)


@pytest.mark.parametrize("scale", [1e-38, 3e-39])
@pytest.mark.parametrize("codec", ["kivi", "int8", "fp8"])
def test_values_near_the_smallest_normal_float_round_trip_within_the_bound(codec, scale):
    """Groups whose step is an fp32 subnormal (1 / step overflows) are divided, not
    multiplied by an infinite reciprocal (kivi coded such groups as NaN cast to uint8)."""
    torch.manual_seed(0)
    shape = (2, 2, 64, 3, 64)
    kv = torch.randn(shape) * scale
    out = kv_codec.decode(kv_codec.encode(kv, codec), codec, torch.float32, shape)
    assert torch.isfinite(out).all()
    assert ((out - kv).abs() <= kv_codec.error_bound(kv, codec)).all()

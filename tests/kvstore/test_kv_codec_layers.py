"""``kvstore.kv_grouped_layers``: a chunk in runs of layers, each a ``kv_grouped`` payload of
its own parameters: exact sizes, each run's bytes and decoded values those of ``kv_grouped``
on its layers, any block of layers decodes as the whole, bad tables are refused."""
import numpy as np
import pytest
import torch

from kvstore import kv_grouped, kv_grouped_decode, kv_grouped_layers as kgl

SHAPE = (5, 2, 16, 2, 8)  # [num_layers, k/v, chunk_size, num_kv_heads, head_dim]
K8 = kv_grouped.PartParams(8, 16, "tokens", symmetric=True, fp_steps=True)
V7 = kv_grouped.GroupParams(K8, kv_grouped.PartParams(7, 8, "channels", symmetric=True,
                                                      fp_steps=True))
V8 = kv_grouped.GroupParams(K8, kv_grouped.PartParams(8, 8, "channels", symmetric=True,
                                                      fp_steps=True))
RUNS = [(1, V8), (3, V7), (1, V8)]


def kv_of(seed=0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=g)
    kv[:, 0, :, 0, 3] *= 30                         # an outlier key channel
    kv[:, :, :2] *= 8                               # large first tokens
    return kv.numpy()


def test_runs_for_groups_equal_neighbours():
    assert kgl.runs_for([V8, V7, V7, V7, V8]) == RUNS
    assert kgl.runs_for([V7] * 300) == [(255, V7), (45, V7)]


@pytest.mark.parametrize("sinks", [0, 4])
def test_payload_is_the_runs_payloads_and_their_table(sinks):
    x = kv_of()
    payload = kgl.encode(x, RUNS, sinks)
    subs = [kv_grouped.encode(x[0:1], V8, sinks), kv_grouped.encode(x[1:4], V7, sinks),
            kv_grouped.encode(x[4:5], V8, sinks)]
    body = np.concatenate(subs)
    assert np.array_equal(payload[:body.size], body)
    sizes = payload[body.size:body.size + 12].view("<u4")
    assert sizes.tolist() == [s.size for s in subs]
    assert payload[-5:].tolist() == [1, 3, 1, 3, 0xFF]
    assert payload.size == kgl.nbytes(RUNS, SHAPE, 2, sinks, 2) == body.size + 17
    assert kgl.is_layered(payload) and not kgl.is_layered(subs[0])


def test_decode_matches_each_run_and_any_block_of_layers():
    x = kv_of(1)
    payload = kgl.encode(x, RUNS, 4)
    dec = kgl.Decoder(payload, SHAPE)
    assert dec.blockable
    whole = np.empty(SHAPE, np.float32)
    dec.decode(slice(0, 5), whole)
    for l0, l1, params in [(0, 1, V8), (1, 4, V7), (4, 5, V8)]:
        ref = np.empty((l1 - l0,) + SHAPE[1:], np.float32)
        kv_grouped_decode.decode(kv_grouped.encode(x[l0:l1], params, 4), ref.shape, ref)
        assert np.array_equal(whole[l0:l1], ref)
    bound = kgl.steps(x, RUNS, 4) * np.float32(0.5 * (1 + 2 ** -12))
    err = np.abs(whole - x)[:, :, 4:]
    assert (err <= bound[:, :, 4:] + np.abs(whole[:, :, 4:]) * 2 ** -23).all()
    # V at 8 bits in layers 0 and 4: half the step of V at 7 (same ranges)
    s = kgl.steps(x, RUNS, 4)[:, 1, 4:]
    assert s[0].max() < s[1:4].max() and s[4].max() < s[1:4].max()
    for a, b in [(0, 2), (1, 3), (2, 5), (3, 4)]:               # blocks across runs
        part = np.empty((b - a,) + SHAPE[1:], np.float32)
        dec.decode(slice(a, b), part)
        assert np.array_equal(part, whole[a:b])


def test_bad_tables_and_runs_are_refused():
    x = kv_of(2)
    payload = kgl.encode(x, RUNS)
    with pytest.raises(ValueError, match="cover"):
        kgl.encode(x, [(2, V7), (2, V8)])
    with pytest.raises(ValueError, match="run table"):
        kgl.Decoder(payload, (4,) + SHAPE[1:])                 # runs cover 5 layers, not 4
    cut = payload[1:]                                          # sizes no longer add up
    with pytest.raises(ValueError, match="run table"):
        kgl.Decoder(cut, SHAPE)
    lying = payload.copy()
    lying[-2] = 200                                            # more runs than bytes
    with pytest.raises(ValueError):
        kgl.Decoder(lying, SHAPE)
    plain = kv_grouped.encode(x, V7)
    with pytest.raises(ValueError, match="run table"):
        kgl.Decoder(plain, SHAPE)


def test_kv_codec_writes_layered_payloads_and_reads_both(monkeypatch):
    """``KIVI_LAYER_BITS`` set for 3 layers: new payloads are layered (the last layer's V at 8 bits), a
    stored value round-trips through ``pack_value``/``unpack_value``, and a plain payload
    written before still decodes as it did."""
    from kvstore import kv_codec
    from kvstore.codec import pack_value, unpack_value
    shape = (3, 2, 64, 2, 64)
    kv = torch.from_numpy(kv_of(3, shape))
    plain = kv_codec.encode(kv, "kivi", 4)
    before = kv_codec.decode(plain, "kivi", torch.float32, shape)
    v8 = kv_grouped.GroupParams(kv_codec.KIVI_PARAMS.k, kv_grouped.PartParams(
        8, 64, "channels", symmetric=True, fp_steps=True))
    monkeypatch.setattr(kv_codec, "KIVI_LAYER_BITS", {3: {2: (8, 8)}, 4: {0: (9, 6)}})
    assert kv_codec.kivi_runs(shape[0]) == [(2, kv_codec.KIVI_PARAMS), (1, v8)]
    assert kv_codec.kivi_runs(2) is None and kv_codec.kivi_runs(4)[0][1].k.bits == 9
    payload = kv_codec.encode(kv, "kivi", 4)
    assert kgl.is_layered(payload)
    assert payload.size == kv_codec.payload_nbytes("kivi", shape, 2, 4)
    # one more bit per V value of the last layer, the run table, a second run's 7 parameter
    # bytes and sink count byte
    assert payload.size - plain.size == 64 * 2 * 64 // 8 + (5 * 2 + 2) + 7 + 1
    out = kv_codec.decode(payload, "kivi", torch.float32, shape)
    bound = kv_codec.error_bound(kv, "kivi", 4)
    assert bool(((out - kv).abs()[:, :, 4:] <= bound[:, :, 4:] * (1 + 2 ** -20)).all())
    assert torch.equal(out[:2], before[:2])              # layers 0-1: the same format
    assert float((out[2, 1] - kv[2, 1]).abs().max()) < float((before[2, 1] - kv[2, 1]).abs().max())
    assert torch.equal(kv_codec.decode(plain, "kivi", torch.float32, shape), before)
    key = bytes(range(48))
    buf = pack_value(key, None, kv.numpy().view(np.uint8).reshape(-1), "float32", shape, "kivi")
    _, raw = unpack_value(buf, key)
    assert torch.equal(torch.from_numpy(raw.view(np.float32).reshape(shape)), out)


@pytest.mark.parametrize("bits", [9, 10, 12, 16])
@pytest.mark.parametrize("shape", [SHAPE, (3, 2, 5, 1, 5)])      # codes per layer: 512, 25
def test_codes_above_8_bits_round_trip_within_half_a_step(bits, shape):
    """K at 9-16 bits: each code's low byte and high bits (``kv_bits.pack_wide``), per layer
    when a layer's codes fill whole bytes, else per chunk; sizes as ``nbytes``; decoded
    within half a step, every block of layers as the whole."""
    from kvstore.kv_bits import pack_wide, unpack_wide
    codes = np.random.default_rng(bits).integers(0, 2 ** bits, (3, 40)).astype(np.uint16)
    assert np.array_equal(unpack_wide(pack_wide(codes, bits, 3), bits, 3, 40), codes)
    x = kv_of(bits, shape)
    for sym in (True, False):
        params = kv_grouped.GroupParams(
            kv_grouped.PartParams(bits, shape[2], "tokens", symmetric=sym, fp_steps=True),
            V7.v if shape == SHAPE else kv_grouped.PartParams(7, 5, "channels", True, True))
        payload = kv_grouped.encode(x, params, 2)
        assert payload.size == kv_grouped.nbytes(params, shape, 2, 2, 2)
        assert kv_grouped.read_params(payload)[0] == params
        dec = kv_grouped_decode.Decoder(payload, shape)
        out = np.empty(shape, np.float32)
        dec.decode(slice(0, shape[0]), out)
        bound = kv_grouped.steps(x, params, 2) * np.float32(0.5 * (1 + 2 ** -12))
        err = np.abs(out - x)[:, :, 2:]
        assert (err <= bound[:, :, 2:] + np.abs(x[:, :, 2:]) * 2 ** -22).all()
        assert float(bound[:, 0, 2:].max()) < float(np.abs(x[:, 0]).max()) * 2.0 ** (1 - bits) * 1.01
        if dec.blockable:
            part = np.empty((1,) + shape[1:], np.float32)
            dec.decode(slice(1, 2), part)
            assert np.array_equal(part[0], out[1])

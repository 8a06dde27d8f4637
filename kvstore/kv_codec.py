"""Lossy KV codecs for the disk and remote tiers: ``kivi`` (under half the bytes of fp16 KV;
the most greedy agreement measured, README "Lossy codecs"),
``int8`` and ``fp8`` (about half), vectorized on the CPU (numpy passes: no per-element
Python, no torch op; e4m3 and bf16 casts as integer operations on the fp32 bits).

A chunk is ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` (index 0 of dim 1 = K,
1 = V) in fp32, fp16 or bf16. Encoded payload (little-endian)::

    K scales | V scales | values (1 byte each) | scale dtype code u8 (0 = fp16, 1 = fp32)

(``fp8`` has one block of scales; the code comes last so the scales start at offset 0.)

* ``int8`` (symmetric, round to nearest, ``q = round(x / s)`` in ``[-127, 127]``):
  K with one scale per channel, ``[num_layers, num_kv_heads, head_dim]`` over the chunk's
  tokens (keys have outlier channels: a per-token scale would be set by the outliers and
  crush every other channel); V with one scale per token, ``[num_layers, chunk_size,
  num_kv_heads]`` over head_dim. ``s = amax / 127`` (rounded up to fp16).
  Error bound: ``|x - x̂| <= s / 2 * (1 + 2**-12)`` per element (the factor: ``x / s`` is
  computed as ``x * (1 / s)`` in fp32, which can round a value at a half step to the farther
  code, as seen on real KV), ``s`` being the stored scale of its group
  (amax / 127 rounded up to fp16; values are quantized with the stored scale, so its
  rounding does not loosen the bound), plus the rounding of ``x̂`` to the chunk's dtype (half
  an ulp of ``x̂``).
* ``kivi`` (``kvstore.kv_grouped``, which states its payload; parameters ``KIVI_PARAMS``,
  recorded in each payload): K at 8 bits per channel over groups of 64 tokens, symmetric (a
  step per group, codes ``[-127, 127]``); V at 7 bits per token over groups of 64 channels,
  symmetric (a step per group, no zero point, codes ``[-63, 63]``); steps in fp16 (fp32 when
  the chunk's scales are). Payloads of earlier versions record V as asymmetric (a minimum and a
  step per group, codes ``[0, 127]``) and both parts' steps as 8-bit codes on a log scale in
  their mode bytes, and decode as they did. Chosen by greedy agreement on the real
  model, not by mean error: V with a zero point (a lower mean error), steps as 8-bit log
  codes, V ranges per channel, K at 6 or 7 bits, or a Hadamard rotation of V changed more
  answers (README "Lossy codecs").
  Error bound: ``|x - x̂| <= s / 2 * (1 + 2**-12)`` per element, ``s`` the stored step of its
  group (``amax / 127`` for K, ``amax / 63`` for V, rounded up to fp16: at most 2**-10 above
  it, coarser for a group below fp16's normal range), plus the fp32 rounding of ``x̂`` and
  its rounding to the chunk's dtype (half an ulp of ``x̂`` each). With ``encode(...,
  sink_tokens=n)`` (``kvstore.codec`` asks for ``SINK_TOKENS`` for the first chunk of a
  prompt) the chunk's first ``n`` tokens of K and V, a sequence's attention sinks, are
  stored in fp16 after the codes (fp32 when one
  overflows fp16) and decoded as stored: error at most half an fp16 ulp of x plus fp16's
  subnormal half-spacing (``|x| * 2**-11 + 2**-25``; fp32: exact), then the rounding to the
  chunk's dtype. The sinks are coded as 0, so a large sink does not set its K channel's
  step. Fake-quantized K8/V7-symmetric with these 4 tokens kept changed no greedy answer on
  two 20-prompt sets, and this format is that one: the codec changed none either, and 3 of
  20 on a third set (README "Lossy codecs"). ``KIVI_LAYER_BITS`` can give each layer of a
  model its own bits (1-16; a ``kvstore.kv_grouped_layers`` payload of runs of layers, each
  recording its parameters and decoded with its own bound); none is set by default.
* ``fp8`` (float8_e4m3fn values, one scale per ``(layer, kv, token, head)`` over head_dim,
  ``s = amax / 448`` rounded up to fp16): error bound ``|x - x̂| <= 2**-4 * |x| + 2**-10 * s`` (3 mantissa bits,
  round to nearest; the second term covers e4m3's subnormals), so at most ``amax / 16`` of
  the group, plus the rounding of ``x̂`` to the chunk's dtype.

Scales are fp16 unless a scale does not fit fp16 (a group amax above ~8e6), when the whole
chunk's scales are fp32. A chunk with a non-finite value cannot be encoded (``ValueError``):
the caller stores it with a lossless codec instead.

Bytes per value vs fp16 (scales counted), for ``chunk_size`` T and ``head_dim`` D:
``int8 = 0.5 + (1/T + 1/D) / 2`` (T=256, D=64: 0.510), ``fp8 = 0.5 + 1/D`` (0.516),
``kivi = (8 + 7 + 16 / 64 + 16 / D) / 32`` for T a multiple of 64 (D=64: 0.484); a chunk
with ``n`` sink tokens (the first chunk of a prompt) adds ``n / T`` (fp16 sinks; ``2 n / T``
when fp32) and one byte: T=64, n=4: 0.547 for that chunk.

**The rule: no silent lossy chunk.** A tier writes a chunk lossily only when the chunk's
namespace accepts that codec: ``Namespace.lossy_codec`` names it (``""``, the default, accepts
none: bit-exact only). ``lossy_codec`` is part of the namespace digest, so it is part of every
chunk key: a bit-exact consumer's keys never name a chunk written by a namespace that accepts
loss, and a tier configured lossy (``StoreConfig.disk_codec`` / ``remote_codec`` = ``kivi``,
``int8`` or ``fp8``) writes every other namespace's chunks losslessly (``auto`` on disk, ``raw`` in Redis).
The CPU and GPU tiers always hold exact bytes. (A namespace the store no longer remembers,
beyond ``StoreConfig.max_namespaces``, counts as accepting none until it is used again.)
A value's header names its codec, so a tier
reopened with another codec reads the values it holds as they were written.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvstore import kv_casts, kv_grouped, kv_grouped_decode, kv_grouped_layers

#: Lossy codec names (their codes in ``kvstore.codec.CODECS`` come after the lossless ones;
#: append only).
LOSSY_CODECS = ("int8", "fp8", "kivi")
#: ``kivi``'s parameters for new payloads (each payload records its own, so changing these
#: leaves stored chunks readable).
KIVI_PARAMS = kv_grouped.GroupParams(
    k=kv_grouped.PartParams(8, 64, "tokens", symmetric=True, fp_steps=True),
    v=kv_grouped.PartParams(7, 64, "channels", symmetric=True, fp_steps=True))
#: Per-layer bits of new ``kivi`` payloads, for a model of a given number of layers: ``{num_layers:
#: {layer: (k_bits, v_bits)}}`` (other layers, and models of other layer counts, as
#: ``KIVI_PARAMS``). None applying: a ``kv_grouped`` payload; else a ``kv_grouped_layers`` one
#: (runs of layers, each recording its parameters).
KIVI_LAYER_BITS: dict[int, dict[int, tuple[int, int]]] = {}
#: A measured alternative, not the default: with K given a zero point (``KIVI_PARAMS.k``
#: ``symmetric=False``) and ``KIVI_LAYER_BITS = {30: KIVI_LAYER_BITS_30}``, SmolLM2-135M's KV at
#: the same 0.484x, the keys of layers 9, 17, 18 at 10 bits, bits from each layer's share of
#: the teacher-forced logit error (``bench.codec_tf``: the greedy margin's change 36-42%
#: lower, the same greedy agreement, decoding 2-3x slower: 18 runs of layers).
KIVI_LAYER_BITS_30 = {
    0: (7, 7), 1: (8, 8), 5: (7, 6), 6: (7, 6), 9: (10, 7), 10: (7, 6), 11: (7, 6), 14: (8, 8),
    16: (9, 8), 17: (10, 7), 18: (10, 8), 20: (9, 7), 21: (7, 7), 25: (7, 6), 26: (7, 6),
    27: (7, 6), 28: (7, 6), 29: (7, 6)}
#: Sink tokens ``kivi`` keeps exact (fp16) in the first chunk of a prompt (``kvstore.codec``).
SINK_TOKENS = 4
#: Largest magnitude of each codec's values: int8 uses [-127, 127]; e4m3fn's max finite is 448.
QMAX = {"int8": 127.0, "fp8": 448.0}
_SCALE_DTYPES = (np.float16, np.float32)
_FP16_MAX = 65504.0
# The passes over the values are numpy, in blocks of whole layers (``kvstore.kv_casts``: why
# not torch, why blocks); e4m3 and bf16 casts are integer operations on the fp32 bits.


def kivi_runs(num_layers: int) -> list | None:
    """Runs ``[(num_layers, params)]`` of a new ``kivi`` payload of ``num_layers`` layers
    (``KIVI_LAYER_BITS``), or None when every layer uses ``KIVI_PARAMS``."""
    per = [KIVI_PARAMS] * num_layers
    for i, (kb, vb) in KIVI_LAYER_BITS.get(num_layers, {}).items():
        per[i] = kv_grouped.GroupParams(replace(KIVI_PARAMS.k, bits=kb),
                                        replace(KIVI_PARAMS.v, bits=vb))
    return None if all(p == KIVI_PARAMS for p in per) else kv_grouped_layers.runs_for(per)


def _check(kv: torch.Tensor) -> None:
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [num_layers, 2, chunk_size, num_kv_heads, head_dim], "
                         f"got {list(kv.shape)}")
    if kv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"lossy codecs encode fp32/fp16/bf16 KV, got {kv.dtype}")


def _amax(x: np.ndarray, axis: int) -> np.ndarray:
    """max |x| over ``axis`` (fp32), no |x| temporary.

    Raises:
        ValueError: a non-finite value (an inf or a NaN shows in its group's min or max).
    """
    amax = np.maximum(-x.min(axis=axis), x.max(axis=axis)).astype(np.float32)
    if not np.isfinite(amax).all():
        raise ValueError("KV has non-finite values; a lossy codec cannot encode it")
    return amax


def _scales(amaxes: list[np.ndarray], qmax: float) -> list[np.ndarray]:
    """Stored scales of group amaxes: ``amax / qmax`` rounded *up* to fp16 (fp32 for every
    group when one does not fit fp16), so ``|x| / scale <= qmax`` for every value (no clamp;
    an fp16 subnormal scale, for a group amax below ~8e-3, is coarse but still an upper
    bound). 0 only for an all-zero group."""
    biggest = max((float(a.max()) for a in amaxes if a.size), default=0.0)
    dtype = np.float16 if biggest / qmax <= _FP16_MAX * (1 - 2 ** -10) else np.float32
    out = []
    for a in amaxes:
        exact = a / np.float32(qmax)                         # fp32
        sc = exact.astype(dtype)
        low = sc.astype(np.float32) < exact
        sc[low] = np.nextafter(sc[low], dtype(np.inf))
        out.append(sc)
    return out


def _reciprocal(sc: np.ndarray) -> np.ndarray:
    """``1 / sc`` (fp32) with 0 where ``sc`` is 0 (an all-zero group quantizes to 0)."""
    s32 = sc.astype(np.float32)
    inv = np.zeros_like(s32)
    np.divide(1.0, s32, out=inv, where=s32 != 0)
    return inv


def _scaled(x: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """``x * inv`` in fp32 (this thread's scratch, contiguous). No clamp is needed after it:
    the stored scale is at least amax / qmax, so ``|x * inv| <= qmax`` (up to fp32 rounding of
    the reciprocal, which still rounds to qmax: 127, or e4m3's 448)."""
    t = kv_casts.scratch("scaled", x.size, np.float32).reshape(x.shape)
    return np.multiply(x, inv, out=t, dtype=np.float32)


def _host_array(kv: torch.Tensor) -> np.ndarray:
    """``kv`` as a CPU fp32 numpy array (a view of an fp32 CPU tensor; fp16 and bf16 widened:
    numpy's fp16 arithmetic is emulated, several times slower than widening once)."""
    x = kv.detach().to("cpu")
    if x.dtype == torch.float16:
        return x.numpy().astype(np.float32)
    if x.dtype == torch.bfloat16:                            # exact: bf16 is fp32's top half
        wide = np.left_shift(x.contiguous().view(torch.int16).numpy().view(np.uint16),
                             np.uint32(16), dtype=np.uint32)
        return wide.view(np.float32)
    return x.numpy()


def encode(kv: torch.Tensor, codec: str, sink_tokens: int = 0) -> np.ndarray:
    """Payload of ``kv`` (``[num_layers, 2, chunk_size, num_kv_heads, head_dim]``, fp32/fp16/
    bf16, any device) under ``codec`` (``int8``, ``fp8`` or ``kivi``), as a new uint8 array
    (bytes-like). ``sink_tokens``: ``kivi`` keeps the first ``min(sink_tokens, chunk_size)``
    tokens in fp16 (int8 and fp8 ignore it). See the module docstring.

    Raises:
        ValueError: an unknown codec, a tensor of another rank or dtype, a non-finite value,
            or ``sink_tokens`` outside 0-255.
    """
    _check(kv)
    if codec not in LOSSY_CODECS:
        raise ValueError(f"unknown lossy codec {codec!r}; choose one of {LOSSY_CODECS}")
    x = _host_array(kv)                                      # [L, 2, T, H, D]
    if codec == "kivi":
        runs = kivi_runs(x.shape[0])
        if runs:
            return kv_grouped_layers.encode(x, runs, sink_tokens)
        return kv_grouped.encode(x, KIVI_PARAMS, sink_tokens)
    if codec == "int8":
        amaxes = [_amax(x[:, 0], 1), _amax(x[:, 1], -1)]     # [L, H, D], [L, T, H]
    else:
        amaxes = [_amax(x, -1)]                              # [L, 2, T, H]
    scales = _scales(amaxes, QMAX[codec])
    scale_bytes = b"".join(sc.tobytes() for sc in scales)
    buf = np.empty(len(scale_bytes) + x.size + 1, dtype=np.uint8)
    buf[:len(scale_bytes)] = np.frombuffer(scale_bytes, dtype=np.uint8)
    buf[-1] = _SCALE_DTYPES.index(scales[0].dtype.type)
    vals = buf[len(scale_bytes):-1].reshape(x.shape)
    if codec == "int8":
        q = vals.view(np.int8)
        invs = (_reciprocal(scales[0])[:, None], _reciprocal(scales[1])[..., None])
    else:
        inv = _reciprocal(scales[0])[..., None]
    for sl in kv_casts.layer_blocks(x.shape[0], int(np.prod(x.shape[1:]))):
        if codec == "int8":
            for i in (0, 1):
                t = _scaled(x[sl, i], invs[i][sl])
                q[sl, i] = np.rint(t, out=t)                 # exact integers in [-127, 127]
        else:
            kv_casts.to_e4m3(_scaled(x[sl], inv[sl]), vals[sl])
    return buf


def payload_nbytes(codec: str, shape: tuple[int, ...], scale_itemsize: int = 2,
                   sink_tokens: int = 0, sink_itemsize: int = 2) -> int:
    """Bytes of a payload of ``codec`` for a chunk of ``shape`` with scales of
    ``scale_itemsize`` bytes (2 = fp16, 4 = fp32); for ``kivi``, a payload of
    ``KIVI_PARAMS`` with ``sink_tokens`` sink tokens of ``sink_itemsize`` bytes per value
    (ignored by the other codecs).

    Raises:
        ValueError: an unknown codec or a shape that is not 5-D with 2 at dim 1.
    """
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"shape must be [num_layers, 2, chunk_size, num_kv_heads, head_dim], "
                         f"got {list(shape)}")
    L, _, T, H, D = shape
    if codec == "kivi":
        runs = kivi_runs(L)
        if runs:
            return kv_grouped_layers.nbytes(runs, shape, scale_itemsize, sink_tokens,
                                            sink_itemsize)
        return kv_grouped.nbytes(KIVI_PARAMS, shape, scale_itemsize, sink_tokens, sink_itemsize)
    if codec == "int8":
        n_scales = L * H * D + L * T * H
    elif codec == "fp8":
        n_scales = L * 2 * T * H
    else:
        raise ValueError(f"unknown lossy codec {codec!r}; choose one of {LOSSY_CODECS}")
    return 1 + n_scales * scale_itemsize + L * 2 * T * H * D


def decode(payload, codec: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The chunk (a new CPU tensor of ``shape`` and ``dtype``) from a payload of ``encode``
    (any bytes-like; only read).

    Raises:
        ValueError: an unknown codec or scale dtype code, or a payload whose size is not the
            one ``codec`` gives for ``shape`` (e.g. a header that names the wrong codec).
    """
    mv = memoryview(payload).cast("B")
    if codec == "kivi":
        return _decode_kivi(np.frombuffer(mv, dtype=np.uint8), dtype, shape)
    if len(mv) < 1 or mv[-1] >= len(_SCALE_DTYPES):
        raise ValueError(f"{codec} payload has no valid scale dtype code")
    sdt = np.dtype(_SCALE_DTYPES[mv[-1]])
    want = payload_nbytes(codec, shape, sdt.itemsize)
    if len(mv) != want:
        raise ValueError(f"{codec} payload of {len(mv)} bytes, shape {list(shape)} needs {want}")
    L, _, T, H, D = shape
    n_vals = L * 2 * T * H * D
    scales = np.frombuffer(mv[:want - 1 - n_vals], dtype=sdt).astype(np.float32)
    vals = np.frombuffer(mv[want - 1 - n_vals:want - 1], dtype=np.uint8)
    out = torch.empty(shape, dtype=dtype)                    # [L, 2, T, H, D]
    if codec == "int8":
        q = vals.view(np.int8).reshape(L, 2, T, H, D)
        ks, vs = scales[:L * H * D].reshape(L, 1, H, D), scales[L * H * D:].reshape(L, T, H, 1)
    else:
        q, fs = vals.reshape(L, 2, T, H, D), scales.reshape(L, 2, T, H, 1)
    for sl, o in _blocks_of(out):
        if codec == "int8":
            np.multiply(q[sl, 0], ks[sl], out=o[:, 0], dtype=np.float32)
            np.multiply(q[sl, 1], vs[sl], out=o[:, 1], dtype=np.float32)
        else:
            np.take(kv_casts.E4M3_TABLE, q[sl], out=o, mode="clip")  # codes are 0-255
            o *= fs[sl]
        _store(o, out[sl])
    return out


def _blocks_of(out: torch.Tensor):
    """(layer slice, fp32 array to decode the block into) per block of ``out`` (a new
    contiguous CPU tensor ``[L, 2, T, H, D]``): the tensor's own block when fp32, else
    scratch (``_store`` then writes it)."""
    wide = out.dtype == torch.float32
    whole = out.numpy() if wide else None
    for sl in kv_casts.layer_blocks(out.shape[0], int(np.prod(out.shape[1:]))):
        if wide:
            yield sl, whole[sl]
        else:
            shape = (sl.stop - sl.start,) + tuple(out.shape[1:])
            yield sl, kv_casts.scratch("decoded", int(np.prod(shape)), np.float32).reshape(shape)


def _store(o: np.ndarray, dest: torch.Tensor) -> None:
    """Write a decoded fp32 block to its place in the output (nothing when it is there)."""
    if dest.dtype != torch.float32:
        kv_casts.store_fp32(o, dest)


def _decode_kivi(payload: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"shape must be [num_layers, 2, chunk_size, num_kv_heads, head_dim], "
                         f"got {list(shape)}")
    layered = kv_grouped_layers.is_layered(payload)
    dec = (kv_grouped_layers if layered else kv_grouped_decode).Decoder(payload, shape)
    out = torch.empty(shape, dtype=dtype)                    # [L, 2, T, H, D]
    if not dec.blockable:                                    # one block of every layer
        o = out.numpy() if dtype == torch.float32 else np.empty(shape, dtype=np.float32)
        dec.decode(slice(0, shape[0]), o)
        _store(o, out)
        return out
    for sl, o in _blocks_of(out):
        dec.decode(sl, o)
        _store(o, out[sl])
    return out


def error_bound(kv: torch.Tensor, codec: str, sink_tokens: int = 0) -> torch.Tensor:
    """Per-element bound of ``|kv - decode(encode(kv, codec, sink_tokens))|`` in fp32, the
    shape of ``kv`` (the module docstring's, before the rounding to the chunk's dtype, which
    a caller adds: half an ulp of x̂).

    Raises:
        ValueError: as ``encode``.
    """
    _check(kv)
    x32 = kv.detach().to("cpu", torch.float32)
    x = x32.numpy()
    if codec == "kivi":
        n = min(sink_tokens, x.shape[2])
        runs = kivi_runs(x.shape[0])
        st = kv_grouped_layers.steps(x, runs, n) if runs else kv_grouped.steps(x, KIVI_PARAMS, n)
        out = st * np.float32(0.5 * (1 + 2 ** -12))
        if n:                                                # [L, 2, n, H, D]: stored values
            s = x[:, :, :n]
            ulp = 2.0 ** -11 if kv_grouped.sink_dtype(s) is np.float16 else 2.0 ** -24
            out[:, :, :n] = np.abs(s) * np.float32(ulp) + np.float32(2.0 ** -25)
        return torch.from_numpy(out)
    if codec == "int8":
        ks, vs = (torch.from_numpy(sc.astype(np.float32))
                  for sc in _scales([_amax(x[:, 0], 1), _amax(x[:, 1], -1)], 127.0))
        out = torch.empty_like(x32)
        out[:, 0] = ks[:, None] * (0.5 * (1 + 2 ** -12))
        out[:, 1] = vs[..., None] * (0.5 * (1 + 2 ** -12))
        return out
    if codec == "fp8":
        sc = torch.from_numpy(_scales([_amax(x, -1)], 448.0)[0].astype(np.float32))
        return x32.abs() * 2.0 ** -4 + sc[..., None] * 2.0 ** -10
    raise ValueError(f"unknown lossy codec {codec!r}; choose one of {LOSSY_CODECS}")


def chunk_codec(tier_codec: str, accepted: str, lossless: str) -> str:
    """The codec a tier configured with ``tier_codec`` writes a chunk with, whose namespace
    accepts the lossy codec ``accepted`` (``""``: none): ``tier_codec`` when it is lossless
    or is the one accepted, else ``lossless`` (the module docstring's rule)."""
    if tier_codec not in LOSSY_CODECS or tier_codec == accepted:
        return tier_codec
    return lossless

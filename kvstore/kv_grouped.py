"""Grouped KV quantization, asymmetric or symmetric, at 1-16 bits per value (the ``kivi`` codec of
``kvstore.kv_codec``), vectorized numpy: no per-element Python.

A chunk ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` (fp32 here; K at index 0 of
dim 1, V at 1) is cut, for K and for V separately, into groups along tokens (one range per
channel over ``group`` tokens: KIVI's choice for keys, whose outlier channels would set a
per-token range) or along channels (one range per token over ``group`` channels). An
asymmetric group stores its minimum ``m`` (rounded *down* to the scale dtype) and a step ``s =
(max - m) / (2**bits - 1)`` (rounded *up*), and each value the code ``q = rint((x - m) / s)``
in ``[0, 2**bits - 1]``; decoded ``m + q * s``. A symmetric group stores only ``s = amax /
c`` (``c = 2**(bits-1) - 1``, rounded up) and the code ``q = rint(x / s) + c`` in ``[0, 2c]``;
decoded ``(q - c) * s``. Codes are packed at ``bits`` bits (8 codes in ``bits`` bytes,
little-endian; 9-16 bits: per layer, or per chunk when ``chunk_size * num_kv_heads * head_dim``
is not a multiple of 8, the codes' low bytes then their high bits, ``kv_bits.pack_wide``). The last group of a chunk (or of ``head_dim``) may be shorter.

Error bound per element: ``|x - x̂| <= s / 2 * (1 + 2**-12)`` (``s`` the stored step of its
group; the factor covers the fp32 arithmetic of encoding), plus the fp32 rounding of ``m + q *
s`` (half an ulp of x̂) and the rounding of x̂ to the chunk's dtype.

Payload (little-endian)::

    K mins | K steps | V mins | V steps | K codes | V codes [| sinks | num_sinks u8]
    | k_bits k_group k_mode v_bits v_group v_mode u8 | scale dtype code u8 (0 = fp16, 1 = fp32)

(mode: bit 0 = along channels, bit 1 = symmetric: no mins, bit 5 = steps stored in the
scale dtype; k_mode only: bit 2 = sinks present, bit 3 = sinks stored fp32). Steps are stored
either as one byte per group, a code on a log scale: ``base * 2**(-code / 16)`` with one fp32
``base`` per part (a step up to 4.4% above the need), or (``fp_steps``) in the scale dtype,
rounded up (fp16: at most 0.1% above the need), one or two bytes more per group. Optional sink tokens (``encode(..., sink_tokens=n)``):
the first ``n`` tokens of K and V, ``x[:, :, :n]`` (``[num_layers, 2, n, num_kv_heads,
head_dim]``), stored fp16 (fp32 when one of them overflows fp16) after the codes, which are
unchanged; decoding overwrites those tokens with them (an error of half an fp16 ulp of x
plus fp16's subnormal half-spacing; none when fp32). They are ranged and coded as 0, so a
large sink does not coarsen the step of the other tokens of its K channel. A payload without sinks is byte for byte
the format before sinks existed. Mins and steps of a part grouped along tokens are ``[num_layers, ceil(chunk_size / group),
num_kv_heads, head_dim]``, along channels ``[num_layers, chunk_size, num_kv_heads,
ceil(head_dim / group)]`` (then the fp32 base of the step codes, unless ``fp_steps``); codes
``[num_layers, chunk_size, num_kv_heads, head_dim]`` each,
packed. The parameters travel in the payload: a reader needs only the payload and the shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore import kv_casts
from kvstore.kv_bits import pack_bits, pack_wide, unpack_bits  # noqa: F401 (module API)

_SCALE_DTYPES = (np.float16, np.float32)
_FP16_MAX = 65504.0
_ALONG = ("tokens", "channels")
_PER_OCTAVE = 16  # step codes per octave: a step at most 2**(1/16) = 4.4% above the need
_TAIL = 7  # k_bits, k_group, k_mode, v_bits, v_group, v_mode, scale dtype code
_SINKS, _SINKS_FP32 = 4, 8  # k_mode bits: sink tokens present, stored fp32
_FP_STEPS = 32  # mode bit: steps in the scale dtype
_K_MODE_BITS, _V_MODE_BITS = 1 | 2 | _SINKS | _SINKS_FP32 | _FP_STEPS, 1 | 2 | _FP_STEPS


@dataclass(frozen=True)
class PartParams:
    """How K or V is quantized: ``bits`` per code (1-16; 2-16 when ``symmetric``), ``group``
    length (1-255) along ``along`` (``tokens``: a range per channel; ``channels``: a range
    per token), ``symmetric`` (a step per group, no minimum), ``fp_steps`` (steps stored in
    the scale dtype, not as 8-bit codes on a log scale)."""

    bits: int
    group: int
    along: str
    symmetric: bool = False
    fp_steps: bool = False

    def __post_init__(self):
        if not 1 + self.symmetric <= self.bits <= 16 or not 1 <= self.group <= 255 \
                or self.along not in _ALONG:
            raise ValueError(f"bits 1-16 (2-16 symmetric), group 1-255, along one of {_ALONG}; "
                             f"got {self}")

    @property
    def mode(self) -> int:
        """The mode byte of the payload."""
        return _ALONG.index(self.along) | self.symmetric << 1 | self.fp_steps * _FP_STEPS


    def num_groups(self, shape: tuple[int, ...]) -> int:
        """Groups (= mins = steps) of this part for a chunk of ``shape``."""
        L, _, T, H, D = shape
        if self.along == "tokens":
            return L * -(-T // self.group) * H * D
        return L * T * H * -(-D // self.group)


@dataclass(frozen=True)
class GroupParams:
    """The parameters of K's and V's quantization."""

    k: PartParams
    v: PartParams


def nbytes(params: GroupParams, shape: tuple[int, ...], scale_itemsize: int = 2,
           sink_tokens: int = 0, sink_itemsize: int = 2) -> int:
    """Payload bytes for a chunk of ``shape`` (5-D, 2 at dim 1) with ``min(sink_tokens,
    chunk_size)`` sink tokens of ``sink_itemsize`` bytes (2 = fp16, 4 = fp32) per value."""
    L, _, T, H, D = shape
    n8 = -(-(L * T * H * D) // 8)
    n = 0
    for p in (params.k, params.v):   # (mins,) steps, or step codes and their base
        step = scale_itemsize if p.fp_steps else 1
        n += p.num_groups(shape) * ((not p.symmetric) * scale_itemsize + step) + 4 * (not p.fp_steps)
    sinks = min(sink_tokens, T)
    if sinks:                        # the sink values and their count byte
        n += L * 2 * sinks * H * D * sink_itemsize + 1
    return n + n8 * (params.k.bits + params.v.bits) + _TAIL


def sink_dtype(sinks: np.ndarray):
    """The dtype sink values ``sinks`` (fp32, finite) are stored in: fp16 unless one of them
    overflows fp16 (then fp32: exact)."""
    with np.errstate(over="ignore"):
        return np.float16 if np.isfinite(sinks.astype(np.float16)).all() else np.float32


def _grouped(x: np.ndarray, part: PartParams) -> tuple[np.ndarray, int]:
    """``x`` (``[L, T, H, D]``) with the grouped axis split in ``[groups, group]`` (a view;
    a copy padded with the axis' last values when the group does not divide it), and the axis
    of the members."""
    L, T, H, D = x.shape
    axis = 1 if part.along == "tokens" else 3
    n = x.shape[axis]
    g = -(-n // part.group)
    if g * part.group != n:
        pad = [(0, 0)] * 4
        pad[axis] = (0, g * part.group - n)
        x = np.pad(x, pad, mode="edge")
    if axis == 1:
        return x.reshape(L, g, part.group, H, D), 2
    return x.reshape(L, T, H, g, part.group), 4


def _ungrouped(xg: np.ndarray, part: PartParams, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of ``_grouped``: ``[L, T, H, D]`` of ``shape`` (padding dropped)."""
    L, T, H, D = shape
    if part.along == "tokens":
        return xg.reshape(L, -1, H, D)[:, :T]
    return xg.reshape(L, T, H, -1)[..., :D]


def _round(a: np.ndarray, dtype, up: bool) -> np.ndarray:
    """``a`` (fp32) in ``dtype``, rounded up (or down) so the stored value bounds ``a``."""
    r = a.astype(dtype)
    wrong = r.astype(np.float32) < a if up else r.astype(np.float32) > a
    r[wrong] = np.nextafter(r[wrong], dtype(np.inf if up else -np.inf))
    return r


def step_table(base: float) -> np.ndarray:
    """fp32 step of each step code: ``base * 2**(-code / 16)``, codes 0-255."""
    return (np.float64(base) * 2.0 ** (-np.arange(256) / _PER_OCTAVE)).astype(np.float32)


def _step_codes(need: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """(codes, base) whose steps ``step_table(base)[codes]`` are each >= ``need`` (fp32 >= 0):
    base = the largest need; a need below base * 2**-16 gets that step."""
    base = np.float32(need.max()) if need.size else np.float32(0)
    if base == 0:
        return np.zeros(need.shape, np.uint8), base
    table = step_table(base)
    with np.errstate(divide="ignore"):
        e = np.floor(-_PER_OCTAVE * np.log2(need / base))
    codes = np.clip(e, 0, 255).astype(np.uint8)
    while True:
        low = table[codes] < need                             # log2's rounding: one code less
        if not low.any():
            return codes, base
        codes[low] -= 1


def _ranges(x: np.ndarray, part: PartParams, sdt):
    """(grouped x, stored mins or None when symmetric, stored step arrays (step codes and
    base, or the steps in ``sdt``), steps (fp32), member axis); mins and steps keep the member
    axis (length 1)."""
    xg, axis = _grouped(x, part)
    mn = xg.min(axis=axis, keepdims=True)
    mx = xg.max(axis=axis, keepdims=True)
    if not (np.isfinite(mn).all() and np.isfinite(mx).all()):
        raise ValueError("KV has non-finite values; a lossy codec cannot encode it")
    if part.symmetric:
        m, need = None, np.maximum(-mn, mx) / np.float32(2 ** (part.bits - 1) - 1)
    else:
        m = _round(mn, sdt, up=False)
        need = (mx - m.astype(np.float32)) / np.float32(2 ** part.bits - 1)
    if part.fp_steps:
        s = _round(need, sdt, up=True)
        return xg, m, [s], s.astype(np.float32), axis
    codes, base = _step_codes(need)
    return xg, m, [codes, np.array([base], "<f4")], step_table(base)[codes], axis


def _quantize(x: np.ndarray, part: PartParams, sdt):
    """(stored group arrays, codes ``[L, T, H, D]``, uint8, uint16 above 8 bits) of one part ``x`` (fp32 ``[L, T,
    H, D]``)."""
    xg, m, stored_steps, s32, _ = _ranges(x, part, sdt)
    inv = np.zeros_like(s32)
    with np.errstate(over="ignore"):
        np.divide(1.0, s32, out=inv, where=s32 != 0)
    t = kv_casts.scratch("kivi_t", xg.size, np.float32).reshape(xg.shape)
    tiny = ~np.isfinite(inv)          # a subnormal step: 1 / s overflows; divide those groups
    if part.symmetric:                                       # x / s in [-c, c], then + c
        np.multiply(xg, inv, out=t, dtype=np.float32)
        if tiny.any():
            np.divide(xg, s32, out=t, where=np.broadcast_to(tiny, t.shape))
        np.rint(t, out=t)
        t += 2 ** (part.bits - 1) - 1
        np.clip(t, 0, 2 ** part.bits - 2, out=t)
        stored = stored_steps
    else:                                                    # (x - m) / s in [0, 2**bits - 1]
        np.subtract(xg, m.astype(np.float32), out=t, dtype=np.float32)
        if tiny.any():
            np.divide(t, s32, out=t, where=np.broadcast_to(tiny, t.shape))
            t *= np.where(tiny, np.float32(1), inv)
        else:
            t *= inv
        np.rint(t, out=t)
        np.minimum(t, 2 ** part.bits - 1, out=t)             # x >= m, so t >= 0
        stored = [m] + stored_steps
    return stored, _ungrouped(t.astype(np.uint16 if part.bits > 8 else np.uint8), part, x.shape)


def scale_dtype(x: np.ndarray):
    """fp16 unless a group's min or step could not fit it (then fp32 for the whole chunk)."""
    big = max(-float(x.min()), float(x.max())) if x.size else 0.0
    return np.float16 if big <= _FP16_MAX / 2 * (1 - 2 ** -10) else np.float32


def encode(x: np.ndarray, params: GroupParams, sink_tokens: int = 0) -> np.ndarray:
    """Payload (a new uint8 array) of ``x`` (fp32 ``[L, 2, T, H, D]``), keeping its first
    ``min(sink_tokens, T)`` tokens as sinks (module docstring; 0: none).

    Raises:
        ValueError: a non-finite value, or ``sink_tokens`` outside 0-255.
    """
    if not 0 <= sink_tokens <= 255:
        raise ValueError(f"sink_tokens must be 0-255, got {sink_tokens}")
    sdt = scale_dtype(x)                                     # (a NaN: fp32, then refused)
    n = min(sink_tokens, x.shape[2])
    xq = _sinks_zeroed(x, n)
    kg, kq = _quantize(xq[:, 0], params.k, sdt)
    vg, vq = _quantize(xq[:, 1], params.v, sdt)
    sinks, k_mode = [], params.k.mode
    if n:
        s = x[:, :, :n]                                      # [L, 2, n, H, D]
        sink_dt = sink_dtype(s)
        k_mode |= _SINKS | (_SINKS_FP32 if sink_dt is np.float32 else 0)
        sinks = [np.ascontiguousarray(s, dtype=np.dtype(sink_dt).newbyteorder("<"))
                 .reshape(-1).view(np.uint8), np.array([n], dtype=np.uint8)]
    tail = np.array([params.k.bits, params.k.group, k_mode,
                     params.v.bits, params.v.group, params.v.mode,
                     _SCALE_DTYPES.index(sdt)], dtype=np.uint8)
    parts = [a.reshape(-1).view(np.uint8) for a in kg + vg]
    parts += [_pack(kq, params.k.bits), _pack(vq, params.v.bits), *sinks, tail]
    return np.concatenate(parts)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Packed codes ``[L, T, H, D]`` of one part (module docstring)."""
    if bits <= 8:
        return pack_bits(codes, bits)
    return pack_wide(codes, bits, codes.shape[0] if codes[0].size % 8 == 0 else 1)


def _sinks_zeroed(x: np.ndarray, n: int) -> np.ndarray:
    """``x`` with its first ``n`` tokens of K and V set to 0 (a copy; ``x`` when ``n`` is 0):
    what is ranged and coded when they are stored as sinks (decoding overwrites them)."""
    if not n:
        return x
    xq = x.copy()
    xq[:, :, :n] = 0
    return xq


def read_params(payload: np.ndarray) -> tuple[GroupParams, np.dtype]:
    """The parameters and scale dtype a payload records.

    Raises:
        ValueError: a payload too short or with invalid parameters.
    """
    if payload.size < _TAIL or payload[-1] >= len(_SCALE_DTYPES) \
            or int(payload[-5]) & ~_K_MODE_BITS or int(payload[-2]) & ~_V_MODE_BITS \
            or payload[-5] & (_SINKS | _SINKS_FP32) == _SINKS_FP32:
        raise ValueError("kivi payload has no valid parameter block")
    kb, kg, km, vb, vg, vm = (int(v) for v in payload[-_TAIL:-1])
    try:
        params = GroupParams(
            PartParams(kb, kg, _ALONG[km & 1], bool(km & 2), bool(km & _FP_STEPS)),
            PartParams(vb, vg, _ALONG[vm & 1], bool(vm & 2), bool(vm & _FP_STEPS)))
    except ValueError as e:
        raise ValueError(f"kivi payload has no valid parameter block: {e}") from None
    return params, np.dtype(_SCALE_DTYPES[payload[-1]])


def read_sinks(payload: np.ndarray) -> tuple[int, np.dtype]:
    """(number of sink tokens, their dtype) a payload whose parameters ``read_params``
    accepted records; ``(0, fp16)`` when it has none.

    Raises:
        ValueError: a payload that claims sinks but has no count byte, or a count of 0.
    """
    km = int(payload[-5])
    if not km & _SINKS:
        return 0, np.dtype(np.float16)
    if payload.size < _TAIL + 1 or payload[-_TAIL - 1] == 0:
        raise ValueError("kivi payload claims sink tokens but records none")
    return int(payload[-_TAIL - 1]), np.dtype(np.float32 if km & _SINKS_FP32 else np.float16)


def steps(x: np.ndarray, params: GroupParams, sink_tokens: int = 0) -> np.ndarray:
    """The stored step ``s`` of each element's group (fp32, the shape of ``x``) in a payload
    of ``encode(x, params, sink_tokens)``."""
    sdt = scale_dtype(x)
    xq = _sinks_zeroed(x, min(sink_tokens, x.shape[2]))
    out = np.empty_like(x, dtype=np.float32)
    for i, part in enumerate((params.k, params.v)):
        xg, _, _, s, _ = _ranges(xq[:, i], part, sdt)
        full = np.broadcast_to(s, xg.shape)
        out[:, i] = _ungrouped(np.ascontiguousarray(full), part, x.shape[:1] + x.shape[2:])
    return out

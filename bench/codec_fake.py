"""Lossy KV formats fake-quantized in torch, for ``bench.codec_study`` and ``bench.codec_tf``.

Each format quantizes a chunk ``[L, 2, T, H, D]`` and dequantizes it back to fp32, returning the
bytes a codec of that format would store: codes cost ``bits / 8`` bytes per element; each scale
or zero point costs 2 bytes (fp16, and the fake quantization uses the fp16-rounded value); a
value kept exact costs 2 bytes (fp16) and an outlier channel 2 bytes per element plus 1 byte of
channel index. Headers are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP16_BYTES = 2          # bytes of a scale, zero point or value kept exact


# ---------------------------------------------------------------- fake quantization (no model)

def fake_quant(x: torch.Tensor, bits: int, dim: int, symmetric: bool) -> tuple[torch.Tensor, int]:
    """Quantize ``x`` (float, any shape) to ``bits``-bit codes with one scale (and, when not
    ``symmetric``, one zero point) per group = all elements sharing the indices outside ``dim``
    (the group runs along ``dim``); returns (dequantized fp32 tensor, bytes stored: codes +
    fp16 scales/zero points). Scales and zero points are rounded to fp16 before use.

    Raises:
        ValueError: ``bits`` outside 2..16.
    """
    if not 2 <= bits <= 16:
        raise ValueError(f"bits must be in 2..16, got {bits}")
    x = x.float()
    groups = x.numel() // max(x.shape[dim], 1)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        amax = x.abs().amax(dim=dim, keepdim=True)
        s = (amax / qmax).half().float().clamp_min(1e-30)
        out = (x / s).round().clamp(-qmax, qmax) * s
        nscal = 1
    else:
        qmax = 2 ** bits - 1
        lo = x.amin(dim=dim, keepdim=True).half().float()
        hi = x.amax(dim=dim, keepdim=True)
        s = ((hi - lo) / qmax).half().float().clamp_min(1e-30)
        out = ((x - lo) / s).round().clamp(0, qmax) * s + lo
        nscal = 2
    nbytes = (x.numel() * bits + 7) // 8 + groups * nscal * FP16_BYTES
    return out, nbytes


def fake_quant_diffused(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """Error-compensating (error diffusion) symmetric rounding of values ``v [T, ..., D]``:
    one scale per token over its last dim (as ``fake_quant(v, bits, -1, True)``), tokens
    rounded in order, each token's rounding error added to the next token before rounding, so
    the running sum of values over tokens keeps an error of at most one step (attention
    output is a weighted sum over tokens). Deterministic. Returns (dequantized, bytes)."""
    v = v.float()
    qmax = 2 ** (bits - 1) - 1
    s = (v.abs().amax(dim=-1, keepdim=True) / qmax).half().float().clamp_min(1e-30)
    out = torch.empty_like(v)
    carry = torch.zeros_like(v[0])
    for t in range(v.shape[0]):
        y = v[t] + carry
        out[t] = (y / s[t]).round().clamp(-qmax, qmax) * s[t]
        carry = y - out[t]
    groups = v.numel() // v.shape[-1]
    return out, (v.numel() * bits + 7) // 8 + groups * FP16_BYTES


@dataclass(frozen=True)
class Variant:
    """A fake-quantized KV format. ``cast``: ``"float16"``/``"bfloat16"`` casts the whole
    chunk (codes ignored). Otherwise keys ``[T, H, D]`` per layer: ``k_bits`` symmetric, one
    scale per channel over ``k_group`` tokens (``k_group`` divides the chunk size), with
    ``k_outliers`` channels per (layer, head) of largest absmax kept in fp16 (``k_asym``: a
    zero point per channel too, the range min..max instead of -absmax..absmax); values: ``v_bits``
    per token over its head's channels (``v_symmetric``, ``v_diffuse``: error-compensating
    rounding along tokens). ``sinks``: the first tokens of a sequence kept in fp16.
    ``layer_bits``: ``{layer: (k_bits, v_bits)}`` overrides. ``k_prerope``: keys rotated back
    to their positions' pre-RoPE values before quantizing, rotated again after (KVQuant's
    pre-RoPE keys; needs ``set_rotary``). ``fp16_tokens``: per layer and chunk, the tokens
    whose keys stretch the channel ranges most kept whole (K and V) in fp16 and left out of the
    K ranges (1 byte of token index each)."""
    name: str
    cast: str = ""
    k_bits: int = 8
    k_group: int = 64
    k_outliers: int = 0
    k_asym: bool = False
    v_bits: int = 7
    v_symmetric: bool = False
    v_diffuse: bool = False
    sinks: int = 0
    layer_bits: dict = field(default_factory=dict, hash=False, compare=False)
    k_prerope: bool = False
    fp16_tokens: int = 0


def _keys(k: torch.Tensor, bits: int, group: int, outliers: int,
          asym: bool = False) -> tuple[torch.Tensor, int]:
    """Keys ``k [T, H, D]`` of one layer -> (dequantized, bytes)."""
    T, H, D = k.shape
    out, nbytes = torch.empty_like(k), 0
    keep = None
    if outliers:
        keep = k.abs().amax(dim=0).topk(outliers, dim=-1).indices            # [H, outliers]
        mask = torch.zeros(H, D, dtype=torch.bool).scatter_(1, keep, True)   # [H, D]
        k_in = k.masked_fill(mask, 0.0)
    else:
        k_in = k
    for t0 in range(0, T, group):
        g = k_in[t0:t0 + group]                                                # [g, H, D]
        q, b = fake_quant(g, bits, 0, not asym)
        out[t0:t0 + group] = q
        nbytes += b
    if outliers:
        out = torch.where(mask, k.half().float(), out)
        nbytes -= (T * H * outliers * bits) // 8           # those codes are not stored
        nbytes += T * H * outliers * FP16_BYTES + H * outliers
    return out, nbytes


def _values(v: torch.Tensor, bits: int, symmetric: bool, diffuse: bool):
    """Values ``v [T, H, D]`` of one layer -> (dequantized, bytes)."""
    if diffuse:
        return fake_quant_diffused(v, bits)
    return fake_quant(v, bits, -1, symmetric)


_ROTARY: list = []


def set_rotary(model_config) -> None:
    """Use the rotary tables of ``model_config`` (an ``engine_min`` ``ModelConfig``: head_dim,
    rope_theta, rope_scaling) for ``k_prerope`` variants."""
    from engine_min.rope import Rotary
    _ROTARY[:] = [Rotary(model_config)]


def _rotate(k: torch.Tensor, start: int, inverse: bool) -> torch.Tensor:
    """Keys ``k [T, H, D]`` at positions ``start..start+T-1`` rotated by RoPE (or back)."""
    from engine_min.rope import apply_rotary
    if not _ROTARY:
        raise RuntimeError("k_prerope needs set_rotary(engine) first")
    cos, sin = _ROTARY[0].cos_sin(torch.arange(start, start + k.shape[0]), torch.float32)
    return apply_rotary(k, cos, -sin if inverse else sin)


def _outlier_tokens(k: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` tokens of ``k [T, H, D]`` nearest their channels' absmax over the
    most channels (score: sum over channels of (|k| / channel absmax) ** 8)."""
    r = k.abs() / k.abs().amax(dim=0, keepdim=True).clamp_min(1e-30)
    return (r ** 8).sum(dim=(1, 2)).topk(min(n, k.shape[0])).indices


def apply_variant(kv: torch.Tensor, var: Variant, start: int) -> tuple[torch.Tensor, int]:
    """Fake-quantize one chunk ``kv [L, 2, T, H, D]`` whose first token is at position ``start``
    of its sequence; returns (fp32 tensor of the same shape, bytes the format stores)."""
    if var.cast:
        dt = getattr(torch, var.cast)
        return kv.to(dt).float(), kv.numel() * 2
    L, _, T, H, D = kv.shape
    s = max(0, min(var.sinks - start, T))                    # sink tokens in this chunk
    out = kv.float().clone()
    nbytes = s * L * 2 * H * D * FP16_BYTES
    if s:
        out[:, :, :s] = kv[:, :, :s].half().float()
    for layer in range(L):
        kb, vb = var.layer_bits.get(layer, (var.k_bits, var.v_bits))
        k, v = kv[layer, 0, s:].float(), kv[layer, 1, s:].float()              # [T-s, H, D]
        if var.k_prerope:
            k = _rotate(k, start + s, inverse=True)
        keep = _outlier_tokens(k, var.fp16_tokens) if var.fp16_tokens else None
        if keep is not None:
            k = k.clone()
            k[keep] = 0.0                     # out of the channel ranges, coded as 0
        group = var.k_group if s == 0 else T - s
        qk, bk = _keys(k, kb, group, var.k_outliers, var.k_asym)
        qv, bv = _values(v, vb, var.v_symmetric, var.v_diffuse)
        if var.k_prerope:
            qk = _rotate(qk, start + s, inverse=False)
        if keep is not None:
            qk[keep] = kv[layer, 0, s:][keep].half().float()
            qv[keep] = kv[layer, 1, s:][keep].half().float()
            nt = len(keep) * kv.shape[3] * kv.shape[4]
            nbytes += 2 * nt * FP16_BYTES + len(keep)                 # codes stay (coded 0)
        out[layer, 0, s:], out[layer, 1, s:] = qk, qv
        nbytes += bk + bv
    return out, nbytes


FIRST8 = range(8)
VARIANTS = {v.name: v for v in [
    Variant("fp16", cast="float16"),
    Variant("bf16", cast="bfloat16"),
    Variant("kivi-like", k_bits=8, v_bits=7),                     # K8 ch/64tok, V7 asym/token
    Variant("k8-v7sym", k_bits=8, v_bits=7, v_symmetric=True),
    Variant("k8-v7-sink4", k_bits=8, v_bits=7, sinks=4),
    Variant("k8-v7sym-sink4", k_bits=8, v_bits=7, v_symmetric=True, sinks=4),
    Variant("k8g32-v7sym", k_bits=8, k_group=32, v_bits=7, v_symmetric=True),
    Variant("k8-v7diff", k_bits=8, v_bits=7, v_diffuse=True),
    Variant("k7o4-v7sym", k_bits=7, k_outliers=4, v_bits=7, v_symmetric=True),
    Variant("k9first8-v7sym", k_bits=8, v_bits=7, v_symmetric=True,
            layer_bits={i: (9, 7) for i in FIRST8}),
    Variant("v8first8-k8-v7sym", k_bits=8, v_bits=7, v_symmetric=True,
            layer_bits={i: (8, 8) for i in FIRST8}),
    Variant("k8asym-v7sym-sink4", k_bits=8, k_asym=True, v_bits=7, v_symmetric=True, sinks=4),
    Variant("k8-v8sym", k_bits=8, v_bits=8, v_symmetric=True),   # over budget: a reference
    Variant("k8-v7sym-sink4-prerope", k_bits=8, v_bits=7, v_symmetric=True, sinks=4,
            k_prerope=True),
]}

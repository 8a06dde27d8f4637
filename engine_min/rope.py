"""Rotary position embedding: inverse frequencies for the common scaling types, and apply.

Half-split (``rotate_half``) convention as in Hugging Face Llama; GGUF Q/K weights are
un-permuted at load (``weights._unpermute_rope``) so one convention serves both formats.
"""
from __future__ import annotations

import math

import torch

from engine_min.config import ModelConfig


def inv_freq_and_scale(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """``([head_dim // 2] float32 inverse frequencies, cos/sin scale)`` for ``cfg``.

    Scaling types: None/"default", "linear", "llama3", "yarn" (beta_fast 32, beta_slow 1),
    "freq_factors" (GGUF rope_freqs tensor: inv_freq / factors).

    Raises:
        ValueError: an unknown rope_type.
    """
    d, base = cfg.head_dim, cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", "default")
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(sc["factor"]), 1.0
    if kind == "freq_factors":
        return inv / torch.tensor(sc["factors"], dtype=torch.float32), 1.0
    if kind == "llama3":
        return _llama3(inv, sc), 1.0
    if kind == "yarn":
        return _yarn(cfg, sc)
    raise ValueError(f"unsupported rope scaling type {kind!r} "
                     "(supported: default, linear, llama3, yarn)")


def _llama3(inv: torch.Tensor, sc: dict) -> torch.Tensor:
    factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, out)


def _yarn(cfg: ModelConfig, sc: dict) -> tuple[torch.Tensor, float]:
    d, base, factor = cfg.head_dim, cfg.rope_theta, float(sc["factor"])
    orig = int(sc.get("original_max_position_embeddings") or cfg.max_position / factor)
    attn = sc.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def corr(n_rot: float) -> float:
        return d * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    pos = base ** (torch.arange(0, d, 2).float() / d)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extrap) + (1.0 / pos) * extrap
    return inv, float(attn)


class Rotary:
    """cos/sin tables at given positions and their application to q/k."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        inv_freq, self.scale = inv_freq_and_scale(cfg)
        self.inv_freq = inv_freq.to(device)  # [head_dim // 2] float32, on the model's device

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` each ``[num_tokens, 1, head_dim]`` for int64 ``positions [num_tokens]``."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [num_tokens, num_heads, head_dim]`` by position (half-split pairs)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin

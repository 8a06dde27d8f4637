"""Llama-family decoder over a paged KV cache, on flattened tokens of many sequences.

One forward pass takes every token scheduled this step, ``[num_tokens]`` in the order
``[decode tokens (one per decoding sequence) | prefill chunk of seq a | chunk of seq b | ...]``,
so every linear layer runs once per step for the whole batch; only attention is split into one
batched decode call and one call per prefill chunk (see ``AttentionMetadata``).

``forward(..., layer_ready=f)`` calls ``f(i)`` in layer ``i`` after its q/k/v projection and
before the layer writes or reads its KV cache: the hook of KV loaded layer by layer while the
pass runs (the caller passes a KV connector's wait; the model knows nothing of it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_min.config import ModelConfig
from engine_min.rope import Rotary, apply_rotary
from kernels import ops


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk in the flat token list.

    Attributes:
        start, end: token range ``[start, end)`` in the flat batch.
        block_table: ``[num_blocks]`` int64 block ids of the sequence.
        context_len: tokens in the cache after this step (cached prefix + this chunk).
    """

    start: int
    end: int
    block_table: torch.Tensor
    context_len: int


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV pool and what each attends to.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 slot of each token's new K/V.
        num_decode: the first ``num_decode`` tokens are decodes (one per sequence).
        decode_block_tables: ``[num_decode, max_blocks]`` int64, padded with null block 0.
        decode_context_lens: ``[num_decode]`` int64 context length incl. the new token.
        prefills: the prefill chunks after the decode tokens.
    """

    slot_mapping: torch.Tensor
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


def param(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """A frozen contiguous copy of ``t`` in ``dtype`` on ``device`` (cast on the host first:
    the device receives only the final bytes)."""
    return nn.Parameter(t.to(dtype).contiguous().to(device), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back: ``x / sqrt(mean(x^2) + eps) * weight``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention (GQA, RoPE, optional qkv bias) + SwiGLU MLP, fused qkv and gate/up."""

    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], i: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__()
        p = f"layers.{i}."

        def w(name):
            return param(sd[p + name], dtype, device)

        self.cfg, self.layer_idx = cfg, i
        self.attn_norm, self.mlp_norm = w("attn_norm.weight"), w("mlp_norm.weight")
        self.qkv = param(torch.cat([sd[p + "q.weight"], sd[p + "k.weight"], sd[p + "v.weight"]]),
                         dtype, device)
        self.qkv_bias = None
        if cfg.attention_bias:
            self.qkv_bias = param(torch.cat([sd[p + "q.bias"], sd[p + "k.bias"],
                                             sd[p + "v.bias"]]), dtype, device)
        self.o = w("o.weight")
        self.gate_up = param(torch.cat([sd[p + "gate.weight"], sd[p + "up.weight"]]), dtype, device)
        self.down = w("down.weight")
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata,
                layer_ready: Callable[[int], None] | None = None) -> torch.Tensor:
        """``x [num_tokens, hidden]`` -> ``[num_tokens, hidden]``; writes K/V into ``kv_layer``.
        ``layer_ready(layer_idx)``, when given, runs before ``kv_layer`` is first touched (a
        loaded block's slots past the load are overwritten by this step's K/V only after it)."""
        c = self.cfg
        t, hq, hkv, d = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        qkv = F.linear(rms_norm(x, self.attn_norm, c.rms_norm_eps), self.qkv, self.qkv_bias)
        q = apply_rotary(qkv[:, :hq * d].view(t, hq, d), cos, sin)              # [T, Hq, D]
        k = apply_rotary(qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d), cos, sin)  # [T, Hkv, D]
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)                              # [T, Hkv, D]
        if layer_ready is not None:
            layer_ready(self.layer_idx)
        ops.reshape_and_cache(k, v, kv_layer, meta.slot_mapping)
        out = torch.empty_like(q)                                                # [T, Hq, D]
        nd = meta.num_decode
        if nd:
            out[:nd] = ops.paged_attention_decode(q[:nd], kv_layer, meta.decode_block_tables,
                                                  meta.decode_context_lens, self.scale)
        for span in meta.prefills:
            out[span.start:span.end] = ops.paged_attention_prefill(
                q[span.start:span.end], kv_layer, span.block_table, span.context_len, self.scale)
        x = x + F.linear(out.view(t, hq * d), self.o)
        gu = F.linear(rms_norm(x, self.mlp_norm, c.rms_norm_eps), self.gate_up)  # [T, 2*I]
        gate, up = gu.chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


class LlamaModel(nn.Module):
    """The decoder stack, final norm and LM head.

    Args:
        cfg: model shape.
        sd: state dict in engine_min names (``weights.load_model``); float32 CPU tensors.
        dtype: compute dtype of weights and activations.
        device: where the weights (and the RoPE frequencies) are placed; the forward pass
            takes its inputs and KV pool on the same device.
    """

    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.embed = param(sd["embed.weight"], dtype, device)  # [V, hidden]
        self.norm = param(sd["norm.weight"], dtype, device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else param(
            sd["lm_head.weight"], dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, sd, i, dtype, device)
                                    for i in range(cfg.num_layers))
        self.rotary = Rotary(cfg, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata,
                layer_ready: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states after the final norm.

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64 position of each token in its sequence.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: slots and attention spans of this step.
            layer_ready: called with each layer's index before that layer writes or reads
                ``kv_cache[i]`` (module docstring); None = no wait.

        Returns:
            ``[num_tokens, hidden]``.
        """
        x = F.embedding(input_ids, self.embed)                  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, self.dtype)   # [T, 1, D] each
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], meta, layer_ready)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [n, hidden]`` -> float32 logits ``[n, vocab_size]``."""
        return F.linear(hidden, self.lm_head).float()

"""Triton kernels for CUDA: reshape-and-cache and paged decode attention.

Same signatures, shapes and semantics as ``kernels.reference`` (the spec they are tested
against in tests/kernels/test_kernels_triton.py). Imported only when CUDA and Triton are present
(``kernels.ops``). Prefill attention stays on the reference (torch SDPA is fast on CUDA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt,
                              HD: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HD
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    tl.store(kc_ptr + slot * HD + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * HD + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """See ``kernels.reference.reshape_and_cache``; one program per token."""
    t, h, d = key.shape
    if t == 0:
        return
    key = key if key.stride(2) == 1 and key.stride(1) == d else key.contiguous()
    value = value if value.stride(2) == 1 and value.stride(1) == d else value.contiguous()
    assert kv_layer.is_contiguous(), "kv_layer must be contiguous"
    _reshape_and_cache_kernel[(t,)](key, value, kv_layer[0], kv_layer[1], slot_mapping,
                                    key.stride(0), value.stride(0), HD=h * d,
                                    BLOCK=triton.next_power_of_2(h * d))


@triton.jit
def _paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, cl_ptr, out_ptr, scale,
                         stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
                         HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                         D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(cl_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask, dmask = g < G, d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)   # [G_PAD, D_PAD]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    den = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    offs_t = tl.arange(0, BS)
    for i in range(0, tl.cdiv(ctx, BS)):
        blk = tl.load(bt_ptr + b * stride_btb + i).to(tl.int64)
        tmask = i * BS + offs_t < ctx
        base = (blk * BS + offs_t)[:, None] * (HKV * D) + kvh * D + d[None, :]      # [BS, D_PAD]
        lmask = tmask[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + base, mask=lmask, other=0.0).to(tl.float32)
        v = tl.load(vc_ptr + base, mask=lmask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                 # [G_PAD, BS]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / den[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


def paged_attention_decode(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """See ``kernels.reference.paged_attention_decode``; one program per (sequence, KV head),
    online softmax over the sequence's blocks."""
    b, hq, d = query.shape
    _, _, bs, hkv, _ = kv_layer.shape
    assert kv_layer.is_contiguous() and query.stride(2) == 1
    out = torch.empty_like(query)
    if b == 0:
        return out
    g = hq // hkv
    _paged_decode_kernel[(b, hkv)](
        query, kv_layer[0], kv_layer[1], block_tables, context_lens, out, float(scale),
        query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        HKV=hkv, G=g, G_PAD=max(triton.next_power_of_2(g), 1), D=d,
        D_PAD=triton.next_power_of_2(d), BS=bs)
    return out

"""Paged-KV kernels in pure torch: the specification every fast kernel is tested against.

KV pool layout (one preallocated tensor for the whole model)::

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (dim 1: 0=K, 1=V)
    kv_layer = kv_cache[layer]: [2, num_blocks, block_size, num_kv_heads, head_dim]

Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its *slot* is ``block_id * block_size + offset``. Block 0 is the null
block: block tables are padded with 0 and nothing real is ever stored there.

A chunk of ``C = k * block_size`` tokens in blocks ``b_1..b_k`` gathers to the store's chunk
layout ``[num_layers, 2, C, num_kv_heads, head_dim]`` with one indexing op (no per-token loop).
"""
from __future__ import annotations

import torch


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K and V into their slots (in place).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        kv_layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous).
        slot_mapping: ``[num_tokens]`` int64 slot of each token.
    """
    _, nb, bs, h, d = kv_layer.shape
    kv_layer[0].view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(kv_layer.dtype))
    kv_layer[1].view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(kv_layer.dtype))


def paged_attention_decode(query: torch.Tensor, kv_layer: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context (itself included).

    Args:
        query: ``[num_seqs, num_heads, head_dim]``; query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)`` (grouped-query attention).
        kv_layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int64, padded with the null block 0.
        context_lens: ``[num_seqs]`` int64 tokens in the cache per sequence (>= 1).
        scale: softmax scale (usually ``head_dim ** -0.5``).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in the query's dtype.
    """
    b, hq, d = query.shape
    hkv = kv_layer.shape[3]
    s = block_tables.shape[1] * kv_layer.shape[2]
    # index_select, not advanced indexing: the latter's thread fan-out costs ms on tiny gathers
    kv = kv_layer.index_select(1, block_tables.flatten()).view(2, b, s, hkv, d)
    k = kv[0].permute(0, 2, 3, 1)                                          # [B, Hkv, D, S]
    v = kv[1].transpose(1, 2)                                              # [B, Hkv, S, D]
    q = query.view(b, hkv, hq // hkv, d).to(kv.dtype)                     # [B, Hkv, G, D]
    scores = torch.matmul(q, k).float() * scale                           # [B, Hkv, G, S]
    pad = torch.arange(s, device=query.device)[None, :] >= context_lens[:, None]  # [B, S]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(b, hq, d).to(query.dtype)


def paged_attention_prefill(query: torch.Tensor, kv_layer: torch.Tensor,
                            block_table: torch.Tensor, context_len: int,
                            scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over cached prefix + themselves.

    The new tokens are positions ``[context_len - num_new, context_len)``; their K/V must
    already be in the cache (``reshape_and_cache`` first). Token ``i`` attends to positions
    ``<= context_len - num_new + i``::

        cached prefix (computed earlier)      new tokens (this step)
        [0 ............ context_len-num_new) [context_len-num_new .. context_len)

    Args:
        query: ``[num_new, num_heads, head_dim]``.
        kv_layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: ``[>= ceil(context_len / block_size)]`` int64 block ids of the sequence.
        context_len: tokens of the sequence in the cache after this step's writes.
        scale: softmax scale.

    Returns:
        ``[num_new, num_heads, head_dim]`` in the query's dtype.
    """
    n, hq, d = query.shape
    hkv, bs = kv_layer.shape[3], kv_layer.shape[2]
    nblk = -(-context_len // bs)
    kv = kv_layer.index_select(1, block_table[:nblk]).view(2, nblk * bs, hkv, d)
    k, v = kv[0, :context_len], kv[1, :context_len]                     # [S, Hkv, D]
    g = hq // hkv
    q = query.transpose(0, 1).unsqueeze(0).to(k.dtype)                 # [1, Hq, N, D]
    k = k.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)      # [1, Hq, S, D]
    v = v.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
    start = context_len - n
    if start == 0:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        qpos = torch.arange(start, context_len, device=query.device)[:, None]  # [N, 1]
        mask = torch.arange(context_len, device=query.device)[None, :] <= qpos  # [N, S]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).to(query.dtype)  # [N, Hq, D]


def gather_chunk(kv_cache: torch.Tensor, block_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """Copy the KV of whole blocks out as one chunk.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_ids: ``[k]`` block ids in token order.

    Returns:
        A new contiguous ``[num_layers, 2, k * block_size, num_kv_heads, head_dim]`` tensor.
    """
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    l, _, _, bs, h, d = kv_cache.shape
    return kv_cache.index_select(2, ids).reshape(l, 2, ids.numel() * bs, h, d)


def scatter_chunk(kv_cache: torch.Tensor, block_ids: torch.Tensor | list[int],
                  chunk: torch.Tensor) -> None:
    """Write a chunk into whole blocks (in place); the inverse of ``gather_chunk``.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_ids: ``[k]`` destination block ids in token order.
        chunk: ``[num_layers, 2, k * block_size, num_kv_heads, head_dim]``.

    Raises:
        ValueError: the chunk's shape does not match ``k`` blocks of this pool.
    """
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    l, _, _, bs, h, d = kv_cache.shape
    want = (l, 2, ids.numel() * bs, h, d)
    if tuple(chunk.shape) != want:
        raise ValueError(f"chunk shape {list(chunk.shape)} does not fit {ids.numel()} blocks: "
                         f"expected {list(want)}")
    kv_cache[:, :, ids] = chunk.reshape(l, 2, ids.numel(), bs, h, d).to(kv_cache.dtype)


def copy_blocks(kv_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer (copy-on-write of a shared block)."""
    if src:
        s = torch.as_tensor(src, dtype=torch.long, device=kv_cache.device)
        d = torch.as_tensor(dst, dtype=torch.long, device=kv_cache.device)
        kv_cache[:, :, d] = kv_cache[:, :, s]

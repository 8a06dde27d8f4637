"""Kernel dispatch: Triton kernels for CUDA tensors when Triton is installed
(``kernels.triton_attention``: reshape-and-cache, paged decode; ``kernels.triton_cache``: chunk
gather/scatter, block copies), the CPU fast path (``kernels.cpu_attention``) for prefill
attention on CPU tensors, else the torch reference. Signatures and shapes are those of
``kernels.reference``."""
from __future__ import annotations

import importlib.util

import torch

from kernels import cpu_attention, reference

HAS_TRITON = importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
_triton = None
_triton_cache = None


def _fast(t: torch.Tensor):
    """The Triton attention module for a CUDA tensor when available, else None (lazy import)."""
    global _triton
    if not (HAS_TRITON and t.is_cuda):
        return None
    if _triton is None:
        from kernels import triton_attention
        _triton = triton_attention
    return _triton


def _fast_cache(t: torch.Tensor):
    """The Triton block-copy module for a CUDA tensor when available, else None (lazy import)."""
    global _triton_cache
    if not (HAS_TRITON and t.is_cuda):
        return None
    if _triton_cache is None:
        from kernels import triton_cache
        _triton_cache = triton_cache
    return _triton_cache


def reshape_and_cache(key, value, kv_layer, slot_mapping) -> None:
    """See ``kernels.reference.reshape_and_cache``."""
    impl = _fast(key) or reference
    impl.reshape_and_cache(key, value, kv_layer, slot_mapping)


def paged_attention_decode(query, kv_layer, block_tables, context_lens, scale):
    """See ``kernels.reference.paged_attention_decode``."""
    impl = _fast(query) or reference
    return impl.paged_attention_decode(query, kv_layer, block_tables, context_lens, scale)


def paged_attention_prefill(query, kv_layer, block_table, context_len, scale):
    """See ``kernels.reference.paged_attention_prefill``; ``kernels.cpu_attention`` on CPU."""
    impl = cpu_attention if query.device.type == "cpu" else reference
    return impl.paged_attention_prefill(query, kv_layer, block_table, context_len, scale)


def gather_chunk(kv_cache, block_ids):
    """See ``kernels.reference.gather_chunk``; ``kernels.triton_cache`` on CUDA."""
    impl = _fast_cache(kv_cache) or reference
    return impl.gather_chunk(kv_cache, block_ids)


def scatter_chunk(kv_cache, block_ids, chunk) -> None:
    """See ``kernels.reference.scatter_chunk``; ``kernels.triton_cache`` on CUDA."""
    impl = _fast_cache(kv_cache) or reference
    impl.scatter_chunk(kv_cache, block_ids, chunk)


def copy_blocks(kv_cache, src, dst) -> None:
    """See ``kernels.reference.copy_blocks``; ``kernels.triton_cache`` on CUDA."""
    impl = _fast_cache(kv_cache) or reference
    impl.copy_blocks(kv_cache, src, dst)

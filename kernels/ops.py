"""Kernel dispatch: Triton kernels for CUDA tensors when Triton is installed, the CPU fast path
(``kernels.cpu_attention``) for prefill attention on CPU tensors, else the torch reference.
Signatures and shapes are those of ``kernels.reference``."""
from __future__ import annotations

import importlib.util

import torch

from kernels import cpu_attention, reference

HAS_TRITON = importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
_triton = None


def _fast(t: torch.Tensor):
    """The Triton module for a CUDA tensor when available, else None (imported lazily)."""
    global _triton
    if not (HAS_TRITON and t.is_cuda):
        return None
    if _triton is None:
        from kernels import triton_attention
        _triton = triton_attention
    return _triton


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


gather_chunk = reference.gather_chunk
scatter_chunk = reference.scatter_chunk
copy_blocks = reference.copy_blocks

"""Paged-cache layout of vLLM's attention backend, derived by probing it (no vLLM import here).

``derive_paged_layout`` writes known values through the backend's own cache-update path into a
scratch cache and reads back where each element landed; ``PagedLayout`` then maps token slots
of a layer's paged KV tensor to element offsets, for gathering and scattering whole chunks
``[num_layers, 2, chunk_tokens, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

from typing import Any

import torch

_EXACT_INT = {torch.float32: 1 << 24, torch.float16: 1 << 11, torch.bfloat16: 1 << 8}


class PagedLayout:
    """Where token ``t`` of a block lives in one layer's paged KV tensor.

    ``offsets(slots)`` returns element offsets ``[2, n, num_kv_heads, head_dim]`` into the layer
    tensor's storage (relative to its ``storage_offset``) for K (0) and V (1) of each slot;
    ``gather``/``scatter`` move ``[2, n, H, D]`` tensors.

    Attributes:
        block_size: tokens per physical (kernel) block.
        block_dim: the dim of the cache tensor that indexes blocks.
        inner: ``[block_size, 2, H, D]`` int64 offsets inside one block (relative to its base).
        block_stride: elements between consecutive blocks.
    """

    def __init__(self, block_size: int, block_dim: int, inner: torch.Tensor, block_stride: int,
                 shape: tuple[int, ...], stride: tuple[int, ...]):
        self.block_size = block_size
        self.block_dim = block_dim
        self.inner = inner
        self.block_stride = block_stride
        self.shape = shape
        self.stride = stride
        # [2, block_size, H, D]: the order of a store chunk's K/V, token, head, dim.
        self._inner_kv_first = inner.permute(1, 0, 2, 3).contiguous()

    def _affine(self) -> list[tuple[int, int, int, int]] | None:
        """Per K/V ``(base, stride_n, stride_h, stride_d)`` when offsets inside a block are
        affine in (token, head, dim), else None."""
        if hasattr(self, "_aff"):
            return self._aff
        out = []
        n, _, h, d = self.inner.shape
        for k in range(2):
            t = self.inner[:, k]
            base = int(t[0, 0, 0])
            sn = int(t[1, 0, 0] - base) if n > 1 else 0
            sh = int(t[0, 1, 0] - base) if h > 1 else 0
            sd = int(t[0, 0, 1] - base) if d > 1 else 0
            want = (base + torch.arange(n).view(-1, 1, 1) * sn + torch.arange(h).view(1, -1, 1) * sh
                    + torch.arange(d).view(1, 1, -1) * sd)
            if not torch.equal(want, t):
                out = None
                break
            out.append((base, sn, sh, sd))
        self._aff = out
        return out

    def plan(self, slots: torch.Tensor) -> Any:
        """Precompute the moves for ``slots`` (``[n]`` int64, one per token, in token order):
        runs of consecutive slots inside one block when the block layout is affine (strided
        copies), element offsets ``[2, n, H, D]`` otherwise."""
        aff = self._affine()
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        pos = slots - blocks * self.block_size
        if aff is None:
            base = (blocks * self.block_stride).view(1, -1, 1, 1)
            return ("offsets", base + self._inner_kv_first[:, pos])
        runs, i, n = [], 0, len(slots)
        bl, ps = blocks.tolist(), pos.tolist()
        while i < n:
            j = i + 1
            while j < n and bl[j] == bl[i] and ps[j] == ps[j - 1] + 1:
                j += 1
            runs.append((bl[i], ps[i], j - i, i))
            i = j
        return ("runs", runs, n)

    def offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """Element offsets ``[2, n, H, D]`` (int64) of the K/V of ``slots`` (``[n]`` int64)."""
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        pos = slots - blocks * self.block_size
        base = (blocks * self.block_stride).view(1, -1, 1, 1)
        return base + self._inner_kv_first[:, pos]

    @staticmethod
    def flat(cache: torch.Tensor) -> torch.Tensor:
        """1-D view over the storage span of ``cache`` (offsets index into it)."""
        span = 1 + sum((s - 1) * st for s, st in zip(cache.shape, cache.stride()))
        return torch.as_strided(cache, (span,), (1,), cache.storage_offset())

    def _run_view(self, cache: torch.Tensor, k: int, block: int, p0: int, length: int) -> torch.Tensor:
        base, sn, sh, sd = self._aff[k]
        h, d = self.inner.shape[2], self.inner.shape[3]
        off = cache.storage_offset() + block * self.block_stride + base + p0 * sn
        return torch.as_strided(cache, (length, h, d), (sn, sh, sd), off)

    def gather(self, cache: torch.Tensor, plan: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy of the KV moved by ``plan`` (from ``plan``): ``[2, n, H, D]`` (into ``out``)."""
        if plan[0] == "offsets":
            res = self.flat(cache)[plan[1]]
            if out is not None:
                out.copy_(res)
                return out
            return res
        _, runs, n = plan
        if out is None:
            out = torch.empty((2, n) + tuple(self.inner.shape[2:]), dtype=cache.dtype)
        for block, p0, length, t0 in runs:
            for k in range(2):
                out[k, t0:t0 + length].copy_(self._run_view(cache, k, block, p0, length))
        return out

    def scatter(self, cache: torch.Tensor, plan: Any, kv: torch.Tensor) -> None:
        """Write ``kv`` ``[2, n, H, D]`` where ``plan`` says."""
        if plan[0] == "offsets":
            self.flat(cache)[plan[1]] = kv.to(cache.dtype)
            return
        for block, p0, length, t0 in plan[1]:
            for k in range(2):
                self._run_view(cache, k, block, p0, length).copy_(kv[k, t0:t0 + length])

    def describe(self) -> str:
        """How K and V sit in a block, e.g. ``K (h, d, n) V (h, n, d)``: the axes of each in
        memory order, outermost first."""
        aff = self._affine()
        if aff is None:
            return f"irregular per-block layout of cache shape {list(self.shape)}"
        parts = []
        for name, (base, sn, sh, sd) in zip("KV", aff):
            order = sorted((("n", sn), ("h", sh), ("d", sd)), key=lambda x: -x[1])
            parts.append(f"{name} at +{base} as ({', '.join(a for a, _ in order)})")
        return (f"cache {list(self.shape)} stride {list(self.stride)}, block dim {self.block_dim}, "
                f"{self.block_size} tokens/block: " + "; ".join(parts))


def derive_paged_layout(impl: Any, layer: Any, cache: torch.Tensor, num_blocks: int,
                        logical_block_size: int, num_kv_heads: int, head_dim: int) -> PagedLayout:
    """Find where the attention backend stores each token's K and V by writing known values.

    Args:
        impl: the layer's attention implementation (has ``do_kv_cache_update(layer, key, value,
            kv_cache, slot_mapping)``, vLLM's write path).
        layer: the attention layer module.
        cache: the layer's real paged cache (shape and strides are taken from it).
        num_blocks: blocks in vLLM's KV cache config (scheduler blocks).
        logical_block_size: the scheduler's block size (tokens).
        num_kv_heads, head_dim: per-layer KV heads and head size.

    Returns:
        The layout (offset table) of ``cache``.

    Raises:
        ValueError: the backend has no write path, the block dim is ambiguous, the dtype cannot
            be probed exactly, or the write is not a one-to-one placement of every element.
    """
    if not hasattr(impl, "do_kv_cache_update"):
        raise ValueError(f"{type(impl).__name__} has no do_kv_cache_update; cannot derive layout")
    dims = [i for i, s in enumerate(cache.shape) if s % num_blocks == 0
            and (logical_block_size * num_blocks) % s == 0 and s >= num_blocks]
    dims = [i for i in dims if cache.shape[i] // num_blocks in (1, 2, 4, 8, 16)]
    if len(dims) != 1:
        raise ValueError(f"cannot tell the block dim of cache shape {list(cache.shape)} "
                         f"with {num_blocks} blocks")
    bdim = dims[0]
    per = cache.shape[bdim] // num_blocks
    block_size = logical_block_size // per
    dtype = cache.dtype
    if dtype not in _EXACT_INT:
        raise ValueError(f"cannot probe KV dtype {dtype} exactly")
    base = _EXACT_INT[dtype]
    shape = list(cache.shape)
    shape[bdim] = 2
    scratch = torch.empty(shape, dtype=dtype)
    n_el = block_size * 2 * num_kv_heads * head_dim
    ids = torch.arange(n_el, dtype=torch.int64).view(block_size, 2, num_kv_heads, head_dim)
    passes, cap = 1, base
    while cap < n_el:
        passes += 1
        cap *= base
    found = torch.zeros(scratch.numel(), dtype=torch.int64)
    written = None
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)  # block 1 of 2
    for p in range(passes):
        digit = (ids // (base ** p)) % base
        scratch.fill_(-1)
        key = digit[:, 0].to(dtype).contiguous()
        value = digit[:, 1].to(dtype).contiguous()
        impl.do_kv_cache_update(layer, key, value, scratch, slots)
        got = scratch.reshape(-1).to(torch.int64)
        mask = got >= 0
        written = mask if written is None else written & mask
        found += torch.where(mask, got, torch.zeros_like(got)) * (base ** p)
    pos = written.nonzero().view(-1)
    if pos.numel() != n_el:
        raise ValueError(f"backend wrote {pos.numel()} elements for {n_el} K/V values")
    vals = found[pos]
    if not torch.equal(torch.sort(vals).values, torch.arange(n_el)):
        raise ValueError("backend write is not a one-to-one placement of K/V elements")
    coords = torch.stack(torch.unravel_index(pos, tuple(shape)), dim=1)  # [n_el, ndim]
    if not bool((coords[:, bdim] == 1).all()):
        raise ValueError("backend wrote outside the probed block")
    coords[:, bdim] = 0
    real_stride = torch.tensor(cache.stride(), dtype=torch.int64)
    inner = torch.empty(n_el, dtype=torch.int64)
    inner[vals] = (coords * real_stride).sum(dim=1)
    return PagedLayout(block_size, bdim, inner.view(block_size, 2, num_kv_heads, head_dim),
                       int(cache.stride(bdim)), tuple(cache.shape), tuple(cache.stride()))

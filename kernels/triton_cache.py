"""Triton kernels for CUDA: block <-> chunk gather/scatter and block copies of the paged KV pool.

Same signatures, shapes and semantics as ``kernels.reference`` (``gather_chunk``,
``scatter_chunk``, ``copy_blocks``), the spec they are tested against (in the Triton interpreter
on CPU tensors, tests/kernels/test_kernels_triton_cache.py, and compiled on CUDA). Used by
``kernels.ops`` for CUDA tensors.

Every one of them is a copy of whole blocks, so one kernel does all three. A block of the pool
``kv_cache[l, kv, b]`` is ``block_size * num_kv_heads * head_dim`` contiguous elements; the
kernel copies the bits (the tensors are viewed as integers of the element's width), so the
result equals the reference's bit for bit in any dtype. One program per
(layer and K/V, block, tile of ``TILE`` elements)::

    src[l, kv, src_ids[i]]  --copy-->  dst[l, kv, dst_ids[i]]      i in [0, k)

Block ids are checked on the host before any launch (a bad id would read or write past the
pool without an error on the device): an id outside ``[0, num_blocks)``, or one that repeats
among the blocks written (the order of two writes to one block is undefined on a GPU), raises
``ValueError`` and nothing is written. Ids given as a CUDA tensor cost one synchronizing check.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: elements per program (at most: one block's elements rounded up to a power of two)
MAX_TILE = 4096
#: blocks per launch (CUDA's limit on a grid's second dimension); more are copied in turns
MAX_BLOCKS_PER_LAUNCH = 65535
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
                        src_stride_l, src_stride_kv, src_stride_b,
                        dst_stride_l, dst_stride_kv, dst_stride_b, block_numel,
                        SRC_IDS: tl.constexpr, DST_IDS: tl.constexpr, TILE: tl.constexpr):
    lk = tl.program_id(0).to(tl.int64)                 # layer * 2 + (0 = K, 1 = V)
    i = tl.program_id(1).to(tl.int64)                  # i-th block of the chunk
    offs = tl.program_id(2).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < block_numel
    layer, kv = lk // 2, lk % 2
    if SRC_IDS:
        sb = tl.load(src_ids_ptr + i).to(tl.int64)
    else:
        sb = i
    if DST_IDS:
        db = tl.load(dst_ids_ptr + i).to(tl.int64)
    else:
        db = i
    x = tl.load(src_ptr + layer * src_stride_l + kv * src_stride_kv + sb * src_stride_b + offs,
                mask=mask)
    tl.store(dst_ptr + layer * dst_stride_l + kv * dst_stride_kv + db * dst_stride_b + offs, x,
             mask=mask)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element's width (same memory, same strides)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _check_pool(kv_cache: torch.Tensor, name: str = "kv_cache") -> None:
    """Raise ValueError unless ``kv_cache`` is 6-D with each block's elements contiguous."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"{name} must be [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {list(kv_cache.shape)}")
    if kv_cache.numel() and not kv_cache[0, 0, 0].is_contiguous():
        raise ValueError(f"{name}: each block's [block_size, num_kv_heads, head_dim] elements must "
                         f"be contiguous, got strides {list(kv_cache.stride())}")


def _block_ids(block_ids, kv_cache: torch.Tensor, unique: bool, what: str) -> torch.Tensor:
    """``block_ids`` as an int64 tensor on the pool's device, checked (see module docstring).

    Raises:
        ValueError: not 1-D, an id out of range, or a repeat when ``unique``.
    """
    ids = torch.as_tensor(block_ids, dtype=torch.long)
    if ids.dim() != 1:
        raise ValueError(f"{what} must be a 1-D list of block ids, got shape {list(ids.shape)}")
    nb = kv_cache.shape[2]
    if ids.numel():
        bad = (ids < 0) | (ids >= nb)
        if bool(bad.any()):
            raise ValueError(f"{what}: block id {int(ids[bad][0])} is outside the pool's "
                             f"{nb} blocks")
        if unique and torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"{what}: a block id repeats among the blocks written "
                             f"({ids.tolist() if ids.numel() <= 16 else 'ids'})")
    return ids.to(kv_cache.device)


def _launch(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor | None,
            dst_ids: torch.Tensor | None, k: int) -> None:
    """Copy ``k`` blocks from ``src`` to ``dst`` (both 6-D pools or chunk views, one layout):
    block ``src_ids[i]`` (else ``i``) to block ``dst_ids[i]`` (else ``i``)."""
    layers, _, _, bs, h, d = src.shape
    numel = bs * h * d
    if k == 0 or numel == 0 or layers == 0:
        return
    tile = min(triton.next_power_of_2(numel), MAX_TILE)
    s, t = _bits(src), _bits(dst)
    for lo in range(0, k, MAX_BLOCKS_PER_LAUNCH):
        hi = min(k, lo + MAX_BLOCKS_PER_LAUNCH)
        si = None if src_ids is None else src_ids[lo:hi]
        di = None if dst_ids is None else dst_ids[lo:hi]
        sv = s if si is not None else s[:, :, lo:hi]       # a chunk side: its blocks lo..hi
        tv = t if di is not None else t[:, :, lo:hi]
        _copy_blocks_kernel[(layers * 2, hi - lo, triton.cdiv(numel, tile))](
            sv, tv, si if si is not None else sv, di if di is not None else tv,
            sv.stride(0), sv.stride(1), sv.stride(2), tv.stride(0), tv.stride(1), tv.stride(2),
            numel, SRC_IDS=si is not None, DST_IDS=di is not None, TILE=tile)


def gather_chunk(kv_cache: torch.Tensor, block_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """See ``kernels.reference.gather_chunk``: ``[num_layers, 2, k * block_size, num_kv_heads,
    head_dim]``, a new contiguous tensor.

    Raises:
        ValueError: a block id outside the pool, or a pool whose blocks are not contiguous.
    """
    _check_pool(kv_cache)
    ids = _block_ids(block_ids, kv_cache, unique=False, what="gather_chunk")
    layers, _, _, bs, h, d = kv_cache.shape
    k = ids.numel()
    out = torch.empty(layers, 2, k, bs, h, d, dtype=kv_cache.dtype, device=kv_cache.device)
    _launch(kv_cache, out, ids, None, k)
    return out.view(layers, 2, k * bs, h, d)


def scatter_chunk(kv_cache: torch.Tensor, block_ids: torch.Tensor | list[int],
                  chunk: torch.Tensor) -> None:
    """See ``kernels.reference.scatter_chunk`` (in place; the chunk is converted to the pool's
    dtype first, as there).

    Raises:
        ValueError: the chunk's shape does not match ``k`` blocks of this pool, a block id
            outside the pool or repeated, or a pool whose blocks are not contiguous. Nothing
            is written then. A chunk on another device (a host chunk from the store) is copied
            to the pool's device first.
    """
    _check_pool(kv_cache)
    ids = _block_ids(block_ids, kv_cache, unique=True, what="scatter_chunk")
    layers, _, _, bs, h, d = kv_cache.shape
    k = ids.numel()
    want = (layers, 2, k * bs, h, d)
    if tuple(chunk.shape) != want:
        raise ValueError(f"chunk shape {list(chunk.shape)} does not fit {k} blocks: "
                         f"expected {list(want)}")
    # [num_layers, 2, k, block_size, num_kv_heads, head_dim], on the pool's device and dtype
    src = chunk.to(device=kv_cache.device, dtype=kv_cache.dtype).contiguous().view(
        layers, 2, k, bs, h, d)
    _launch(src, kv_cache, None, ids, k)


def copy_blocks(kv_cache: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """See ``kernels.reference.copy_blocks``: ``src[i] -> dst[i]`` in every layer, every source
    read before any destination is written (a gather, then a scatter).

    Raises:
        ValueError: ``src`` and ``dst`` of different lengths, an id outside the pool, or a
            destination id repeated. Nothing is written then.
    """
    if len(src) != len(dst):
        raise ValueError(f"copy_blocks: {len(src)} source blocks, {len(dst)} destinations")
    if len(src):
        _block_ids(dst, kv_cache, unique=True, what="copy_blocks")
        scatter_chunk(kv_cache, dst, gather_chunk(kv_cache, src))

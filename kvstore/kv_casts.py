"""Casts and scratch for the lossy KV codecs (``kvstore.kv_codec``): fp32 -> float8_e4m3fn
and fp32 -> bf16 as integer numpy operations on the fp32 bits (numpy has neither type),
rounding to nearest even exactly as torch's casts do; temporaries in per-thread scratch, the
work cut in blocks of whole layers.

Why scratch: a whole-chunk temporary (a 64-token chunk of a 30-layer model is 2.9 MB in
fp32) is fresh memory on every call (glibc returns it to the OS once two of them are freed),
so a pass over it first takes ~700 page faults (measured: ~1,600 faults per fp8 encode);
this thread's reused scratch faults once. Blocks of about ``BLOCK_ELEMS`` values bound that
scratch (a 64-token chunk of a 30-layer model is one block; smaller blocks cost more numpy
calls than they save in cache misses, measured). Why not torch: each torch op splits over
its OpenMP threads, and on a busy host each waits a scheduler slice (~15 ms per op measured
on a loaded 2-core host).
"""
from __future__ import annotations

import threading

import numpy as np
import torch

#: Values per block of layers (at least one layer per block).
BLOCK_ELEMS = 1 << 20
#: float32 value of each e4m3fn byte (decoding is a lookup in it).
E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
_E4M3_MIN_NORMAL_BITS = np.uint32(121 << 23)  # 2**-6
_local = threading.local()


def layer_blocks(num_layers: int, per_layer: int) -> list[slice]:
    """Slices of whole layers, each of about ``BLOCK_ELEMS`` values (``per_layer`` values a
    layer) and at least one layer, covering ``range(num_layers)`` in order."""
    step = max(1, BLOCK_ELEMS // max(per_layer, 1))
    return [slice(i, min(i + step, num_layers)) for i in range(0, num_layers, step)]


def scratch(name: str, n: int, dtype) -> np.ndarray:
    """This thread's reusable 1-D array ``name`` of ``n`` elements of ``dtype`` (contents
    undefined; valid until the next call with the same name in this thread)."""
    bufs = _local.__dict__.setdefault("bufs", {})
    nbytes = n * np.dtype(dtype).itemsize
    buf = bufs.get(name)
    if buf is None or buf.size < nbytes:
        buf = bufs[name] = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes].view(dtype)


def to_e4m3(t: np.ndarray, out: np.ndarray) -> None:
    """Write the float8_e4m3fn bytes of ``t`` (contiguous fp32, each ``|t| < 464``: the
    values ``kv_codec`` quantizes are at most 448) to ``out`` (contiguous uint8, as many
    elements): round to nearest even, the sign of a zero kept, as torch's cast."""
    u = t.reshape(-1).view(np.uint32)
    o = out.reshape(-1)
    a = np.bitwise_and(u, np.uint32(0x7FFFFFFF), out=scratch("e4m3_a", u.size, np.uint32))
    r = np.right_shift(a, np.uint32(20), out=scratch("e4m3_r", u.size, np.uint32))
    r &= np.uint32(1)                                        # normal: drop 20 mantissa bits,
    r += a                                                   # ties to even
    r += np.uint32(0x7FFFF)
    r >>= np.uint32(20)
    np.copyto(o, r, casting="unsafe")                        # low byte, then rebias:
    o += np.uint8(64)                                        # - (127 - 7) << 3, mod 256
    sub = np.flatnonzero(a < _E4M3_MIN_NORMAL_BITS)          # |t| < 2**-6: steps of 2**-9
    if sub.size:
        o[sub] = np.rint(a[sub].view(np.float32) * np.float32(512))
    sign = np.bitwise_and(t.reshape(-1).view(np.uint8)[3::4], np.uint8(0x80),
                          out=scratch("e4m3_s", u.size, np.uint8))
    o |= sign                                                # little-endian fp32's top byte


def to_bf16_bits(x: np.ndarray, out: np.ndarray) -> None:
    """Write the bf16 bits of ``x`` (contiguous fp32) to ``out`` (uint16, as many elements):
    round to nearest even, a NaN as 0x7fc0 (torch's scalar cast)."""
    u = x.reshape(-1).view(np.uint32)
    r = np.right_shift(u, np.uint32(16), out=scratch("bf16_r", u.size, np.uint32))
    r &= np.uint32(1)
    r += u
    r += np.uint32(0x7FFF)
    r >>= np.uint32(16)
    o = out.reshape(-1)
    np.copyto(o, r, casting="unsafe")
    nan = np.flatnonzero(np.isnan(x.reshape(-1)))
    if nan.size:
        o[nan] = 0x7FC0


def store_fp32(src: np.ndarray, dest: torch.Tensor) -> None:
    """Write ``src`` (contiguous fp32) to ``dest`` (a CPU fp16 or bf16 tensor of its shape,
    contiguous), rounded to nearest even."""
    if dest.dtype == torch.float16:
        np.copyto(dest.numpy(), src, casting="same_kind")
    else:
        to_bf16_bits(src, dest.view(torch.int16).numpy().view(np.uint16))

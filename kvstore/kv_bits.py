"""Bit packing of quantization codes for ``kvstore.kv_grouped`` (the ``kivi`` codec): 8 codes
of ``bits`` bits (1-8) in ``bits`` bytes, little-endian, vectorized numpy (whole-array shifts
and masks on uint64 words; no per-element Python). Unpacking loads each group of ``bits``
bytes as one unaligned little-endian uint64 (a strided view of the packed bytes): no copy of
the groups into 8-byte rows, which cost more than the shifts."""
from __future__ import annotations

import numpy as np


def _lane_masks(bits: int) -> list[tuple[np.uint64, np.uint64, np.uint64]]:
    """(code bits moved, lane shift, mask) of the 3 levels that spread 8 codes of ``bits``
    bits (bits 0 to ``8 * bits`` of a little-endian uint64) into the 8 bytes of the uint64,
    widest first: 4 codes to each 32-bit half, 2 to each 16-bit lane, 1 to each byte."""
    out = []
    for width, lane in ((4 * bits, 64), (2 * bits, 32), (bits, 16)):
        m = 0
        for start in range(0, 64, lane):
            m |= ((1 << width) - 1) << start
        out.append((np.uint64(width), np.uint64(lane // 2), np.uint64(m)))
    return out


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """``codes`` (uint8, each < 2**bits) packed at ``bits`` bits, little-endian: 8 codes in
    ``bits`` bytes (the last 8 zero-padded). A new 1-D uint8 array of ``ceil(n / 8) * bits``
    (8 codes as a uint64, merged in 3 levels of whole-array shifts and masks; code i of 8
    lands at bit ``bits * i``)."""
    flat = codes.reshape(-1)
    n8 = -(-flat.size // 8)
    w = np.empty(n8 * 8, dtype=np.uint8)
    w[:flat.size] = flat
    w[flat.size:] = 0
    if bits == 8:
        return w
    z = w.view("<u8")                                         # [n8]: 8 codes each
    hi = np.empty_like(z)
    for width, lane_shift, m in reversed(_lane_masks(bits)):
        np.right_shift(z, lane_shift, out=hi)
        hi &= m
        hi <<= width
        z &= m
        z |= hi
    return np.ascontiguousarray(w.reshape(n8, 8)[:, :bits]).reshape(-1)


def _words(packed: np.ndarray, bits: int, n8: int) -> np.ndarray:
    """The ``n8`` groups of ``bits`` bytes of ``packed`` (contiguous uint8) as little-endian
    uint64 words (a new array), bits above ``8 * bits`` zero: each word is one unaligned
    8-byte load at a stride of ``bits`` bytes (reading 8 - ``bits`` bytes of the next groups,
    masked off), but the last few (whose load would pass the end), copied out of their own
    bytes."""
    z = np.empty(n8, dtype="<u8")
    loads = max(0, (n8 * bits - 8) // bits + 1)              # words k with k * bits + 8 <= end
    if loads:
        z[:loads] = np.ndarray((loads,), dtype="<u8", buffer=packed, strides=(bits,))
    last = np.zeros((n8 - loads, 8), dtype=np.uint8)
    last[:, :bits] = packed[loads * bits:n8 * bits].reshape(-1, bits)
    z[loads:] = last.view("<u8").reshape(-1)
    z &= np.uint64((1 << 8 * bits) - 1)
    return z


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The ``n`` codes (a new uint8 array) of ``pack_bits`` (the inverse levels)."""
    if bits == 8:
        return np.array(packed[:n], dtype=np.uint8)
    n8 = -(-n // 8)
    if n8 == 0:
        return np.empty(0, dtype=np.uint8)
    z = _words(np.ascontiguousarray(packed[:n8 * bits]), bits, n8)   # 8 codes each
    hi = np.empty_like(z)
    for width, lane_shift, m in _lane_masks(bits):
        np.right_shift(z, width, out=hi)
        hi &= m
        hi <<= lane_shift
        z &= m
        z |= hi
    return z.view(np.uint8)[:n]


def pack_wide(codes: np.ndarray, bits: int, units: int) -> np.ndarray:
    """``codes`` (uint16, each < 2**bits, ``bits`` 9-16) packed at ``bits`` bits per code in
    ``units`` equal units (whole layers, or 1): per unit of n codes, their low bytes (``ceil(n
    / 8) * 8``, zero-padded), then their high ``bits - 8`` bits as ``pack_bits`` packs them;
    ``ceil(n / 8) * bits`` bytes per unit. A new 1-D uint8 array."""
    c = codes.reshape(units, -1)
    n8 = -(-c.shape[1] // 8)
    wide = np.zeros((units, n8 * 8), dtype=np.uint16)
    wide[:, :c.shape[1]] = c
    lo = (wide & 0xFF).astype(np.uint8)
    hi = pack_bits((wide >> 8).astype(np.uint8), bits - 8).reshape(units, -1)
    return np.concatenate([lo, hi], axis=1).reshape(-1)


def unpack_wide(packed: np.ndarray, bits: int, units: int, n: int) -> np.ndarray:
    """The ``units`` x ``n`` codes (a new uint16 array ``[units, n]``) of ``pack_wide``."""
    n8 = -(-n // 8)
    a = packed[:units * n8 * bits].reshape(units, n8 * bits)
    hi = unpack_bits(np.ascontiguousarray(a[:, n8 * 8:]).reshape(-1), bits - 8, units * n8 * 8)
    out = hi.reshape(units, n8 * 8)[:, :n].astype(np.uint16)
    out <<= 8
    out |= a[:, :n]
    return out

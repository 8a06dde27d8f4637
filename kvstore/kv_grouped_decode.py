"""Decoding of ``kvstore.kv_grouped`` payloads (the ``kivi`` codec): ``Decoder`` checks a
payload's parts once and decodes blocks of whole layers straight into the caller's fp32 tensor
(``decode`` for all layers at once). The payload format and the error bound are stated in
``kvstore.kv_grouped``.
"""
from __future__ import annotations

import numpy as np

from kvstore.kv_bits import unpack_bits, unpack_wide
from kvstore.kv_grouped import (PartParams, _grouped, _ungrouped, nbytes, read_params,
                                read_sinks, step_table)


def decode(payload: np.ndarray, shape: tuple[int, ...], out: np.ndarray) -> None:
    """Decode ``payload`` (uint8) into ``out`` (fp32 ``shape``, written).

    Raises:
        ValueError: invalid parameters or a payload size other than ``nbytes``'s.
    """
    Decoder(payload, shape).decode(slice(0, shape[0]), out)


class Decoder:
    """A payload's parts, checked, to decode a block of whole layers at a time.

    Raises (at construction):
        ValueError: invalid parameters or a payload size other than ``nbytes``'s.
    """

    def __init__(self, payload: np.ndarray, shape: tuple[int, ...]) -> None:
        params, sdt = read_params(payload)
        num_sinks, sink_dt = read_sinks(payload)
        L, _, T, H, D = shape
        if num_sinks > T:
            raise ValueError(f"kivi payload has {num_sinks} sink tokens, chunk_size is {T}")
        want = nbytes(params, shape, sdt.itemsize, num_sinks, sink_dt.itemsize)
        if payload.size != want:
            raise ValueError(f"kivi payload of {payload.size} bytes, shape {list(shape)} "
                             f"needs {want}")
        self.shape, self.parts = tuple(shape), (params.k, params.v)
        n, pos, self._ranges, self._codes = L * T * H * D, 0, [], []
        for part in self.parts:
            g = part.num_groups(shape)
            lead = (L, g // L if L else 0)                  # groups of a layer are contiguous
            arrays = []
            if not part.symmetric:                           # mins
                arrays.append(payload[pos:pos + g * sdt.itemsize].view(sdt).reshape(lead))
                pos += g * sdt.itemsize
            if part.fp_steps:                                # steps in the scale dtype
                arrays.append(payload[pos:pos + g * sdt.itemsize].view(sdt).reshape(lead))
                pos += g * sdt.itemsize
            else:                                            # step codes, then their base
                codes = payload[pos:pos + g].reshape(lead)
                arrays.append((step_table(payload[pos + g:pos + g + 4].view("<f4")[0]), codes))
                pos += g + 4
            self._ranges.append(arrays)
        for part in self.parts:
            nb = -(-n // 8) * part.bits
            self._codes.append(payload[pos:pos + nb])
            pos += nb
        sink_shape = (L, 2, num_sinks, H, D)
        self._sinks = None if not num_sinks else payload[
            pos:pos + int(np.prod(sink_shape)) * sink_dt.itemsize].view(
            sink_dt.newbyteorder("<")).reshape(sink_shape)   # [L, 2, n, H, D]
        #: whether ``decode`` takes any block of layers (a layer's codes fill whole bytes)
        self.blockable = (T * H * D) % 8 == 0

    def decode(self, layers: slice, out: np.ndarray) -> None:
        """Decode ``layers`` (a slice of whole layers, step 1; every layer unless
        ``blockable``) into ``out`` (fp32 ``[len(layers), 2, T, H, D]``, written)."""
        L, _, T, H, D = self.shape
        l0, l1 = layers.start, layers.stop
        shape = (l1 - l0, T, H, D)
        per = T * H * D
        for i, part in enumerate(self.parts):
            nb = per // 8 * part.bits if self.blockable else None
            packed = self._codes[i] if nb is None else self._codes[i][l0 * nb:l1 * nb]
            if part.bits == 8:                               # the codes as stored: a view
                q = packed[:(l1 - l0) * per].reshape(shape)
            elif part.bits > 8:                              # per layer (or chunk): low, high
                units = l1 - l0 if self.blockable else 1
                q = unpack_wide(packed, part.bits, units, (l1 - l0) * per // units).reshape(shape)
            else:
                q = unpack_bits(packed, part.bits, (l1 - l0) * per).reshape(shape)
            qg, axis = _grouped(q, part)
            gshape = qg.shape[:axis] + (1,) + qg.shape[axis + 1:]
            m_s = []
            for r in self._ranges[i]:
                if isinstance(r, tuple):                     # steps: table[codes]
                    table, codes = r
                    m_s.append(table[codes[l0:l1]].reshape(gshape))
                else:
                    m_s.append(r[l0:l1].astype(np.float32).reshape(gshape))
            dest = _grouped_view(out[:, i], part)            # None: a last group is shorter
            xg = np.empty(qg.shape, np.float32) if dest is None else dest
            if part.symmetric:                               # (q - c) * s
                np.subtract(qg, np.float32(2 ** (part.bits - 1) - 1), out=xg, dtype=np.float32)
                xg *= m_s[0]
            else:                                            # q * s + m
                np.multiply(qg, m_s[1], out=xg, dtype=np.float32)
                xg += m_s[0]
            if dest is None:
                out[:, i] = _ungrouped(xg, part, shape)
        if self._sinks is not None:                          # the stored tokens replace theirs
            out[:, :, :self._sinks.shape[2]] = self._sinks[l0:l1]


def _grouped_view(x: np.ndarray, part: PartParams) -> np.ndarray | None:
    """``x`` (``[L, T, H, D]``, any strides) as ``_grouped`` splits it, as a view (writes
    reach ``x``); None when the group does not divide the axis."""
    L, T, H, D = x.shape
    if part.along == "tokens":
        shape = (L, T // part.group, part.group, H, D) if T % part.group == 0 else None
    else:
        shape = (L, T, H, D // part.group, part.group) if D % part.group == 0 else None
    if shape is None:
        return None
    v = x.view()
    v.shape = shape                                          # splits one axis: never a copy
    return v

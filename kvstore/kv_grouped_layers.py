"""Per-layer parameters for the ``kivi`` codec: a chunk cut into runs of consecutive layers,
each run a ``kvstore.kv_grouped`` payload of its own parameters (bits, groups, modes), so the
layers that change answers most can get more bits than the rest.

Payload (little-endian)::

    run 0's payload | run 1's payload | ... | size of each u32 | layers of each u8
    | number of runs u8 | 0xFF

Each run's payload is exactly ``kv_grouped.encode`` of the run's layers ``x[l0:l1]`` (with the
chunk's sink tokens of those layers), so every run states its own parameters, scale dtype and
sinks, and its error bound is ``kv_grouped``'s. The last byte, 0xFF, is not a valid scale
dtype code, so a layered payload is never read as a plain one (a plain payload ends with 0
or 1). Overhead: 5 bytes per run and 2.
"""
from __future__ import annotations

import numpy as np

from kvstore import kv_grouped, kv_grouped_decode

MARK = 0xFF


def runs_for(layer_params: list[kv_grouped.GroupParams]
             ) -> list[tuple[int, kv_grouped.GroupParams]]:
    """Per-layer parameters (one per layer) -> runs ``(num_layers, params)`` of equal ones."""
    runs: list[tuple[int, kv_grouped.GroupParams]] = []
    for p in layer_params:
        if runs and runs[-1][1] == p and runs[-1][0] < 255:
            runs[-1] = (runs[-1][0] + 1, p)
        else:
            runs.append((1, p))
    return runs


def _check_runs(runs, num_layers: int) -> None:
    if not 1 <= len(runs) <= 255 or sum(n for n, _ in runs) != num_layers \
            or any(not 1 <= n <= 255 for n, _ in runs):
        raise ValueError(f"runs must cover the {num_layers} layers in 1-255 runs of 1-255 "
                         f"layers; got {[n for n, _ in runs]}")


def encode(x: np.ndarray, runs, sink_tokens: int = 0) -> np.ndarray:
    """Payload of ``x`` (fp32 ``[L, 2, T, H, D]``) with ``runs`` (``[(num_layers, params)]``
    covering the L layers in order), keeping the first ``min(sink_tokens, T)`` tokens as
    sinks in every run.

    Raises:
        ValueError: runs that do not cover the layers, or as ``kv_grouped.encode``.
    """
    _check_runs(runs, x.shape[0])
    parts, l0 = [], 0
    for n, params in runs:
        parts.append(kv_grouped.encode(x[l0:l0 + n], params, sink_tokens))
        l0 += n
    tail = [np.array([p.size for p in parts], "<u4").view(np.uint8),
            np.array([n for n, _ in runs] + [len(runs), MARK], np.uint8)]
    return np.concatenate(parts + tail)


def is_layered(payload: np.ndarray) -> bool:
    """Whether ``payload`` (uint8) is a layered payload (its last byte is 0xFF)."""
    return payload.size > 0 and int(payload[-1]) == MARK


def nbytes(runs, shape: tuple[int, ...], scale_itemsize: int = 2, sink_tokens: int = 0,
           sink_itemsize: int = 2) -> int:
    """Payload bytes for a chunk of ``shape`` (as ``kv_grouped.nbytes``, per run)."""
    _check_runs(runs, shape[0])
    return sum(kv_grouped.nbytes(p, (n,) + tuple(shape[1:]), scale_itemsize, sink_tokens,
                                 sink_itemsize) for n, p in runs) + 5 * len(runs) + 2


def split(payload: np.ndarray, num_layers: int) -> list[tuple[int, np.ndarray]]:
    """``[(first layer, run payload)]`` of a layered payload.

    Raises:
        ValueError: a payload whose table is cut, whose sizes do not add up, or whose runs do
            not cover ``num_layers`` layers.
    """
    bad = ValueError("kivi layered payload has no valid run table")
    if payload.size < 2 or not is_layered(payload):
        raise bad
    k = int(payload[-2])
    table = 2 + 5 * k
    if k == 0 or payload.size < table:
        raise bad
    layers = payload[-2 - k:-2].astype(np.int64)
    sizes = payload[-table:-2 - k].view("<u4").astype(np.int64)
    if int(layers.sum()) != num_layers or (layers == 0).any() \
            or int(sizes.sum()) != payload.size - table:
        raise bad
    out, pos, l0 = [], 0, 0
    for n, size in zip(layers.tolist(), sizes.tolist()):
        out.append((l0, payload[pos:pos + size]))
        pos, l0 = pos + size, l0 + n
    return out


class Decoder:
    """``kv_grouped_decode.Decoder`` of each run; ``decode`` takes any block of whole layers.

    Raises (at construction):
        ValueError: as ``split`` or a run's ``kv_grouped_decode.Decoder``.
    """

    def __init__(self, payload: np.ndarray, shape: tuple[int, ...]) -> None:
        L = shape[0]
        self.runs = []
        bounds = split(payload, L) + [(L, None)]
        for (l0, p), (l1, _) in zip(bounds, bounds[1:]):
            self.runs.append((l0, l1, kv_grouped_decode.Decoder(p, (l1 - l0,) + tuple(shape[1:]))))
        #: whether ``decode`` takes any block of layers
        self.blockable = all(d.blockable for _, _, d in self.runs)

    def decode(self, layers: slice, out: np.ndarray) -> None:
        """Decode ``layers`` (whole layers, step 1; all of them unless ``blockable``) into
        ``out`` (fp32 ``[len(layers), 2, T, H, D]``, written)."""
        a, b = layers.start, layers.stop
        for l0, l1, dec in self.runs:
            lo, hi = max(a, l0), min(b, l1)
            if lo < hi:
                dec.decode(slice(lo - l0, hi - l0), out[lo - a:hi - a])


def steps(x: np.ndarray, runs, sink_tokens: int = 0) -> np.ndarray:
    """The stored step of each element's group (fp32, the shape of ``x``) in a payload of
    ``encode(x, runs, sink_tokens)``."""
    out, l0 = [], 0
    for n, params in runs:
        out.append(kv_grouped.steps(x[l0:l0 + n], params, sink_tokens))
        l0 += n
    return np.concatenate(out)

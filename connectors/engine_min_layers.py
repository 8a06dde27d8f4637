"""Layer-wise loads of ``connectors.engine_min_load.Loader``: one request's pieces, read from
the store first, are written into the paged pool layer after layer (layer 0 of every piece,
then layer 1, ...), while the forward pass runs; layer ``i``'s attention waits only until
layer ``i`` is written (``LayerGate.wait_layer``, from ``EngineMinConnector.wait_for_layer_load``).

One step, ``L`` layers::

    load worker   | read pieces (store) | write 0 | write 1 | ... | write L-1 | sync, release |
    forward pass  | embed | qkv 0 | wait 0 | attn 0 | mlp 0 | qkv 1 | wait 1 | attn 1 | ...
                                  ^ returns once "write 0" is done, whatever layers 1.. do

On CUDA the writes go to a side stream (``connectors.engine_min_device.side_stream``), ordered
after the work the engine queued before the load started; each written layer records a
``DeviceEvent`` and ``wait_layer`` makes the engine's stream wait for it (the host thread does
not block on the copy itself). Borrowed pages (reader pins) go back only after the side stream
is synchronized, i.e. after the last layer's copy finished. On the CPU the writes run on the
worker thread, events are complete when recorded, and the order is kept by the gate alone.

A piece counts as landed only when every layer of it is written: a load stopped in layer ``k``
(an error, or the step's deadline passed while the engine waited) lands nothing of what it
read, and the engine recomputes those tokens (``engine_min.model_runner`` runs them again).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from connectors.engine_min_device import DeviceEvent, to_pool
from kernels import ops


@dataclass(frozen=True)
class Move:
    """One piece's tokens to write: ``src`` ``[num_layers, 2, n, num_kv_heads, head_dim]`` (a
    view of the store's pages or of a fetched chunk; ``n`` = whole blocks) into the request's
    blocks ``block_ids`` (``n / block_size`` of them, in token order)."""

    src: torch.Tensor
    block_ids: list[int]


class LayerGate:
    """Which layers of one load are written, for the engine thread to wait on (a condition of
    its own: a waiter never queues behind a layer being written)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.events: list[DeviceEvent] = []   # one per layer written, in layer order
        self.finished = False                 # the writer returned (pins released)

    def written(self, event: DeviceEvent) -> None:
        """The next layer is written (its copies end at ``event``)."""
        with self._cv:
            self.events.append(event)
            self._cv.notify_all()

    def finish(self) -> None:
        """The writer is done (every layer written, or stopped); wakes every waiter."""
        with self._cv:
            self.finished = True
            self._cv.notify_all()

    def wait_layer(self, layer: int, deadline: float, stop: Callable[[], None]) -> bool:
        """Block until ``layer`` is written, the writer finished, or ``deadline``
        (``time.perf_counter()`` seconds) passed: then ``stop()`` runs (the writer starts no
        layer after it; one it is writing may still finish). On CUDA, orders the calling
        thread's stream after the layer's copies. Returns whether ``layer`` is written."""
        with self._cv:
            while len(self.events) <= layer and not self.finished:
                left = deadline - time.perf_counter()
                if left <= 0:
                    stop()
                    return False
                self._cv.wait(left)
            if len(self.events) <= layer:
                return False
            event = self.events[layer]
        event.order_current_stream()
        return True


def write_layers(moves: list[Move], kv_cache: torch.Tensor, lock: threading.Lock,
                 gate: LayerGate, stopped: Callable[[], bool]) -> bool:
    """Write ``moves`` into ``kv_cache`` ``[num_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim]`` one layer at a time (every move's layer ``i``, then ``i + 1``),
    each layer under ``lock`` and only while ``stopped()`` is false (checked under it, so one
    who sets it and then takes ``lock`` knows no write is running or will start);
    ``gate.written`` after each. Runs on the load's worker thread (on CUDA inside its side stream).

    Returns:
        True when every layer was written.

    Raises:
        whatever a copy raises (the layers before it stay written; nothing counts as landed).
    """
    device = kv_cache.device
    for layer in range(kv_cache.shape[0]):
        with lock:
            if stopped():
                return False
            for m in moves:
                src, _ = to_pool(m.src[layer:layer + 1], device)   # [1, 2, n, H, D]
                ops.scatter_chunk(kv_cache[layer:layer + 1], m.block_ids, src)
            event = DeviceEvent(device)
        gate.written(event)
    return True

"""Moving chunks between engine_min's KV pool (on the engine's device) and a store, for
``connectors.engine_min_save`` and ``connectors.engine_min_load``.

Saves: a chunk is gathered on the pool's device (``kernels.ops.gather_chunk``, on the engine
thread's current stream). A store whose top tier is on the GPU (an in-process ``ChunkStore``
with a ``gpu`` tier) takes it there; any other store gets a host copy, made on the engine thread
into pinned memory without waiting (``stage_for_store``), so the save queue holds host bytes and
the GPU memory of the gathered chunk is free at once. Either way a ``DeviceEvent`` recorded after
the gathers (and copies) travels with the chunks, and the writer thread waits for it before the
put: the store never reads a chunk the device has not finished writing::

    engine thread   gather -> [copy to pinned host, non_blocking] -> record event -> queue
    writer thread                                          event.wait() -> put_chunks

Loads: a chunk read from the store (a host tensor, or a view of the CPU tier's pinned pages
borrowed from a ``ChunkStore``) goes to the pool's device before its scatter (``to_pool``):
``non_blocking`` only from pinned memory, and ``sync_pool`` before the source may be released
(borrowed pages go back to the store) or dropped.

Layer-wise loads (``connectors.engine_min_layers``): the worker's copies go to a side stream
(``side_stream``, ``on_stream``) that first waits for an event recorded on the engine's stream
when the load started; each written layer records a ``DeviceEvent``, and the engine's stream
waits for it (``DeviceEvent.order_current_stream``) before that layer's attention, and for the
whole side stream (``join_stream``) once the step's loads are landed::

    engine stream   [start event] ... qkv 0 | wait ev0 | attn 0 | qkv 1 | wait ev1 | attn 1 ...
    side stream     wait start | layer 0 copies, ev0 | layer 1 copies, ev1 | ... | sync, release

CPU twin: with the pool on the CPU nothing is copied (the tensors are the gathered ones, as
before devices existed), events are complete when recorded and ``sync_pool`` returns at once;
``stage_for_store(..., host=True)`` on the CPU runs the same copy code into plain memory.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch

from kvstore.api import KVStoreBase


class DeviceEvent:
    """A point in ``device``'s current stream, recorded at construction: ``wait`` returns once
    the work queued on that stream before it is done. On a non-CUDA device the work ran
    synchronously, so the event is complete at once."""

    def __init__(self, device: torch.device) -> None:
        self._event, self._device = None, device
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        """Block the calling thread until the recorded work is done (no-op on the CPU)."""
        if self._event is not None:
            self._event.synchronize()

    def order_current_stream(self) -> None:
        """Make the calling thread's current stream wait (on the device, without blocking the
        thread) until the recorded work is done: work queued after this call on that stream
        runs after it. No-op on the CPU."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)


class StagedChunks(list):
    """Gathered chunks ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` on their way to
    the writer, with ``ready``: the ``DeviceEvent`` after which their bytes are complete."""

    def __init__(self, kvs: Sequence[torch.Tensor], ready: DeviceEvent) -> None:
        super().__init__(kvs)
        self.ready = ready


def takes_device_chunks(store: KVStoreBase) -> bool:
    """Whether ``store`` should be given chunks on the pool's device: an in-process store whose
    top tier is GPU memory (it copies them device to device). Every other store is given
    host tensors (a daemon's client, a layered store, a store with CPU memory on top)."""
    caps = store.capabilities
    return not caps.remote and caps.tiers[:1] == ("gpu",)


def stage_for_store(kvs: list[torch.Tensor], device: torch.device, host: bool) -> StagedChunks:
    """``kvs`` (gathered on ``device``) ready to queue for the writer.

    Args:
        kvs: the gathered chunks, on ``device``.
        device: the pool's device.
        host: give the store host copies: each chunk is copied into new host memory (pinned
            and without waiting when ``device`` is CUDA); False keeps ``kvs`` as they are.

    Returns:
        the chunks, with the event recorded after their gathers and copies.
    """
    if host:
        pin = device.type == "cuda"
        kvs = [torch.empty(kv.shape, dtype=kv.dtype, pin_memory=pin).copy_(kv, non_blocking=pin)
               for kv in kvs]
    return StagedChunks(kvs, DeviceEvent(device))


def to_pool(kv: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, bool]:
    """``kv`` on the pool's ``device``: ``(tensor, in_flight)``. ``in_flight``: an asynchronous
    copy (pinned host -> CUDA) may still be reading ``kv``; call ``sync_pool`` before ``kv``'s
    memory is released or reused. The same tensor (no copy) when already on ``device``."""
    if kv.device == device:
        return kv, False
    pinned = device.type == "cuda" and kv.device.type == "cpu" and kv.is_pinned()
    return kv.to(device, non_blocking=pinned), pinned


def side_stream(device: torch.device) -> Any:
    """A stream of its own on ``device`` (a ``torch.cuda.Stream``; None off CUDA), for
    ``on_stream``: layer-wise loads put their copies there, beside the forward pass."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream: Any) -> Any:
    """A context manager under which the calling thread's device work goes to ``stream`` (from
    ``side_stream``; ``DeviceEvent``s recorded inside mark points of it); a no-op context for
    None (the CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def join_stream(stream: Any) -> None:
    """Order the calling thread's current stream after everything queued so far on
    ``stream`` (from ``side_stream``), without blocking the thread; no-op for None."""
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def sync_pool(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s current stream (copies into the pool);
    no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()

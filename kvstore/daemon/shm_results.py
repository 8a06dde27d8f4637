"""Recycled destinations of the same-host client's gets (``ShmKVStoreClient.get_chunks``
without ``out``): the chunk tensors a get returns are carved from buffers that go back to a
free list once the caller drops every tensor and view made from them, instead of back to the
system.

Why: a get copies each chunk out of the daemon's arena into a new tensor. A new 6-12 MB
tensor is fresh memory (the allocator hands large blocks back to the system when freed), so
the copy first takes a page fault per 4 KiB page and the kernel zeroes each one: for the 8
fp32 chunks of a 2k-token prompt (94 MB), ~23,000 faults that cost about as much as the copy
itself. Reused buffers are already mapped.

A buffer goes back only when no tensor can still reach it: each result is made from a numpy
view of its buffer, and the torch storage keeps that view alive, so the view's finalizer runs
after the last tensor sharing the storage is gone (slices and dtype views included).
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from kvstore.layout import KVLayout

#: Most bytes of free buffers kept (larger sums go back to the system): 21 fp16 or 10 fp32
#: SmolLM2 chunks.
FREE_BYTES = 128 << 20


class ResultBuffers:
    """A free list of chunk-sized byte buffers, by size. Thread-safe.

    Args:
        max_free_bytes: most bytes kept on the free list.
    """

    def __init__(self, max_free_bytes: int = FREE_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.RLock()  # (a finalizer may run while this thread holds it)

    def take(self, layout: KVLayout) -> torch.Tensor:
        """An uninitialised tensor ``layout.shape()`` of ``layout``'s dtype, contiguous, on
        a recycled buffer when one of its size is free."""
        nbytes = layout.chunk_bytes
        with self._lock:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= nbytes
        if buf is None:
            buf = np.empty(nbytes, dtype=np.uint8)
        view = buf[:]  # [chunk_bytes]; dies with the last tensor made from it
        weakref.finalize(view, self._give, buf)
        return torch.from_numpy(view).view(layout.torch_dtype).view(layout.shape())

    def _give(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + buf.nbytes <= self.max_free_bytes:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes

    @property
    def free_bytes(self) -> int:
        """Bytes on the free list now."""
        return self._free_bytes

    def check_integrity(self) -> None:
        """The free bytes counted equal the free buffers' sizes, within the cap.

        Raises:
            AssertionError: they do not.
        """
        with self._lock:
            total = sum(b.nbytes for bufs in self._free.values() for b in bufs)
            assert total == self._free_bytes <= self.max_free_bytes, (
                total, self._free_bytes, self.max_free_bytes)
            assert all(b.nbytes == n for n, bufs in self._free.items() for b in bufs)


__all__ = ["FREE_BYTES", "ResultBuffers"]

"""Copies between tiers' pools, ordered by a side stream and events: the one seam between the
memory tiers and the device's asynchronous copy engine.

A ``CopyStream`` runs ``copy_runs_async(pairs)`` (``dst.copy_(src)`` for each pair) and returns
a ``CopyHandle`` that says when the bytes have landed. Three streams share that contract:

* ``CudaCopyStream``: the copies run on a ``torch.cuda.Stream`` of their own (non-blocking,
  so a pinned host buffer is copied by DMA while kernels run). Before the copies, an event
  recorded on the caller's current stream is waited on by the side stream ("wait for the
  producer": the copy reads the KV only after the kernels queued so far have written it); an
  event recorded after the copies is the handle's completion.
* ``InlineCopyStream``: the CPU twin. Copies run at once on the calling thread; every handle is
  complete when returned.
* ``ManualCopyStream``: test-only. Copies are queued and run, in order, when the test says
  (``complete``) or when someone waits for a handle, so a test controls exactly which copies
  are in flight while the store carries on: a page reused or read too early shows up as wrong
  bytes.

Handles of one stream complete in the order they were issued (a CUDA stream, the queue of
the manual stream). A handle keeps its tensors alive until it completes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Sequence

import torch

#: ``(dst, src)``: tensors of equal shape and dtype (1-D ``uint8`` runs of two pools)
CopyPair = tuple[torch.Tensor, torch.Tensor]


class CopyHandle(ABC):
    """One issued batch of copies. ``done()`` never blocks; ``wait()`` blocks the calling
    thread until the bytes have landed (idempotent)."""

    @abstractmethod
    def done(self) -> bool:
        """Whether every copy of the batch has completed (no side effects)."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every copy of the batch has completed."""


class CopyStream(ABC):
    """Issues batches of copies for one device (see module docstring)."""

    @abstractmethod
    def copy_runs_async(self, pairs: Sequence[CopyPair]) -> CopyHandle:
        """Copy each ``src`` into its ``dst``, ordered after the work already queued on the
        caller's current stream. ``src`` must not be written, nor ``dst`` read or reused, until
        the handle is done.

        Raises:
            ValueError: a pair of tensors with different numbers of bytes.
        """

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """``copy_runs_async([(dst, src)])``."""
        return self.copy_runs_async([(dst, src)])

    def synchronize(self) -> None:
        """Block until every copy issued so far has completed."""


def _check(pairs: Sequence[CopyPair]) -> None:
    for dst, src in pairs:
        if dst.numel() * dst.element_size() != src.numel() * src.element_size():
            raise ValueError(f"copy of {src.numel() * src.element_size()} bytes into "
                             f"{dst.numel() * dst.element_size()}")


class _DoneHandle(CopyHandle):
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


DONE = _DoneHandle()


class InlineCopyStream(CopyStream):
    """CPU twin: copies run now; the handle returned is already complete."""

    def copy_runs_async(self, pairs: Sequence[CopyPair]) -> CopyHandle:
        _check(pairs)
        for dst, src in pairs:
            dst.copy_(src)
        return DONE


class _ManualHandle(CopyHandle):
    def __init__(self, stream: "ManualCopyStream", pairs: list[CopyPair]) -> None:
        self.stream, self.pairs, self.completed = stream, pairs, False

    def done(self) -> bool:
        return self.completed

    def wait(self) -> None:
        self.stream.complete_through(self)


class ManualCopyStream(CopyStream):
    """Test-only stream: copies wait in a queue until ``complete`` (or a ``wait``) runs them
    in issue order. ``num_pending`` copies batches are in flight."""

    def __init__(self) -> None:
        self._queue: deque[_ManualHandle] = deque()
        self.num_issued = 0

    @property
    def num_pending(self) -> int:
        return len(self._queue)

    def copy_runs_async(self, pairs: Sequence[CopyPair]) -> CopyHandle:
        _check(pairs)
        h = _ManualHandle(self, list(pairs))
        self._queue.append(h)
        self.num_issued += 1
        return h

    def complete(self, n: int = 1) -> int:
        """Run the oldest ``n`` pending batches (fewer if fewer are pending); returns how
        many ran."""
        ran = 0
        while self._queue and ran < n:
            h = self._queue.popleft()
            for dst, src in h.pairs:
                dst.copy_(src)
            h.pairs, h.completed = [], True
            ran += 1
        return ran

    def complete_through(self, handle: CopyHandle) -> None:
        """Run pending batches up to and including ``handle`` (stream order)."""
        while not handle.done():
            if not self.complete(1):
                raise RuntimeError("handle of another stream")

    def synchronize(self) -> None:
        self.complete(len(self._queue))


class _CudaHandle(CopyHandle):
    def __init__(self, event, keep: list[CopyPair]) -> None:
        self.event, self._keep = event, keep

    def done(self) -> bool:
        if self._keep and self.event.query():
            self._keep = []
        return not self._keep

    def wait(self) -> None:
        self.event.synchronize()
        self._keep = []


class CudaCopyStream(CopyStream):
    """Copies on a side ``torch.cuda.Stream`` of ``device``, ordered after the caller's
    current stream by an event (see module docstring).

    Raises:
        RuntimeError: CUDA is not available.
    """

    def __init__(self, device: str | torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaCopyStream needs CUDA")
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def copy_runs_async(self, pairs: Sequence[CopyPair]) -> CopyHandle:
        _check(pairs)
        producer = torch.cuda.current_stream(self.device).record_event()
        self.stream.wait_event(producer)
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = self.stream.record_event()
        return _CudaHandle(done, list(pairs))

    def synchronize(self) -> None:
        self.stream.synchronize()


def run_pairs(dst_pool: torch.Tensor, dst_runs: tuple[tuple[int, int], ...],
              src_pool: torch.Tensor, src_runs: tuple[tuple[int, int], ...]) -> list[CopyPair]:
    """``(dst view, src view)`` pairs copying the bytes of ``src_runs`` (in ``src_pool``) into
    ``dst_runs`` (in ``dst_pool``), both ``(byte offset, length)`` runs covering the same
    number of bytes; a pair per stretch where neither side changes run."""
    pairs, i, j, di, sj = [], 0, 0, 0, 0  # run indices, bytes used of the current runs
    while i < len(dst_runs) and j < len(src_runs):
        (doff, dn), (soff, sn) = dst_runs[i], src_runs[j]
        n = min(dn - di, sn - sj)
        pairs.append((dst_pool[doff + di:doff + di + n], src_pool[soff + sj:soff + sj + n]))
        di, sj = di + n, sj + n
        if di == dn:
            i, di = i + 1, 0
        if sj == sn:
            j, sj = j + 1, 0
    return pairs


def make_copy_stream(device: str | torch.device) -> CopyStream:
    """The stream for a pool on ``device``: ``CudaCopyStream`` on CUDA, else inline copies."""
    if torch.device(device).type == "cuda":
        return CudaCopyStream(device)
    return InlineCopyStream()

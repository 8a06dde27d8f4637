"""In-flight payload byte budget and reusable payload buffer pool of the kvstore server."""
from __future__ import annotations

import asyncio
import threading

import torch

from kvstore.daemon import protocol as P


class ByteBudget:
    """Asyncio byte budget (a counting semaphore in bytes) for payloads in flight.

    ``acquire(n)`` waits until ``n`` more bytes fit under ``capacity`` (a request of more than
    ``capacity`` waits until nothing else is held, then runs alone); waiters are served in
    arrival order, so a large request is not starved by small ones. Event-loop only.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self.peak = 0
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def _fits(self, n: int) -> bool:
        return self.held == 0 or self.held + n <= self.capacity

    async def acquire(self, n: int, timeout_s: float) -> None:
        """Take ``n`` bytes, waiting up to ``timeout_s`` seconds.

        Raises:
            P.ProtocolError(503): still no room after ``timeout_s``.
        """
        if self.capacity <= 0:
            return
        if not self._waiters and self._fits(n):
            self._take(n)
            return
        fut = asyncio.get_running_loop().create_future()
        item = (n, fut)
        self._waiters.append(item)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():  # granted just as the timeout fired
                self.release(n)
            else:
                self._waiters.remove(item)
                self._wake()
            raise P.ProtocolError(f"server busy: {self.held} payload bytes in flight "
                                  f"(budget {self.capacity}); waited {timeout_s:.3g} s", 503)
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)
            elif item in self._waiters:
                self._waiters.remove(item)
                self._wake()
            raise

    def _take(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def release(self, n: int) -> None:
        """Give back ``n`` bytes taken by ``acquire`` and wake waiters that now fit."""
        if self.capacity <= 0:
            return
        self.held -= n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.pop(0)
            if fut.done():
                continue
            self._take(n)
            fut.set_result(None)


class BufferPool:
    """Reusable payload buffers (1-D ``uint8`` CPU tensors), kept per size up to
    ``max_bytes`` in all. Put bodies are read into them and get results copied into them, so
    a busy server neither allocates nor page-faults a fresh 5.9 MB buffer per chunk, and its
    memory above the tiers stays at most the in-flight byte budget. Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pooled = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` bytes (contents undefined)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.pooled -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, bufs) -> None:
        """Return buffers obtained from ``take`` (the caller no longer uses them)."""
        with self._lock:
            for b in bufs:
                n = b.numel()
                if self.pooled + n <= self.max_bytes:
                    self._free.setdefault(n, []).append(b)
                    self.pooled += n

"""The copies in flight into and out of one memory tier's pages, and the pages whose release
waits for them.

A memory tier (``kvstore.tiers.memory``) that receives a chunk by an asynchronous copy
(``MemoryTier.put_from``: a spill or a promote) records the copy's handle as *incoming* for
that chunk: a reader waits for it before touching the pages. The tier the bytes come from
records the same handle as *outgoing*. A chunk deleted while either copy is pending does not
give its pages back: they are *deferred* until every handle they wait for is done, so a page
is never handed out again while a copy still reads or writes it::

    put_from ─► incoming[key] = h ──(h done)──► readable without waiting
    delete(key) with h pending ─► deferred (h, pages) ──(h done; reclaim)──► allocator.free

Deferred pages are logically free (the tier's ``used_bytes`` leaves them out, so eviction does
not make room twice); an allocation that needs them waits for their copies first (``reclaim``).
Completed handles are never recorded (the CPU twin's copies complete at once), so a CPU-only
store carries no bookkeeping. Called under the owning tier's lock.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from kvstore.keys import ChunkKey
from kvstore.tiers.copy_stream import CopyHandle

#: ``(first page id, number of pages)``: a run of consecutive pages (as ``memory.Extent``)
Extent = tuple[int, int]


class InflightCopies:
    """Pending copies of one tier (see module docstring).

    Attributes:
        incoming: key -> handle of the copy writing its pages.
        outgoing: key -> handle of the latest copy reading its pages (handles of one stream
            complete in order, so the latest covers earlier ones).
        deferred: ``(handles, pages)`` of deleted chunks, in deletion order.
        num_deferred_pages: pages held by ``deferred``.
    """

    def __init__(self) -> None:
        self.incoming: dict[ChunkKey, CopyHandle] = {}
        self.outgoing: dict[ChunkKey, CopyHandle] = {}
        self.deferred: deque[tuple[tuple[CopyHandle, ...], tuple[Extent, ...]]] = deque()
        self.num_deferred_pages = 0

    def add_incoming(self, key: ChunkKey, handle: CopyHandle) -> None:
        if not handle.done():
            self.incoming[key] = handle

    def add_outgoing(self, key: ChunkKey, handle: CopyHandle) -> None:
        if not handle.done():
            self.outgoing[key] = handle

    def forget(self, key: ChunkKey) -> tuple[CopyHandle, ...]:
        """Stop tracking ``key`` (deleted); returns its handles still pending."""
        hs = (self.incoming.pop(key, None), self.outgoing.pop(key, None))
        return tuple(h for h in hs if h is not None and not h.done())

    def defer(self, handles: tuple[CopyHandle, ...], pages: tuple[Extent, ...]) -> None:
        """Hold ``pages`` until every handle in ``handles`` is done."""
        self.deferred.append((handles, pages))
        self.num_deferred_pages += sum(c for _, c in pages)

    def reclaim(self, free: Callable[[tuple[Extent, ...]], None], num_free: Callable[[], int],
                need: int = 0) -> None:
        """Free (``free(pages)``) the deferred pages whose copies are done, then, while fewer
        than ``need`` pages are free (``num_free()``), wait for the oldest deferred copies and
        free their pages too. Also drops completed handles from ``incoming``/``outgoing``."""
        for table in (self.incoming, self.outgoing):
            for key in [k for k, h in table.items() if h.done()]:
                del table[key]
        kept = deque()
        for handles, pages in self.deferred:
            if all(h.done() for h in handles):
                self._free(free, pages)
            else:
                kept.append((handles, pages))
        self.deferred = kept
        while self.deferred and num_free() < need:
            handles, pages = self.deferred.popleft()
            for h in handles:
                h.wait()
            self._free(free, pages)

    def _free(self, free: Callable[[tuple[Extent, ...]], None], pages: tuple[Extent, ...]) -> None:
        free(pages)
        self.num_deferred_pages -= sum(c for _, c in pages)

    def wait_all(self) -> None:
        """Wait for every tracked copy (handles stay recorded; ``reclaim`` frees)."""
        for h in [*self.incoming.values(), *self.outgoing.values(),
                  *(h for hs, _ in self.deferred for h in hs)]:
            h.wait()

    def deferred_pages(self) -> list[Extent]:
        """Every extent held by ``deferred`` (for ``check_integrity``)."""
        return [x for _, pages in self.deferred for x in pages]

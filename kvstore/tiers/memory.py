"""A preallocated byte pool cut into fixed-size pages, holding chunks of any size.

The pool is one ``uint8`` tensor of ``num_pages * page_bytes`` bytes, allocated once. A chunk
takes ``ceil(nbytes / page_bytes)`` pages; no malloc per chunk, no external fragmentation, and
namespaces with different chunk sizes share one pool. Pages are handed out as *extents*
(``(first page, page count)`` runs of consecutive pages) from a stack, so a freed chunk's pages
come back first and in their order, chunks of one size stay contiguous, and the cost of an
allocation grows with its number of runs, not of pages: small pages (4 KiB, so small chunks
waste little) cost a 5.9 MB chunk no more than 64 KiB pages do. Copies go run by run, usually a
single run.

The GPU tier (``gpu.py``) and the CPU tier (``cpu.py``) are this class with a different pool.
A chunk moved from one memory tier to another (``put_from``: a spill, a promote) is copied pool
to pool on the tiers' ``CopyStream`` (``copy_stream.py``: a CUDA side stream, or inline on
CPU); until that copy completes, readers of the new copy wait for it and neither pool hands
the pages out again (``inflight.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.keys import ChunkKey
from kvstore.tiers.base import Tier, TierFullError
from kvstore.tiers.copy_stream import CopyHandle, CopyStream, InlineCopyStream, run_pairs
from kvstore.tiers.inflight import InflightCopies

#: ``(first page id, number of pages)``: a run of consecutive pages.
Extent = tuple[int, int]


class PageAllocator:
    """Free pages ``0..num_pages-1``, kept as a stack of extents.

    Pages leave in the order a stack of single page ids would give them (``free`` pushes a
    chunk's pages so that its first page is popped first), but the stack holds maximal runs:
    ``alloc`` and ``free`` cost O(extents), whatever the page size. A pushed extent that ends
    where the top one starts is merged with it (the popping order is the same).

    ``alloc(n)`` returns a tuple of extents covering exactly ``n`` pages, adjacent ones merged
    (``TierFullError`` if fewer than ``n`` are free); ``free(extents)`` takes them back.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[Extent] = [(0, num_pages)] if num_pages else []
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def alloc(self, n: int) -> tuple[Extent, ...]:
        if n > self._num_free:
            raise TierFullError(f"need {n} pages, {self._num_free} free")
        out: list[Extent] = []
        left = n
        while left:
            first, count = self._free.pop()
            if count > left:
                self._free.append((first + left, count - left))
                count = left
            if out and out[-1][0] + out[-1][1] == first:
                out[-1] = (out[-1][0], out[-1][1] + count)
            else:
                out.append((first, count))
            left -= count
        self._num_free -= n
        return tuple(out)

    def free(self, extents: tuple[Extent, ...]) -> None:
        for first, count in reversed(extents):
            if self._free and first + count == self._free[-1][0]:
                count += self._free.pop()[1]
            self._free.append((first, count))
        self._num_free += sum(c for _, c in extents)

    def check_integrity(self, used: list[Extent]) -> None:
        """``used``: every extent the owner holds. Raise ``AssertionError`` on a leak, a
        double free or a page both free and used."""
        free_pages = [p for f, c in self._free for p in range(f, f + c)]
        used_pages = [p for f, c in used for p in range(f, f + c)]
        free, used_set = set(free_pages), set(used_pages)
        assert len(free) == len(free_pages), "page allocator: a page is free twice"
        assert len(used_set) == len(used_pages), "page allocator: a page is held by two chunks"
        assert not (free & used_set), "page allocator: a page is both free and used"
        assert len(free) == self._num_free, "page allocator: free count drifted"
        assert len(free) + len(used_set) == self.num_pages, (
            f"page allocator: free {len(free)} + used {len(used_set)} != total {self.num_pages}")


def num_pages(extents: tuple[Extent, ...]) -> int:
    """Pages covered by ``extents``."""
    return sum(c for _, c in extents)


def page_runs(extents: tuple[Extent, ...], page_bytes: int,
              nbytes: int) -> tuple[tuple[int, int], ...]:
    """``(byte offset in pool, length)`` of each extent, covering exactly ``nbytes`` bytes of
    data in extent order (the last run stops at the data's end)."""
    runs = []
    left = nbytes
    for first, count in extents:
        length = min(count * page_bytes, left)
        runs.append((first * page_bytes, length))
        left -= length
    return tuple(runs)


@dataclass(frozen=True)
class _Entry:
    pages: tuple[Extent, ...]
    runs: tuple[tuple[int, int], ...]
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    parent: ChunkKey | None


def entry_bytes(e: _Entry, page_bytes: int) -> int:
    """Pool bytes a stored chunk takes (whole pages)."""
    return num_pages(e.pages) * page_bytes


class MemoryTier(Tier):
    """Paged pool tier. ``pool`` is a 1-D ``uint8`` tensor whose length is a multiple of
    ``page_bytes``; its device is the tier's device."""

    def __init__(self, name: str, pool: torch.Tensor, page_bytes: int, policy_name: str = "lru") -> None:
        if pool.dtype != torch.uint8 or pool.dim() != 1 or pool.numel() % page_bytes:
            raise ValueError("pool must be 1-D uint8 with a length that is a multiple of page_bytes")
        super().__init__(name, pool.numel(), policy_name)
        self.pool = pool  # [num_pages * page_bytes] uint8
        #: whether the pool is host memory (``kvstore.direct.is_direct``; checked per chunk)
        self.host_memory = pool.device.type == "cpu"
        self.page_bytes = page_bytes
        self.allocator = PageAllocator(pool.numel() // page_bytes)
        self._entries: dict[ChunkKey, _Entry] = {}
        #: pages set aside by ``reserve`` and not yet committed or released (counted as used)
        self._reserved: dict[tuple[int, ...], int] = {}
        #: the stream of copies between this pool and another tier's (None: inline, unless
        #: the other tier has one); the GPU tier sets its device's
        self.copy_stream: CopyStream | None = None
        #: copies in flight into/out of this pool, and pages waiting for them
        self.inflight = InflightCopies()

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def used_bytes(self) -> int:
        """Pages held by chunks and reservations; pages of deleted chunks waiting for a copy
        to complete are not counted (they are free as soon as it does)."""
        return (self.allocator.num_used - self.inflight.num_deferred_pages) * self.page_bytes

    def _alloc(self, nbytes: int) -> tuple[Extent, ...]:
        """Pages for ``nbytes``; waits for pending copies of deleted chunks when their pages
        are needed. Raises ``TierFullError``. Under the lock."""
        n = self.footprint(nbytes) // self.page_bytes
        self.inflight.reclaim(self.allocator.free, lambda: self.allocator.num_free, n)
        return self.allocator.alloc(n)

    def footprint(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes) * self.page_bytes

    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def put(self, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None,
            owned: bool = False) -> None:
        with self._lock:
            if key in self._entries:
                raise KeyError(f"{key!r} already in {self.name} tier")
            nbytes = kv.numel() * kv.element_size()
            pages = self._alloc(nbytes)
            entry = _Entry(pages, page_runs(pages, self.page_bytes, nbytes), nbytes,
                           tuple(kv.shape), kv.dtype, parent)
            try:
                self._copy_in(entry, kv)
            except BaseException:
                self.allocator.free(pages)
                raise
            self._entries[key] = entry
            self._track(key, entry_bytes(entry, self.page_bytes), parent)

    # ---- direct writes: reserve pages, fill them in place, then commit ---------------------
    def reserve(self, nbytes: int) -> tuple[tuple[Extent, ...], tuple[tuple[int, int], ...]]:
        """Set aside pages for a chunk of ``nbytes`` bytes whose data will be written in place
        (e.g. straight from a socket) before ``commit``. The pages count as used but no key
        sees them. The caller made room first.

        Returns:
            ``(pages, runs)``: the page extents (opaque to callers) and the
            ``(byte offset in pool, length)`` runs
            covering exactly ``nbytes`` (see ``run_views``).

        Raises:
            TierFullError: not enough free pages.
        """
        with self._lock:
            pages = self._alloc(nbytes)
            self._reserved[pages] = nbytes
            return pages, page_runs(pages, self.page_bytes, nbytes)

    def run_views(self, runs: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
        """1-D ``uint8`` views of the pool, one per run (no copy; writable)."""
        return [self.pool[off:off + n] for off, n in runs]

    def commit(self, key: ChunkKey, pages: tuple[Extent, ...], shape: tuple[int, ...],
               dtype: torch.dtype, parent: ChunkKey | None) -> None:
        """Make reserved ``pages`` (already filled) the chunk ``key`` of ``shape``/``dtype``.

        Raises:
            KeyError: ``key`` already present, or ``pages`` not an open reservation (the
                reservation stays open in the first case: release it).
        """
        with self._lock:
            if key in self._entries:
                raise KeyError(f"{key!r} already in {self.name} tier")
            nbytes = self._reserved.pop(pages)
            entry = _Entry(pages, page_runs(pages, self.page_bytes, nbytes), nbytes,
                           tuple(shape), dtype, parent)
            self._entries[key] = entry
            self._track(key, entry_bytes(entry, self.page_bytes), parent)

    def release(self, pages: tuple[Extent, ...]) -> None:
        """Give back reserved ``pages`` that will not be committed. Idempotent."""
        with self._lock:
            if self._reserved.pop(pages, None) is not None:
                self.allocator.free(pages)

    def entry_runs(self, key: ChunkKey) -> tuple[tuple[int, int], ...] | None:
        """Pool byte runs of a stored chunk (None if absent). The caller must keep the chunk
        from being freed while it uses views of them (the store's reader pin)."""
        self._settle(key)
        e = self._entries.get(key)
        return e.runs if e is not None else None

    # ---- pool-to-pool copies (spill, promote) -------------------------------------------------
    def data_nbytes(self, key: ChunkKey) -> int | None:
        """Bytes of the stored chunk's data (None if absent)."""
        e = self._entries.get(key)
        return e.nbytes if e is not None else None

    def put_from(self, key: ChunkKey, src: "MemoryTier", parent: ChunkKey | None) -> CopyHandle:
        """Store a copy of ``src``'s chunk ``key`` here, copied pool to pool on this tier's
        ``copy_stream`` (else ``src``'s, else inline) after the work queued so far on the
        current stream. The chunk is indexed at once; reads of it wait for the copy
        (``read``, ``entry_runs``), and neither tier reuses the pages before it completes.
        The caller made room first. Returns the copy's handle.

        Raises:
            KeyError: ``key`` already here, or absent from ``src``. TierFullError: no room.
        """
        src._settle(key)
        with self._lock, src._lock:
            if key in self._entries:
                raise KeyError(f"{key!r} already in {self.name} tier")
            s = src._entries[key]
            pages = self._alloc(s.nbytes)
            e = _Entry(pages, page_runs(pages, self.page_bytes, s.nbytes), s.nbytes, s.shape,
                       s.dtype, parent)
            stream = self.copy_stream or src.copy_stream or InlineCopyStream()
            try:
                h = stream.copy_runs_async(run_pairs(self.pool, e.runs, src.pool, s.runs))
            except BaseException:
                self.allocator.free(pages)
                raise
            self.inflight.add_incoming(key, h)
            src.inflight.add_outgoing(key, h)
            self._entries[key] = e
            self._track(key, entry_bytes(e, self.page_bytes), parent)
            return h

    def _settle(self, key: ChunkKey) -> None:
        """Wait for the copy still writing ``key``'s pages, if any."""
        h = self.inflight.incoming.get(key)
        if h is not None:
            h.wait()
            with self._lock:
                if self.inflight.incoming.get(key) is h:
                    del self.inflight.incoming[key]

    def _copy_in(self, e: _Entry, kv: torch.Tensor) -> None:
        if len(e.runs) == 1:
            off, n = e.runs[0]
            self.pool[off:off + n].view(e.dtype).view(e.shape).copy_(kv)
            return
        src = kv.contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
        pos = 0
        for off, n in e.runs:
            self.pool[off:off + n].copy_(src[pos:pos + n])
            pos += n

    def read(self, key: ChunkKey, device: torch.device | str = "cpu",
             out: torch.Tensor | None = None) -> torch.Tensor | None:
        """As ``Tier.read``; with ``out`` (contiguous, the chunk's shape and dtype) the chunk
        is copied into ``out`` (returned) instead of a new tensor, so no page of a fresh
        buffer is faulted in.

        Raises:
            ValueError: ``out`` of another shape or dtype, or not contiguous.
        """
        self._settle(key)
        e = self._entries.get(key)
        if e is None:
            return None
        if out is None:
            out = torch.empty(e.shape, dtype=e.dtype, device=device)  # [num_layers, 2, chunk, heads, head_dim]
        elif tuple(out.shape) != e.shape or out.dtype != e.dtype or not out.is_contiguous():
            raise ValueError(f"out must be contiguous {list(e.shape)} {e.dtype}, got "
                             f"{list(out.shape)} {out.dtype}")
        if len(e.runs) == 1:
            off, n = e.runs[0]
            out.copy_(self.pool[off:off + n].view(e.dtype).view(e.shape))
            return out
        dst = out.reshape(-1).view(torch.uint8)  # [nbytes]
        pos = 0
        for off, n in e.runs:
            dst[pos:pos + n].copy_(self.pool[off:off + n])
            pos += n
        return out

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            e = self._entries.pop(key, None)
            if e is None:
                return False
            pending = self.inflight.forget(key)
            if pending:  # a copy still reads or writes these pages
                self.inflight.defer(pending, e.pages)
            else:
                self.allocator.free(e.pages)
            self._policy_call("on_remove", key)
            return True

    def keys(self) -> list[ChunkKey]:
        return list(self._entries)

    @property
    def num_chunks(self) -> int:
        return len(self._entries)

    def parent_of(self, key: ChunkKey) -> ChunkKey | None:
        e = self._entries.get(key)
        return e.parent if e else None

    def nbytes_of(self, key: ChunkKey) -> int:
        e = self._entries.get(key)
        return entry_bytes(e, self.page_bytes) if e else 0

    def _index_items(self):
        return [(k, entry_bytes(e, self.page_bytes), e.parent) for k, e in self._entries.items()]

    def check_integrity(self) -> None:
        with self._lock:
            super().check_integrity()
            used = [x for e in self._entries.values() for x in e.pages]
            used += [x for pages in self._reserved for x in pages]
            used += self.inflight.deferred_pages()
            self.allocator.check_integrity(used)
            for table in (self.inflight.incoming, self.inflight.outgoing):
                assert set(table) <= set(self._entries), f"{self.name}: copy of an absent chunk"
            for k, e in self._entries.items():
                assert entry_bytes(e, self.page_bytes) == self.footprint(e.nbytes), f"{k!r}: page count"
                assert sum(n for _, n in e.runs) == e.nbytes, f"{k!r}: runs do not cover the chunk"

    def close(self) -> None:
        with self._lock:
            self.inflight.wait_all()  # (no copy may land in a pool given back)
            self.inflight = InflightCopies()
            self._entries.clear()
            self._reserved.clear()
            self.allocator = PageAllocator(self.allocator.num_pages)
            self.policy = type(self.policy)()


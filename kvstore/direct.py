"""Direct I/O with a host-memory tier: a put's bytes land in reserved pages, a get's bytes
leave from the stored pages themselves.

A server that staged payloads in buffers held up to twice the bytes in flight on top of the
tier (a buffer per chunk read, then a copy into the arena; a copy out of the arena per chunk
sent). With these two objects it needs no staging buffer for chunks that live in a host
memory tier, so its memory stays within the tier's capacity plus socket buffers:

* ``Reservation``: pages set aside in the top tier (evicting as a put would) before the bytes
  arrive; the caller writes them in place, checks them, then ``ChunkStore.commit_chunks``
  makes them visible (or ``release_reservations`` gives them back: nothing torn is ever seen).
* ``BorrowedChunks``: reader pins on the chunks of a get plus views of their pages; the pages
  cannot be evicted or freed until ``release``. Chunks found only in a lower tier (disk, or a
  GPU tier) are read into new tensors by ``read_lower``, as ``get_chunks`` would.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from kvstore.keys import ChunkKey
from kvstore.tiers.memory import MemoryTier

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store import ChunkStore


class _AlreadyStored:
    """``reserve_chunks``'s answer for a key that is stored already: nothing to reserve; read
    and drop its bytes, and pass this marker on to ``commit_chunks`` (which skips it)."""

    def __repr__(self) -> str:
        return "ALREADY_STORED"


ALREADY_STORED = _AlreadyStored()


def is_direct(tier) -> bool:
    """Whether ``tier`` keeps its chunks in host memory that a socket can read and write."""
    return isinstance(tier, MemoryTier) and tier.device.type == "cpu"


@dataclass(eq=False)
class Reservation:
    """Pages of a host memory tier set aside for one chunk of ``nbytes`` bytes.

    Attributes:
        tier: the tier holding the pages.
        pages: page ids (opaque to callers).
        views: writable 1-D ``uint8`` tensors over the pages, in chunk byte order; their
            lengths sum to ``nbytes``.
        nbytes: the chunk's size in bytes.
    """

    tier: MemoryTier
    pages: tuple[int, ...]
    views: list[torch.Tensor]
    nbytes: int

    def memoryviews(self) -> list[memoryview]:
        """``views`` as writable memoryviews (for ``socket.recv_into``-style filling)."""
        return [memoryview(v.numpy()) for v in self.views]

    def tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The reserved bytes as one tensor of ``shape``/``dtype``: a view when the pages are
        one run (the usual case), else a copy.

        Raises:
            ValueError: ``shape``/``dtype`` do not take exactly ``nbytes`` bytes.
        """
        n = 1
        for s in shape:
            n *= s
        if n * torch.empty((), dtype=dtype).element_size() != self.nbytes:
            raise ValueError(f"{list(shape)} {dtype} is not {self.nbytes} bytes")
        flat = self.views[0] if len(self.views) == 1 else torch.cat(self.views)
        return flat.view(dtype).view(tuple(shape))


@dataclass(eq=False)
class BorrowedChunks:
    """Read access to the chunks of one get, without copying them out of host memory.

    Attributes:
        keys: the requested keys.
        parts: per key, the chunk's bytes as 1-D ``uint8`` tensors in order (views of the
            tier's pages for a host-memory hit; one new tensor for a chunk read by
            ``read_lower``), or None when absent (or found in a lower tier and not read yet).
        lower: indexes of keys found only in a lower tier, to be read by ``read_lower``.

    Use as a context manager, or call ``release`` exactly when the views are no longer used
    (the reader pins keep the pages from being evicted or reused until then).
    """

    store: "ChunkStore"
    ns: object
    keys: list[ChunkKey]
    plan: list = field(repr=False)
    parts: list[list[torch.Tensor] | None]
    lower: list[int]
    released: bool = False

    def read_lower(self) -> None:
        """Read the keys in ``lower`` into new tensors (and promote them, as ``get_chunks``
        does). Blocking (disk I/O): call off the event loop."""
        self.store._borrow_read_lower(self)

    def release(self) -> None:
        """Drop the reader pins. Idempotent; the views must not be used afterwards."""
        if not self.released:
            self.released = True
            self.store._borrow_release(self)

    def __enter__(self) -> "BorrowedChunks":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

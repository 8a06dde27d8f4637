"""Direct I/O with a host-memory tier: a put's bytes land in reserved pages, a get's bytes
leave from the stored pages themselves.

A server that staged payloads in buffers held up to twice the bytes in flight on top of the
tier (a buffer per chunk read, then a copy into the arena; a copy out of the arena per chunk
sent). With these two objects it needs no staging buffer for chunks that live in a host
memory tier, so its memory stays within the tier's capacity plus socket buffers:

* ``Reservation``: pages set aside in the top tier (evicting as a put would) before the bytes
  arrive; the caller writes them in place, checks them, then ``commit_chunks``
  makes them visible (or ``release_reservations`` gives them back: nothing torn is ever seen).
* ``BorrowedChunks``: reader pins on the chunks of a get plus views of their pages; the pages
  cannot be evicted or freed until ``release``. Chunks found only in a lower tier (disk, or a
  GPU tier) are read into new tensors by ``read_lower``, as ``get_chunks`` would.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout
from kvstore.tiers.base import Tier
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.memory import MemoryTier

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.store_state import StoreState


class _AlreadyStored:
    """``reserve_chunks``'s answer for a key that is stored already: nothing to reserve; read
    and drop its bytes, and pass this marker on to ``commit_chunks`` (which skips it)."""

    def __repr__(self) -> str:
        return "ALREADY_STORED"


ALREADY_STORED = _AlreadyStored()


def is_shared(tier) -> bool:
    """Whether ``tier`` is a CPU tier whose arena same-host clients map (``CpuTier.shared_fd``)."""
    return isinstance(tier, CpuTier) and tier.shared_fd is not None


def is_direct(tier) -> bool:
    """Whether ``tier`` keeps its chunks in host memory that a socket can read and write."""
    return isinstance(tier, MemoryTier) and tier.host_memory


@dataclass(eq=False)
class Reservation:
    """Pages of a host memory tier set aside for one chunk of ``nbytes`` bytes.

    Attributes:
        tier: the tier holding the pages.
        pages: page ids (opaque to callers).
        views: writable 1-D ``uint8`` tensors over the pages, in chunk byte order; their
            lengths sum to ``nbytes``.
        nbytes: the chunk's size in bytes.
        key: the chunk the pages are for.
    """

    tier: MemoryTier
    pages: tuple[int, ...]
    views: list[torch.Tensor]
    nbytes: int
    key: ChunkKey | None = None

    def memoryviews(self) -> list[memoryview]:
        """``views`` as writable memoryviews (for ``socket.recv_into``-style filling)."""
        return [memoryview(v.numpy()) for v in self.views]


@dataclass(eq=False)
class BorrowedChunks:
    """Read access to the chunks of one get, without copying them out of host memory.

    Attributes:
        keys: the requested keys.
        parts: per key, the chunk's bytes as 1-D ``uint8`` tensors in order (views of the
            tier's pages for a host-memory hit; one new tensor for a chunk read by
            ``read_lower``), or None when absent (or found in a lower tier and not read yet).
        lower: indexes of keys found only in a lower tier (the remote tier included: keys
            stored in no local tier when the store has one), to be read by ``read_lower``.
        runs: per key, ``((byte offset, nbytes), ...)`` of a chunk borrowed from a shared CPU
            arena (``ChunkStore.shared_arena``): where ``parts`` lie in that arena; else None.

    Use as a context manager, or call ``release`` exactly when the views are no longer used
    (the reader pins keep the pages from being evicted or reused until then).
    """

    io: "DirectIO"
    ns: object
    keys: list[ChunkKey]
    plan: list = field(repr=False)
    parts: list[list[torch.Tensor] | None]
    lower: list[int]
    runs: list[tuple[tuple[int, int], ...] | None] = field(default_factory=list)
    released: bool = False
    #: chunks read from the remote tier, promoted into the top tier at ``release`` (after the
    #: caller sent them: the copy is off the get's critical path)
    promote_later: list = field(default_factory=list, repr=False)

    def read_lower(self) -> None:
        """Read the keys in ``lower`` into new tensors (and promote them, as ``get_chunks``
        does). Blocking (disk I/O): call off the event loop."""
        self.io._borrow_read_lower(self)

    def release(self) -> None:
        """Drop the reader pins. Idempotent; the views must not be used afterwards."""
        if not self.released:
            self.released = True
            self.io._borrow_release(self)

    def try_release(self) -> bool:
        """``release`` if it can finish at once: the store lock is free and nothing is left
        to do but drop pins (no chunk to promote, none removed while pinned, whose delete
        could touch a disk). Never waits (an event loop may call it inline); False, with
        nothing done, when ``release`` must run elsewhere (a thread)."""
        if self.released:
            return True
        if self.promote_later or not self.io._try_borrow_release(self):
            return False
        self.released = True
        return True

    def __enter__(self) -> "BorrowedChunks":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class DirectIO:
    """Direct I/O of one store (a part of ``kvstore.store.ChunkStore``, which delegates these
    methods here).

    Args:
        state: the store's shared state (tiers, lock, pins, tier mover, metrics).
        place: the store's write path: ``place(keys, items, parents, layout)`` stores each
            item (a tensor, a filled ``Reservation``, ``ALREADY_STORED`` or None) under its key
            and returns how many were newly stored.
    """

    def __init__(self, state: "StoreState",
                 place: Callable[[Sequence[ChunkKey], Sequence, Sequence[ChunkKey | None],
                                  KVLayout], int]) -> None:
        self._st = state
        self._place = place

    def reserve_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                       parents: Sequence[ChunkKey | None] | None = None) -> list:
        """Set aside room for the chunks ``keys`` of ``ns`` in the top tier when it is host
        memory, evicting (and spilling) unpinned chunks as a put would (never a stored
        ancestor of the chunk: an open reservation counts as stored for that walk, so
        reserving a batch chunk by chunk keeps the prefix it continues). Fill each
        reservation's views, then ``commit_chunks`` (or ``release_reservations`` on any
        failure).

        Args:
            parents: each key's parent, as ``put_chunks`` takes them (None: chained).

        Returns:
            Per key: a ``Reservation``; ``ALREADY_STORED`` (``kvstore.direct``) when the key is
            stored already (nothing reserved); or None where the top tier is not host memory,
            cannot make room (every chunk pinned, or only the chunk's own prefix could go), or
            the chunk's parent is neither stored nor reserved (it would be refused at commit):
            put those chunks as tensors instead, or drop them.

        Raises:
            ValueError: the namespace does not fit the tiers, a key of another namespace, or
                bad ``parents``. RuntimeError: store closed.
        """
        st = self._st
        st.check_keys(ns, keys)
        parents = st.check_parents(ns, keys, parents)
        nbytes = ns.layout.chunk_bytes
        out: list = [None] * len(keys)
        direct = bool(st.tiers) and is_direct(st.tiers[0])
        top = st.tiers[0] if direct else None
        mover = st.mover
        with st.lock:
            st.expire_leases()
            room = True
            for i, (k, p) in enumerate(zip(keys, parents)):
                if st.locate(k) is not None:
                    out[i] = ALREADY_STORED
                    continue
                st.record(k)
                if direct and room and (p is None or mover.present(p) or p in st.reserved) \
                        and mover.make_room(0, nbytes, lambda k=k, p=p: mover.protect(k, p),
                                            candidate=k):
                    pages, runs = top.reserve(nbytes)
                    out[i] = Reservation(top, pages, top.run_views(runs), nbytes, k)
                    st.reserved[k] = p
                else:
                    room = False
        return out

    def commit_chunks(self, ns: Namespace, keys: Sequence[ChunkKey], items: Sequence,
                      parents: Sequence[ChunkKey | None] | None = None) -> int:
        """Store chunks given as filled ``Reservation``s (made visible in place, no copy),
        tensors (copied, as ``put_chunks``) or None (dropped: counted as rejected, e.g. when
        ``reserve_chunks`` found no room and no lower tier could take it). Every reservation
        passed is consumed: committed, or released when its key is already stored or its
        parent (``parents``, as ``put_chunks`` takes them) is stored nowhere.

        Returns:
            How many chunks were newly stored.

        Raises:
            ValueError: wrong key namespace or count, a tensor not matching the layout, or a
                reservation of another size (nothing stored; reservations released).
        """
        st = self._st
        try:
            st.check_keys(ns, keys)
            if len(keys) != len(items):
                raise ValueError(f"commit_chunks: {len(keys)} keys but {len(items)} items")
            parents = st.check_parents(ns, keys, parents)
            for it in items:
                if isinstance(it, Reservation):
                    if it.nbytes != ns.layout.chunk_bytes:
                        raise ValueError(f"reservation of {it.nbytes} bytes for chunks of "
                                         f"{ns.layout.chunk_bytes}")
                elif it is not None and it is not ALREADY_STORED:
                    ns.layout.validate(it)
        except BaseException:
            self.release_reservations(items)
            raise
        return self._place(keys, items, parents, ns.layout)

    def release_reservations(self, items: Sequence) -> None:
        """Give back the reservations among ``items`` (others are ignored). Idempotent."""
        st = self._st
        for it in items:  # (no store lock: the event loop calls this; a dict pop is atomic)
            if isinstance(it, Reservation):
                st.end_reservation(it)

    def borrow_chunks(self, ns: Namespace, keys: Sequence[ChunkKey]) -> BorrowedChunks:
        """Pin the stored chunks among ``keys`` and hand out views of those in a host memory
        tier (no copy); chunks only in a lower tier are listed in ``.lower`` for
        ``read_lower``. Counts hits and misses as ``get_chunks`` does (at ``read_lower`` for
        lower-tier chunks). The caller must ``release`` it.

        Raises:
            ValueError: a key of another namespace. RuntimeError: store closed.
        """
        return self._borrow(ns, keys, blocking=True)

    def try_borrow_chunks(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                          views: bool = True) -> BorrowedChunks | None:
        """``borrow_chunks`` if it can finish at once: the store lock is free right now and
        every key is either in a host memory tier or (without a remote tier) stored nowhere,
        so ``.lower`` is empty. Else None at once, with nothing pinned or counted (never
        waits: an event loop can call it inline and fall back to ``borrow_chunks`` on a
        thread). ``views=False``: chunks of the shared arena get ``parts[i] = None`` (their
        ``runs[i]`` say where they are; no tensor views are made).

        Raises:
            ValueError, RuntimeError: as ``borrow_chunks``.
        """
        return self._borrow(ns, keys, blocking=False, views=views)

    def _borrow(self, ns: Namespace, keys: Sequence[ChunkKey],
                blocking: bool, views: bool = True) -> BorrowedChunks | None:
        st = self._st
        st.check_keys(ns, keys)
        chunk_bytes = ns.layout.chunk_bytes
        plan: list[tuple[ChunkKey, Tier] | None] = []
        parts: list[list[torch.Tensor] | None] = []
        runs: list[tuple[tuple[int, int], ...] | None] = []
        lower: list[int] = []
        hits: list[str] = []
        misses = 0
        if not st.lock.acquire(blocking):
            return None
        try:
            st.expire_leases()
            for i, k in enumerate(keys):
                t = st.locate(k)
                held = t is not None and is_direct(t) and t.nbytes_of(k) >= chunk_bytes
                if not blocking and not held and (t is not None or st.remote is not None):
                    for item in plan:  # a lower tier to read: undo, the caller uses a thread
                        if item is not None:
                            st.pins.drop_reader(item[0])
                    return None
                if t is not None:
                    st.pins.add_reader(k)
                plan.append((k, t) if t is not None else None)
                if held:
                    where = t.entry_runs(k)
                    shared = is_shared(t)
                    parts.append(t.run_views(where) if views or not shared else None)
                    runs.append(where if shared else None)
                    hits.append(t.name)
                else:
                    parts.append(None)
                    runs.append(None)
                    if t is not None or st.remote is not None:
                        lower.append(i)
                    else:
                        misses += 1
            for item in plan:  # counted once the borrow is sure (an undone one counts nothing)
                if item is not None:
                    item[1].touch(item[0])
                    st.record(item[0])
            for name in set(hits):
                st.metrics.inc("hits", hits.count(name), tier=name)
            if misses:
                st.metrics.inc("misses", misses)
        finally:
            st.lock.release()
        return BorrowedChunks(self, ns, list(keys), plan, parts, lower, runs)

    def _borrow_read_lower(self, b: BorrowedChunks) -> None:
        st = self._st
        read: list[torch.Tensor | None] = [None] * len(b.keys)
        remote = [i for i in b.lower if b.plan[i] is None]
        for i in b.lower:
            if b.plan[i] is None:
                continue
            kv = st.read_checked(b.ns.layout, *b.plan[i])
            read[i] = kv
            if kv is None:
                st.metrics.inc("misses")
            else:
                b.parts[i] = [kv.reshape(-1).view(torch.uint8)]
                st.metrics.inc("hits", tier=b.plan[i][1].name)
        if st.config.promote_on_hit and b.lower:
            with st.lock:
                st.mover.promote(b.plan, read, st.doomed)
        got = st.read_remote(b.ns.layout, [b.keys[i] for i in remote], later=b.promote_later)
        for i, kv in zip(remote, got):
            if kv is None:
                st.metrics.inc("misses")
            else:
                b.parts[i] = [kv.reshape(-1).view(torch.uint8)]
        b.lower = []

    def _try_borrow_release(self, b: BorrowedChunks) -> bool:
        """Drop ``b``'s pins if the store lock is free and no chunk of it awaits deletion
        (removed while pinned: its delete may touch a disk); False, nothing done, else."""
        st = self._st
        if not st.lock.acquire(False):
            return False
        try:
            if any(item is not None and item[0] in st.doomed for item in b.plan):
                return False
            for item in b.plan:
                if item is not None:
                    st.pins.drop_reader(item[0])
        finally:
            st.lock.release()
        return True

    def _borrow_release(self, b: BorrowedChunks) -> None:
        st = self._st
        if b.promote_later:
            st.promote_remote(b.promote_later)
            b.promote_later = []
        with st.lock:
            for item in b.plan:
                if item is not None:
                    st.pins.drop_reader(item[0])
                    st.maybe_free(item[0])

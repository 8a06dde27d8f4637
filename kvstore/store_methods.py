"""The public methods ``kvstore.store.ChunkStore`` takes from its parts, as mixins that
forward to them: removal, pins, durability and stats to ``kvstore.store_admin.StoreAdmin``
(``self._admin``; ``demote`` asks the tiers of the shared state, ``self._st``, itself); reservations and borrowed reads to ``kvstore.direct.DirectIO``
(``self._direct``). The docstrings are the public ones; the parts document the details.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from kvstore.direct import BorrowedChunks
from kvstore.keys import ChunkKey, Namespace

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.close_persist import PersistReport


class AdminMethods:
    """``ChunkStore``'s removal, pin, durability and introspection methods."""

    def remove(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        return self._admin.remove(ns, keys)

    def demote(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """As ``KVStoreBase.demote``: in each local tier holding a key, its policy evicts it
        first (``EvictionPolicy.demote``); a spill carries the demotion to the tier below.
        The remote (Redis) tier keeps no eviction order of ours: nothing changes there and
        its copies are not counted. Counted in ``demoted_chunks``.

        Raises:
            ValueError: a key of another namespace.
        """
        st = self._st
        st.check_keys(ns, keys)
        n = 0
        with st.lock:
            for k in keys:
                if k in st.doomed:
                    continue
                found = False
                for t in st.tiers:
                    found = t.demote(k) or found
                n += found
        st.metrics.inc("demoted_chunks", n)
        return n

    def clear(self, ns: Namespace | None = None) -> int:
        return self._admin.clear(ns)

    def clear_namespace_id(self, ns_id: bytes) -> int:
        """``clear`` of the namespace with id ``ns_id`` (``Namespace.ns_id``, 16 bytes), known
        by its id alone (chunks on disk from before a restart). Raises ValueError: not 16
        bytes."""
        return self._admin.clear_namespace_id(ns_id)

    def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None) -> int:
        return self._admin.pin(ns, keys, lease_s)

    def unpin(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Drop one explicit pin per key (a plain pin first, else the oldest leased one)."""
        return self._admin.unpin(ns, keys)

    def pin_count(self, key: ChunkKey) -> int:
        """Current pins of ``key`` (readers + explicit + leased)."""
        return self._admin.pin_count(key)

    def persist_memory_tiers(self, budget_s: float) -> "PersistReport | None":
        """Write the chunks that only a memory tier (GPU, CPU) holds to the disk tier, hottest
        first and parents before children, through the spill path (the disk tier's codec and
        checksums), for up to ``budget_s`` seconds (commits included) and only into the disk
        tier's free room (no disk chunk is evicted for it). ``close(persist_s=...)`` calls it
        so a graceful shutdown keeps the cache; a crash writes nothing. Holds the store lock
        throughout. Logs one line; see ``kvstore.close_persist``.

        Returns:
            A ``PersistReport`` (chunks and bytes written; chunks left out for time, room or a
            missing ancestor), or None without a disk tier or a memory tier.

        Raises:
            ValueError: ``budget_s`` not a positive finite number.
        """
        from kvstore.close_persist import persist_memory_tiers
        return persist_memory_tiers(self._st, budget_s)

    def _prepare_close(self, budget_s: float) -> None:
        """``close``'s work before the tiers close (``kvstore.close_persist.prepare_close``)."""
        from kvstore.close_persist import prepare_close
        prepare_close(self._st, budget_s)

    @property
    def has_lower_tiers(self) -> bool:
        """Whether a chunk the top tier cannot take may still go to a tier below it."""
        return self._admin.has_lower_tiers

    @property
    def has_disk_tier(self) -> bool:
        """Whether the store has a disk tier (so ``persist`` can make chunks durable)."""
        return self._admin.has_disk_tier

    def persist(self, ns: Namespace, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
                timeout: float | None = None,
                parents: Sequence[ChunkKey | None] | None = None) -> int:
        """Write chunks through to the disk tier and wait for the commit; returns how many
        are committed (see ``StoreAdmin.persist``).

        Raises:
            RuntimeError: no disk tier, or closed. ValueError: bad keys, counts or tensors.
        """
        return self._admin.persist(ns, keys, kvs, timeout, parents)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued disk writes are committed. False on timeout."""
        return self._admin.flush(timeout)

    def unreachable_bytes(self) -> int:
        """Bytes of chunks a prefix lookup can never reach (see ``StoreAdmin``)."""
        return self._admin.unreachable_bytes()

    def stats(self) -> dict:
        return self._admin.stats()



class DirectMethods:
    """``ChunkStore``'s direct I/O methods (``kvstore.direct``)."""

    def reserve_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                       parents: Sequence[ChunkKey | None] | None = None) -> list:
        """Per key a ``Reservation`` in the host-memory top tier, ``ALREADY_STORED`` or None
        (see ``DirectIO.reserve_chunks``).

        Raises:
            ValueError: bad namespace, keys or parents. RuntimeError: store closed.
        """
        return self._direct.reserve_chunks(ns, keys, parents)

    def commit_chunks(self, ns: Namespace, keys: Sequence[ChunkKey], items: Sequence,
                      parents: Sequence[ChunkKey | None] | None = None) -> int:
        """Store filled reservations in place, tensors by copy; returns how many were newly
        stored (see ``DirectIO.commit_chunks``).

        Raises:
            ValueError: bad keys, counts, tensors or reservation sizes (all released).
        """
        return self._direct.commit_chunks(ns, keys, items, parents)

    def release_reservations(self, items: Sequence) -> None:
        """Give back the reservations among ``items``. Idempotent."""
        self._direct.release_reservations(items)

    def borrow_chunks(self, ns: Namespace, keys: Sequence[ChunkKey]) -> BorrowedChunks:
        """Reader-pinned zero-copy views of the stored chunks (see ``DirectIO.borrow_chunks``);
        the caller must ``release`` them.

        Raises:
            ValueError: a key of another namespace. RuntimeError: store closed.
        """
        return self._direct.borrow_chunks(ns, keys)

    def try_borrow_chunks(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                          views: bool = True) -> BorrowedChunks | None:
        """``borrow_chunks`` if it can finish at once (store lock free, nothing to read from a
        lower or remote tier), else None with nothing pinned (``DirectIO.try_borrow_chunks``;
        ``views=False``: no tensor views of shared-arena chunks, only their ``runs``).

        Raises:
            ValueError: a key of another namespace. RuntimeError: store closed.
        """
        return self._direct.try_borrow_chunks(ns, keys, views=views)


__all__ = ["AdminMethods", "DirectMethods"]

"""The chunk store's maintenance surface: removal, pins, durability and introspection.

``StoreAdmin`` is a part of ``kvstore.store.ChunkStore``: it works on the store's shared
``kvstore.store_state.StoreState`` (tiers, lock, pins, tier mover, removed-while-pinned set,
metrics); ``store.py`` keeps the data path (lookup, get, put) and delegates these methods here.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from kvstore.keys import ChunkKey, Namespace
from kvstore.reachability import unreachable_bytes
from kvstore.store_state import StoreState
from kvstore.tiers.disk import DiskTier


class StoreAdmin:
    """Removal, pins, ``persist``/``flush``, ``stats``/``unreachable_bytes``/
    ``check_integrity`` of one store (see ``ChunkStore``).

    Args:
        state: the store's shared state.
    """

    def __init__(self, state: StoreState) -> None:
        self._st = state
        state.metrics.bind_store(self.num_resident_chunks, self.unreachable_bytes,
                                 lambda: len(state.pins.pinned_keys()),
                                 lambda: state.num_namespaces)

    # ---- removal and pins -----------------------------------------------------------------------
    def remove(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Remove ``keys`` from every tier, the remote one included; returns how many were
        stored somewhere."""
        st = self._st
        st.check_keys(ns, keys)
        with st.lock:
            local = [self._remove_one(k) for k in keys]
        if st.remote is None:
            return sum(local)
        return sum(a or b for a, b in zip(local, st.remote.delete(keys)))

    def _remove_one(self, key: ChunkKey) -> bool:
        st = self._st
        if st.locate(key) is None:
            return False
        if st.pins.count(key):
            st.doomed.add(key)
        else:
            st.delete_everywhere(key)
        st.metrics.inc("removed_chunks")
        return True

    def clear(self, ns: Namespace | None = None) -> int:
        """Remove every chunk (of ``ns`` when given) from every tier, the remote one included
        (every value under its key prefix, on every node); returns how many distinct chunks
        went."""
        return self._clear(None if ns is None else ns.ns_id)

    def clear_namespace_id(self, ns_id: bytes) -> int:
        """``clear`` of the namespace whose id is ``ns_id`` (``Namespace.ns_id``), for one
        known by its id alone: its chunks on disk from before a restart carry the id in their
        keys, not the namespace's fields. Returns how many distinct chunks went.

        Raises:
            ValueError: ``ns_id`` is not 16 bytes.
        """
        if not isinstance(ns_id, bytes) or len(ns_id) != 16:
            raise ValueError(f"a namespace id is 16 bytes, got {ns_id!r}")
        return self._clear(ns_id)

    def _clear(self, ns_id: bytes | None) -> int:
        st = self._st
        with st.lock:
            keys = {k for t in st.tiers for k in t.keys()}
            if ns_id is not None:
                keys = {k for k in keys if k.ns_id == ns_id}
            removed = {k for k in keys if self._remove_one(k)}
        if st.remote is not None:
            removed |= st.remote.clear(ns_id)
        return len(removed)

    def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None) -> int:
        st = self._st
        st.check_keys(ns, keys)
        # ``not > 0`` also refuses NaN: a NaN expiry never ends and, at the top of the lease
        # heap, would stop every later lease from expiring
        if lease_s is not None and not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        n = 0
        with st.lock:
            st.expire_leases()
            for k in keys:
                if st.locate(k) is None:
                    continue
                n += 1
                st.pins.pin(k, None if lease_s is None else time.monotonic() + lease_s)
        return n

    def unpin(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Drop one explicit pin per key (a plain pin first, else the oldest leased one)."""
        st = self._st
        st.check_keys(ns, keys)
        n = 0
        with st.lock:
            st.expire_leases()
            for k in keys:
                if st.pins.unpin(k):
                    n += 1
                    st.maybe_free(k)
        return n

    def pin_count(self, key: ChunkKey) -> int:
        """Current pins of ``key`` (readers + explicit + leased)."""
        st = self._st
        with st.lock:
            st.expire_leases()
            return st.pins.count(key)

    @property
    def has_lower_tiers(self) -> bool:
        """Whether a chunk the top tier cannot take may still go to a tier below it (so a
        caller with no reservation should stage the bytes rather than drop them)."""
        return len(self._st.tiers) > 1

    @property
    def has_disk_tier(self) -> bool:
        """Whether the store has a disk tier (so ``persist`` can make chunks durable)."""
        return self._disk_tier() is not None

    def _disk_tier(self) -> DiskTier | None:
        return next((t for t in self._st.tiers if isinstance(t, DiskTier)), None)

    def persist(self, ns: Namespace, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
                timeout: float | None = None,
                parents: Sequence[ChunkKey | None] | None = None) -> int:
        """Make chunks durable: write each one through to the disk tier (unless it is already
        there), then wait until the disk writer has committed them. Memory tiers are not
        touched; a chunk removed (while pinned) is skipped. Blocking.

        Args:
            ns: namespace of ``keys``.
            keys: chunk keys.
            kvs: one tensor per key, ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]``
                with the namespace's dtype.
            timeout: seconds to wait for the commit (None: no limit).
            parents: each key's parent, as ``put_chunks`` takes them (None: key i-1 is key
                i's parent, key 0 a first chunk).

        Returns:
            How many of ``keys`` are committed on disk (less than ``len(keys)`` when the disk
            tier could not make room, dropped a write, or the timeout passed).

        Raises:
            RuntimeError: the store has no disk tier, or is closed.
            ValueError: wrong key namespace, count, shape or dtype (nothing written).
        """
        st = self._st
        disk = self._disk_tier()
        if disk is None:
            raise RuntimeError("persist needs a disk tier (configure disk_path and disk_bytes)")
        parents = st.check_write(ns, keys, kvs, parents, "persist")
        with st.lock:
            st.expire_leases()
            live = [j for j, k in enumerate(keys) if k not in st.doomed]
            rejected = st.mover.write_through(st.tiers.index(disk), keys, kvs, live, parents)
            st.metrics.inc("rejected_chunks", rejected)
        disk.wait_committed(keys, timeout)
        with st.lock:
            return sum(1 for k in keys if disk.contains(k) and not disk.is_pending(k))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued disk writes are committed. False on timeout."""
        ok = all(t.flush(timeout) for t in self._st.tiers if isinstance(t, DiskTier))
        return (self._st.remote is None or self._st.remote.flush(timeout)) and ok

    # ---- introspection ------------------------------------------------------------------------
    def unreachable_bytes(self) -> int:
        """Bytes (over all tiers) of chunks that a prefix lookup can never reach: some ancestor
        (parent, grandparent, ... as recorded at put) is stored in no tier."""
        st = self._st
        with st.lock:
            return unreachable_bytes(st.tiers, st.doomed)

    def num_resident_chunks(self) -> int:
        """Distinct chunks some tier holds (not counting those removed while pinned)."""
        st = self._st
        with st.lock:
            keys = set().union(*(t.keys() for t in st.tiers))
            return len(keys - st.doomed)

    def stats(self) -> dict:
        st = self._st
        with st.lock:
            st.expire_leases()
            tiers = {t.name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                              "free_bytes": t.free_bytes, "num_chunks": t.num_chunks,
                              "policy": t.policy_name} for t in st.tiers}
            out = {"tiers": tiers, "num_pinned_chunks": len(st.pins.pinned_keys()),
                   "num_removed_pinned_chunks": len(st.doomed),
                   "unreachable_bytes": self.unreachable_bytes(),
                   "num_namespaces": st.num_namespaces,
                   "num_resident_chunks": self.num_resident_chunks()}
        out.update(st.metrics.snapshot())
        if st.remote is not None:
            out["remote"] = st.remote.stats()
        return out

    def check_integrity(self) -> None:
        """Check every memory owner: each tier's index, space accounting and policy; pin counts
        >= 0; removed-while-pinned chunks are pinned. Raises ``AssertionError``."""
        st = self._st
        with st.lock:
            for t in st.tiers:
                t.check_integrity()
            st.pins.check_integrity()
            for k in st.doomed:
                assert st.pins.count(k) > 0, f"{k!r} awaits its last unpin but has no pin"

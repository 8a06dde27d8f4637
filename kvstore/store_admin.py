"""The chunk store's maintenance surface: removal, pins, durability and introspection.

A mixin of ``kvstore.store.ChunkStore`` (it uses the store's lock, tiers, pin table, tier
mover, removed-while-pinned set and metrics); ``store.py`` keeps the data path (lookup, get,
put) and the locking around it.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from kvstore.keys import ChunkKey, Namespace
from kvstore.movement import unreachable_bytes
from kvstore.tiers.disk import DiskTier


class StoreAdmin:
    """Removal, pins, ``persist``/``flush``, ``stats``/``unreachable_bytes``/
    ``check_integrity`` of ``ChunkStore`` (see there)."""

    # ---- removal and pins -----------------------------------------------------------------------
    def _delete_everywhere(self, key: ChunkKey) -> None:
        for t in self.tiers:
            t.delete(key)
        self._doomed.discard(key)

    def _expire_leases(self) -> None:
        for key in self._pins.expire(time.monotonic()):
            self._maybe_free(key)

    def _maybe_free(self, key: ChunkKey) -> None:
        if key in self._doomed and self._pins.count(key) == 0:
            self._delete_everywhere(key)

    def remove(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        self._check_keys(ns, keys)
        with self._lock:
            return sum(self._remove_one(k) for k in keys)

    def _remove_one(self, key: ChunkKey) -> bool:
        if self._locate(key) is None:
            return False
        if self._pins.count(key):
            self._doomed.add(key)
        else:
            self._delete_everywhere(key)
        return True

    def clear(self, ns: Namespace | None = None) -> int:
        with self._lock:
            keys = {k for t in self.tiers for k in t.keys()}
            if ns is not None:
                keys = {k for k in keys if k.ns_id == ns.ns_id}
            return sum(self._remove_one(k) for k in keys)

    def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None) -> int:
        self._check_keys(ns, keys)
        # ``not > 0`` also refuses NaN: a NaN expiry never ends and, at the top of the lease
        # heap, would stop every later lease from expiring
        if lease_s is not None and not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        n = 0
        with self._lock:
            self._expire_leases()
            for k in keys:
                if self._locate(k) is None:
                    continue
                n += 1
                self._pins.pin(k, None if lease_s is None else time.monotonic() + lease_s)
        return n

    def unpin(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Drop one explicit pin per key (a plain pin first, else the oldest leased one)."""
        self._check_keys(ns, keys)
        n = 0
        with self._lock:
            self._expire_leases()
            for k in keys:
                if self._pins.unpin(k):
                    n += 1
                    self._maybe_free(k)
        return n

    def pin_count(self, key: ChunkKey) -> int:
        """Current pins of ``key`` (readers + explicit + leased)."""
        with self._lock:
            self._expire_leases()
            return self._pins.count(key)

    @property
    def has_lower_tiers(self) -> bool:
        """Whether a chunk the top tier cannot take may still go to a tier below it (so a
        caller with no reservation should stage the bytes rather than drop them)."""
        return len(self.tiers) > 1

    @property
    def has_disk_tier(self) -> bool:
        """Whether the store has a disk tier (so ``persist`` can make chunks durable)."""
        return self._disk_tier() is not None

    def _disk_tier(self) -> DiskTier | None:
        return next((t for t in self.tiers if isinstance(t, DiskTier)), None)

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
        disk = self._disk_tier()
        if disk is None:
            raise RuntimeError("persist needs a disk tier (configure disk_path and disk_bytes)")
        parents = self._check_write(ns, keys, kvs, parents, "persist")
        with self._lock:
            self._expire_leases()
            live = [j for j, k in enumerate(keys) if k not in self._doomed]
            rejected = self._mover.write_through(self.tiers.index(disk), keys, kvs, live, parents)
            self.metrics.inc("rejected_chunks", rejected)
        disk.wait_committed(keys, timeout)
        with self._lock:
            return sum(1 for k in keys if disk.contains(k) and not disk.is_pending(k))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued disk writes are committed. False on timeout."""
        return all(t.flush(timeout) for t in self.tiers if isinstance(t, DiskTier))

    # ---- introspection ------------------------------------------------------------------------
    def unreachable_bytes(self) -> int:
        """Bytes (over all tiers) of chunks that a prefix lookup can never reach: some ancestor
        (parent, grandparent, ... as recorded at put) is stored in no tier."""
        with self._lock:
            return unreachable_bytes(self.tiers, self._doomed)

    def stats(self) -> dict:
        with self._lock:
            self._expire_leases()
            tiers = {t.name: {"capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes,
                              "free_bytes": t.free_bytes, "num_chunks": t.num_chunks,
                              "policy": t.policy_name} for t in self.tiers}
            out = {"tiers": tiers, "num_pinned_chunks": len(self._pins.pinned_keys()),
                   "num_removed_pinned_chunks": len(self._doomed),
                   "unreachable_bytes": self.unreachable_bytes(),
                   "num_namespaces": self.num_namespaces}
        out.update(self.metrics.snapshot())
        return out

    def check_integrity(self) -> None:
        """Check every memory owner: each tier's index, space accounting and policy; pin counts
        >= 0; removed-while-pinned chunks are pinned. Raises ``AssertionError``."""
        with self._lock:
            for t in self.tiers:
                t.check_integrity()
            self._pins.check_integrity()
            for k in self._doomed:
                assert self._pins.count(k) > 0, f"{k!r} awaits its last unpin but has no pin"

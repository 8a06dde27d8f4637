"""The tiered chunk store: GPU pool -> CPU arena -> lmdb disk, behind ``KVStoreBase``.

This is the only module that knows there is more than one tier. It decides

* where a chunk goes: ``put`` writes to the top tier (or the next one that can take it when
  every chunk of the top tier is pinned);
* what moves: a victim evicted from tier i spills to tier i+1 unless already there; a hit in a
  lower tier is promoted (copied) to the top tier when ``promote_on_hit``;
* what may be evicted: chunks with no pin. Pins are ref counts of three kinds: readers (taken
  by ``get_chunks`` for the duration of the copy), explicit ``pin`` and leased ``pin`` (expires
  after ``lease_s``). A chunk removed while pinned disappears from lookups at once and is
  freed when its last pin goes;
* that stored prefixes stay reachable: each chunk records its parent (the previous chunk of
  its prompt, as the put says: ``parents``), a chunk whose parent is stored nowhere is not
  stored, room is never made by evicting a chunk's own ancestors, and a chunk that leaves the
  store takes its stored descendants with it (``kvstore.movement``). Only ``remove`` (and a
  restart, which loses the memory tiers) can leave a chunk without its parent; such chunks
  are counted in ``unreachable_bytes``;
* what a read that cannot serve an indexed chunk means: a stale index entry, dropped and
  counted (``stale_index_entries``).

Pin counts live in ``kvstore.pins`` (``PinTable``); insert/evict/spill/promote in
``kvstore.movement`` (``TierMover``); removal, pins, persist and stats in
``kvstore.store_admin`` (``StoreAdmin``); this module is the data path and the locking.

Concurrency: one store lock guards the tiers' indexes and pins. Copies out of a memory tier
run outside the lock (the chunk is reader-pinned, so nobody frees its pages meanwhile); disk
encoding and writes run on the disk tier's writer thread.

Lifetime of a chunk (``[num_layers, 2, chunk_size, num_kv_heads, head_dim]``)::

    put ─► top tier ──evict──► next tier ──evict──► ... ──evict──► gone
              ▲                    │ hit (get)
              └────── promote ─────┘
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Sequence

import torch

from kvstore.api import KVStoreBase, LookupResult, StoreCapabilities, chain_parents
from kvstore.config import StoreConfig
from kvstore.direct import ALREADY_STORED, DirectIO, Reservation
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout
from kvstore.metrics import StoreMetrics
from kvstore.movement import TierMover
from kvstore.pins import PinTable
from kvstore.store_admin import StoreAdmin
from kvstore.tiers.base import Tier
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.memory import MemoryTier

log = logging.getLogger("kvstore.store")


class ChunkStore(StoreAdmin, DirectIO, KVStoreBase):
    """In-process tiered store (see module docstring). Thread-safe.

    ``put_chunks`` and ``persist`` copy the tensors they are given (``copies_on_put`` in
    ``capabilities``), so a caller may reuse its buffers as soon as they return. Direct I/O
    for a server (reserve pages, commit them in place; borrow pinned views) comes from
    ``kvstore.direct.DirectIO``.

    Args:
        config: capacities, policies and paths.
        namespaces: namespaces to check against the capacities now (others are checked on
            first use).

    Raises:
        ValueError: a tier smaller than one chunk of a given namespace.
    """

    def __init__(self, config: StoreConfig, namespaces: Sequence[Namespace] = ()) -> None:
        self.config = config
        self.metrics = StoreMetrics()
        self._lock = threading.RLock()
        self._closed = False
        self.tiers: list[Tier] = []
        # the disk tier first: a disk path in use is refused before any arena is allocated
        disk = DiskTier(config.disk_path, config.disk_bytes, config.disk_policy,
                        config.disk_codec) if config.disk_bytes else None
        try:
            if config.gpu_bytes:
                self.tiers.append(GpuTier(config.gpu_bytes, config.page_bytes, config.device,
                                          config.gpu_policy))
            if config.cpu_bytes:
                self.tiers.append(CpuTier(config.cpu_bytes, config.page_bytes, config.cpu_policy))
        except BaseException:
            if disk is not None:
                disk.close()  # (releases the disk path)
            raise
        if disk is not None:
            self.tiers.append(disk)
        self._pins = PinTable()
        self._doomed: set[ChunkKey] = set()  # removed while pinned: invisible, freed at last unpin
        #: open reservations (``reserve_chunks``): key -> parent, until committed or released
        self._reserved: dict[ChunkKey, ChunkKey | None] = {}
        self._mover = TierMover(self.tiers, self.metrics, self._pins.evictable, self._doomed,
                                self._reserved)
        #: layouts of the namespaces checked by ``register``, least recently used first
        #: (at most ``config.max_namespaces``)
        self._layouts: OrderedDict[bytes, KVLayout] = OrderedDict()
        self._layouts_lock = threading.Lock()
        for i, t in enumerate(self.tiers):
            t.listener = self._on_tier_event
            # a tier evicting on its own (the disk tier when lmdb's map is full) may take only
            # an unpinned chunk whose going strands no stored chunk
            t.evictable = (lambda k, i=i: self._pins.evictable(k)
                           and self._mover.strands_nothing(k, i))
            self.metrics.bind_tier(t.name, lambda t=t: t.used_bytes, lambda t=t: t.capacity_bytes,
                                   lambda t=t: t.num_chunks)
            if isinstance(t, DiskTier) and t.num_bad_at_open:
                self.metrics.inc("corruptions", t.num_bad_at_open, tier=t.name)
        try:
            for ns in namespaces:
                self.register(ns)
        except BaseException:
            self.close()  # (releases the disk path)
            raise

    @property
    def capabilities(self) -> StoreCapabilities:
        """Pins, non-blocking lookups, ``get_chunks(out=)``, copying puts; direct I/O
        (``kvstore.direct``): reservations (None per chunk where the top tier is not host
        memory), and borrowed reads unless a subclass redefines ``get_chunks`` (its reads must
        go through it); durable puts with a disk tier. Tiers as configured, top first."""
        own_reads = type(self).get_chunks is ChunkStore.get_chunks
        return StoreCapabilities(
            borrowed_reads=own_reads, reservations=True, pins=True,
            durable_puts=self.has_disk_tier, nonblocking_lookup=True, get_into_buffers=True,
            copies_on_put=True, tiers=tuple(t.name for t in self.tiers))

    # ---- helpers ------------------------------------------------------------------------------
    def register(self, ns: Namespace) -> None:
        """Check ``ns``'s chunk size against every tier (done on first use otherwise). The
        store remembers the last ``config.max_namespaces`` namespaces checked; the least
        recently used beyond are forgotten (counted in ``namespace_evictions``), so requests
        naming ever new namespaces hold a bounded amount of memory. Forgetting loses nothing:
        the next call checks the layout again.

        Raises:
            ValueError: a tier smaller than one chunk.
        """
        layouts, ns_id = self._layouts, ns.ns_id
        try:
            layouts.move_to_end(ns_id)  # known: now the most recently used
            return
        except KeyError:
            pass
        self.config.check_layout(ns.layout)
        evicted = 0
        with self._layouts_lock:
            layouts[ns_id] = ns.layout
            while len(layouts) > self.config.max_namespaces:
                layouts.popitem(last=False)
                evicted += 1
        self.metrics.inc("namespace_evictions", evicted)

    @property
    def num_namespaces(self) -> int:
        """Namespaces remembered by ``register`` now (at most ``config.max_namespaces``)."""
        return len(self._layouts)

    def _check_parents(self, ns: Namespace, keys: Sequence[ChunkKey],
                       parents: Sequence[ChunkKey | None] | None) -> list[ChunkKey | None]:
        """Per-key parents: ``chain_parents(keys)`` when ``parents`` is None.

        Raises:
            ValueError: a count other than ``len(keys)``, a parent that is not a ``ChunkKey``
                or None, of another namespace, or equal to its own key.
        """
        if parents is None:
            return chain_parents(keys)
        parents = list(parents)
        if len(parents) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
        for k, p in zip(keys, parents):
            if p is None:
                continue
            if not isinstance(p, ChunkKey):
                raise ValueError(f"a parent must be a ChunkKey or None, got {type(p).__name__}")
            if p.ns_id != ns.ns_id:
                raise ValueError(f"parent {p!r} of {k!r} belongs to another namespace")
            if p == k:
                raise ValueError(f"{k!r} is given as its own parent")
        return parents

    def _check_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> None:
        if self._closed:
            raise RuntimeError("store is closed")
        self.register(ns)
        ns_id = ns.ns_id
        for k in keys:
            if k.__class__ is not ChunkKey and not isinstance(k, ChunkKey):
                raise ValueError(f"expected ChunkKey, got {type(k).__name__}")
            if k.ns_id != ns_id:
                raise ValueError(f"key {k!r} belongs to namespace {k.ns_id.hex()}, not {ns.ns_id.hex()}")

    def _on_tier_event(self, event: str, tier: str, n: int) -> None:
        name = {"eviction": "evictions", "corruption": "corruptions",
                "dropped_write": "dropped_writes", "error": "errors"}[event]
        self.metrics.inc(name, n, tier=tier)

    def _locate(self, key: ChunkKey) -> Tier | None:
        """Fastest tier holding ``key`` (None when absent or removed)."""
        if key in self._doomed:
            return None
        for t in self.tiers:
            if t.contains(key):
                return t
        return None

    def _commit_reserved(self, res: Reservation, key: ChunkKey, parent: ChunkKey | None,
                         layout: KVLayout) -> bool:
        """Make a filled reservation the chunk ``key`` of ``layout`` (in place). False if the
        reservation was released already (e.g. the store was closed)."""
        try:
            res.tier.commit(key, res.pages, layout.shape(), layout.torch_dtype, parent)
        except KeyError:
            return False
        self._reserved.pop(key, None)
        return True

    def _end_reservation(self, res: Reservation) -> None:
        """Give back a reservation's pages (idempotent) and forget its key."""
        res.tier.release(res.pages)
        if res.key is not None:
            self._reserved.pop(res.key, None)

    # ---- KVStoreBase --------------------------------------------------------------------------
    def lookup_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> LookupResult:
        return self._lookup(ns, keys, blocking=True)

    def try_lookup_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> LookupResult | None:
        """``lookup_keys`` if the store lock is free right now, else None at once (never
        waits: an event loop can call it inline and fall back to a thread when it is busy).

        Raises:
            ValueError, RuntimeError: as ``lookup_keys``.
        """
        return self._lookup(ns, keys, blocking=False)

    def _lookup(self, ns: Namespace, keys: Sequence[ChunkKey], blocking: bool) -> LookupResult | None:
        t0 = time.perf_counter()
        self._check_keys(ns, keys)
        tiers = []
        if not self._lock.acquire(blocking):
            return None
        try:
            self._expire_leases()
            for k in keys:
                t = self._locate(k)
                if t is None:
                    break
                tiers.append(t.name)
        finally:
            self._lock.release()
        cs = ns.layout.chunk_size
        self.metrics.inc("lookups")
        self.metrics.inc("requested_tokens", len(keys) * cs)
        self.metrics.inc("hit_tokens", len(tiers) * cs)
        self.metrics.observe("lookup", time.perf_counter() - t0)
        return LookupResult(len(tiers), cs, tuple(tiers), len(keys))

    def exists(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_keys(ns, keys)
        with self._lock:
            self._expire_leases()
            return [self._locate(k) is not None for k in keys]

    def get_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """As ``KVStoreBase.get_chunks``; ``out`` (optional, one contiguous tensor per key of
        the layout's shape and dtype on ``config.return_device``) receives chunks read from a
        memory tier, which are then returned as ``out[i]`` (a disk hit is a new tensor), so a
        caller reusing buffers allocates nothing per call.

        Raises:
            ValueError: a key of another namespace, or ``len(out) != len(keys)``.
        """
        t0 = time.perf_counter()
        self._check_keys(ns, keys)
        if out is not None and len(out) != len(keys):
            raise ValueError(f"get_chunks: {len(keys)} keys but {len(out)} out tensors")
        bufs = list(out) if out is not None else [None] * len(keys)
        plan: list[tuple[ChunkKey, Tier] | None] = []
        with self._lock:
            self._expire_leases()
            for k in keys:
                t = self._locate(k)
                if t is not None:
                    self._pins.add_reader(k)
                    t.touch(k)
                plan.append((k, t) if t is not None else None)
        out: list[torch.Tensor | None] = []
        try:
            for item, buf in zip(plan, bufs):
                out.append(None if item is None else self._read_checked(ns.layout, *item, buf))
        finally:
            with self._lock:
                # promote while still reader-pinned: a chunk removed during the read is in
                # _doomed now; once its last pin drops it is freed and leaves _doomed, and a
                # promotion then would bring the removed chunk back
                if self.config.promote_on_hit:
                    self._mover.promote(plan, out, self._doomed)
                for item in plan:
                    if item is not None:
                        self._pins.drop_reader(item[0])
                        self._maybe_free(item[0])
        for item, kv in zip(plan, out):
            if kv is None:
                self.metrics.inc("misses")
            else:
                self.metrics.inc("hits", tier=item[1].name)
        self.metrics.observe("get", time.perf_counter() - t0)
        return out

    def _read_checked(self, layout: KVLayout, key: ChunkKey, tier: Tier,
                      buf: torch.Tensor | None = None) -> torch.Tensor | None:
        """Read the reader-pinned ``key`` from ``tier`` (which indexed it). A read that cannot
        serve an indexed chunk (value missing, corrupt, wrong shape or dtype) is a stale index
        entry: the entry is dropped from the tier (so the next lookup no longer reports it),
        counted in ``stale_index_entries`` and the chunk is a miss."""
        if buf is not None and isinstance(tier, MemoryTier):
            kv = tier.read(key, self.config.return_device, out=buf)
        else:
            kv = tier.read(key, self.config.return_device)
        if kv is not None and (tuple(kv.shape) != layout.shape() or kv.dtype != layout.torch_dtype):
            log.warning("%s tier returned %s %s for %r, layout says %s %s; deleted", tier.name,
                        list(kv.shape), kv.dtype, key, list(layout.shape()), layout.torch_dtype)
            self.metrics.inc("corruptions", tier=tier.name)
            kv = None
        if kv is None:
            self._drop_stale(key, tier)
        return kv

    def _drop_stale(self, key: ChunkKey, tier: Tier) -> None:
        """Forget an indexed chunk that ``tier`` could not read (the tier may have dropped it
        already, e.g. the disk tier on a checksum failure). The chunk was reader-pinned, so
        neither eviction nor ``remove`` took it meanwhile: the index was wrong."""
        log.warning("%s tier indexed %r but could not serve it; dropped from the index",
                    tier.name, key)
        with self._lock:
            tier.delete(key)
        self.metrics.inc("stale_index_entries", tier=tier.name)

    def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
                   parents: Sequence[ChunkKey | None] | None = None) -> int:
        """As ``KVStoreBase.put_chunks``. A chunk whose parent is stored in no tier is not
        stored (it could never be reached; counted in ``rejected_chunks``), nor is one that
        fits only by evicting its own stored ancestors (``kvstore.movement``).

        Raises:
            ValueError: see ``KVStoreBase.put_chunks``; nothing is stored then.
        """
        parents = self._check_write(ns, keys, kvs, parents, "put_chunks")
        return self._place(keys, kvs, parents, ns.layout)

    def _check_write(self, ns: Namespace, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
                     parents: Sequence[ChunkKey | None] | None, op: str) -> list[ChunkKey | None]:
        """Validate a write of ``kvs`` under ``keys`` (keys, counts, parents, each tensor's
        shape and dtype against ``ns.layout``); returns the per-key parents.

        Raises:
            ValueError: any of those is wrong (the message names ``op``); nothing is stored.
        """
        self._check_keys(ns, keys)
        if len(keys) != len(kvs):
            raise ValueError(f"{op}: {len(keys)} keys but {len(kvs)} tensors")
        parents = self._check_parents(ns, keys, parents)
        for kv in kvs:
            ns.layout.validate(kv)
        return parents

    def _place(self, keys: Sequence[ChunkKey], items: Sequence,
               parents: Sequence[ChunkKey | None], layout: KVLayout) -> int:
        """Store ``items[i]`` (a tensor, or a filled ``Reservation``) as ``keys[i]`` with the
        parent ``parents[i]``, in order. A key already stored (or removed while pinned and put
        again) keeps its value and its reservation is released; a key whose parent is stored
        nowhere is rejected. Returns how many were newly stored."""
        t0 = time.perf_counter()
        stored = 0
        with self._lock:
            self._expire_leases()
            for key, item, parent in zip(keys, items, parents):
                if item is ALREADY_STORED:
                    continue
                res = item if isinstance(item, Reservation) else None
                if item is not None and (key in self._doomed or self._locate(key) is not None):
                    self._doomed.discard(key)  # removed while pinned, put again: keep it
                    if res is not None:
                        self._end_reservation(res)
                    continue
                if item is None:  # dropped by the caller (no room was reserved)
                    ok = False
                elif parent is not None and not self._mover.present(parent):
                    ok = False  # its prefix is gone: a lookup could never reach it
                    if res is not None:
                        self._end_reservation(res)
                elif res is not None:
                    ok = self._commit_reserved(res, key, parent, layout)
                else:
                    ok = any(self._mover.insert(j, key, item, parent)
                             for j in range(len(self.tiers)))
                stored += ok
                if not ok:
                    self.metrics.inc("rejected_chunks")
                    if res is not None:
                        self._end_reservation(res)
        self.metrics.inc("stored_chunks", stored)
        self.metrics.observe("put", time.perf_counter() - t0)
        return stored

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for t in self.tiers:
                t.close()

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

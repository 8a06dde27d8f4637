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
  store takes its stored descendants with it (``kvstore.movement``), also when a tier loses
  it on its own (a disk write that fails, a corrupt chunk: ``StoreState.drop_stranded``). Only
  ``remove`` (and a restart, which loses the memory tiers' chunks that ``close`` did not
  persist: ``kvstore.close_persist``) can leave a chunk without its parent; such chunks are
  counted in ``unreachable_bytes``;
* what a read that cannot serve an indexed chunk means: a stale index entry, dropped and
  counted (``stale_index_entries``).

Pin counts live in ``kvstore.pins`` (``PinTable``); insert/evict/spill/promote in
``kvstore.movement`` (``TierMover``); the state the parts share, the store lock and the
argument checks in ``kvstore.store_state`` (``StoreState``). The store is composed of three
parts over that state: this module is the data path (lookup, get, put); removal, pins, persist
and stats are ``kvstore.store_admin.StoreAdmin``; reservations and borrowed reads are
``kvstore.direct.DirectIO``. ``ChunkStore`` takes their public methods from the mixins of
``kvstore.store_methods``.

Concurrency: one store lock guards the tiers' indexes and pins. Copies out of a memory tier
run outside the lock (the chunk is reader-pinned); disk I/O runs on the disk tier's writer.

Lifetime of a chunk (``[num_layers, 2, chunk_size, num_kv_heads, head_dim]``)::

    put ─► top tier ──evict──► next tier ──evict──► ... ──evict──► gone
              ▲                    │ hit (get)
              └────── promote ─────┘
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from kvstore.api import KVStoreBase, LookupResult, StoreCapabilities
from kvstore.config import StoreConfig
from kvstore.direct import ALREADY_STORED, DirectIO, Reservation
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout
from kvstore.metrics import StoreMetrics
from kvstore.store_admin import StoreAdmin
from kvstore.store_methods import AdminMethods, DirectMethods
from kvstore.store_state import StoreState
from kvstore.tiers.base import Tier
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier

#: tier name of the remote tier (``kvstore.tiers.remote``, imported only when configured: it
#: needs the ``redis`` package)
REMOTE = "remote"


class ChunkStore(AdminMethods, DirectMethods, KVStoreBase):
    """In-process tiered store (see module docstring). Thread-safe.

    ``put_chunks`` and ``persist`` copy the tensors they are given (``copies_on_put`` in
    ``capabilities``), so a caller may reuse its buffers as soon as they return.

    Args:
        config: capacities, policies and paths.
        namespaces: namespaces to check against the capacities now (others are checked on
            first use).

    Attributes:
        config: as given. metrics: the store's counters (``StoreMetrics``).
        tiers: the tiers, top (fastest) first.

    Raises:
        ValueError: a tier smaller than one chunk of a given namespace.
    """

    def __init__(self, config: StoreConfig, namespaces: Sequence[Namespace] = ()) -> None:
        self.config = config
        self.metrics = StoreMetrics()
        #: the lookup latency histogram's child (``metrics.observe("lookup")`` without the
        #: label look-up on every call)
        self._lookup_latency = self.metrics.latency.labels(op="lookup")
        self.tiers: list[Tier] = []
        # the disk tier first: a disk path in use is refused before any arena is allocated
        disk = DiskTier(config.disk_path, config.disk_bytes, config.disk_policy,
                        config.disk_codec, allow_shrink=config.allow_disk_shrink) \
            if config.disk_bytes else None
        try:
            if config.gpu_bytes:
                self.tiers.append(GpuTier(config.gpu_bytes, config.page_bytes, config.device,
                                          config.gpu_policy))
            if config.cpu_bytes:
                self.tiers.append(CpuTier(config.cpu_bytes, config.page_bytes, config.cpu_policy,
                                          shared=config.cpu_shared))
        except BaseException:
            if disk is not None:
                disk.close()  # (releases the disk path)
            raise
        if disk is not None:
            self.tiers.append(disk)
        self._st = st = StoreState(config, self.tiers, self.metrics)
        # the shared state's lock, pins and removed-while-pinned set, under the store's names
        self._lock, self._pins, self._doomed = st.lock, st.pins, st.doomed
        if st.admission is not None:  # a demoted victim never keeps a newcomer out
            st.admission.victim_demoted = lambda k: any(t.is_demoted(k) for t in self.tiers)
        self._admin = StoreAdmin(st)
        self._direct = DirectIO(st, self._place)
        for i, t in enumerate(self.tiers):
            t.listener = self._on_tier_event
            t.lost = st.tier_lost  # (its stored descendants leave at the next operation)
            # a tier evicting on its own (the disk tier when lmdb's map is full) may take only
            # an unpinned chunk whose going strands no stored chunk
            t.evictable = (lambda k, i=i: st.pins.evictable(k)
                           and st.mover.strands_nothing(k, i))
            # a chunk spilled from a tier where it was demoted stays demoted below
            t.demoted_elsewhere = (lambda k, t=t: any(o is not t and o.is_demoted(k)
                                                      for o in self.tiers))
            self.metrics.bind_tier(t.name, lambda t=t: t.used_bytes, lambda t=t: t.capacity_bytes,
                                   lambda t=t: t.num_chunks)
            if isinstance(t, DiskTier):
                t.lossy_codec_of = st.lossy_codec_of  # (kvstore.kv_codec's rule)
                if t.num_bad_at_open:
                    self.metrics.inc("corruptions", t.num_bad_at_open, tier=t.name)
        try:
            if config.remote_url:  # (wired to the store: its codec rule, a Redis restart)
                from kvstore.republish import open_remote
                st.remote = open_remote(st, config, self.metrics.registry)
                self.metrics.add_tier("remote", ("hits", "promotions"))  # (its chunks served)
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
        go through it); durable puts with a disk tier; non-blocking lookups unless a subclass
        redefines ``lookup_keys`` (``try_lookup_keys`` would go around it). Tiers as
        configured, top first."""
        own_reads = type(self).get_chunks is ChunkStore.get_chunks
        own_lookup = type(self).lookup_keys is ChunkStore.lookup_keys
        remote = (REMOTE,) if self._st.remote is not None else ()
        return StoreCapabilities(
            borrowed_reads=own_reads, reservations=True, pins=True,
            durable_puts=self.has_disk_tier, nonblocking_lookup=own_lookup, get_into_buffers=True,
            copies_on_put=True, tiers=tuple(t.name for t in self.tiers) + remote)

    @property
    def remote(self):
        """The remote tier (``kvstore.tiers.remote.RemoteTier``: Redis), or None."""
        return self._st.remote

    def register(self, ns: Namespace) -> None:
        """Check ``ns``'s chunk size against every tier (done on first use otherwise). The
        store remembers the last ``config.max_namespaces`` namespaces checked; the least
        recently used beyond are forgotten (counted in ``namespace_evictions``), so requests
        naming ever new namespaces hold a bounded amount of memory. Forgetting loses nothing:
        the next call checks the layout again.

        Raises:
            ValueError: a tier smaller than one chunk.
        """
        self._st.register(ns)

    @property
    def num_namespaces(self) -> int:
        """Namespaces remembered by ``register`` now (at most ``config.max_namespaces``)."""
        return self._st.num_namespaces

    def _on_tier_event(self, event: str, tier: str, n: int) -> None:
        name = {"eviction": "evictions", "corruption": "corruptions",
                "dropped_write": "dropped_writes", "error": "errors"}[event]
        self.metrics.inc(name, n, tier=tier)

    # ---- KVStoreBase: the data path -----------------------------------------------------------
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
        st = self._st
        st.check_keys(ns, keys)
        tiers = []
        if not st.lock.acquire(blocking):
            return None
        try:
            st.expire_leases()
            tiers = [t.name for t in st.locate_leading(keys)]
            rest = keys[len(tiers):]
            local = [st.locate(k) for k in rest] if rest and st.remote is not None else None
        finally:
            st.lock.release()
        if local is not None:
            if not blocking:
                return None  # the remote tier is network I/O: not on the caller's event loop
            found = st.remote.lookup([k for k, t in zip(rest, local) if t is None])
            it = iter(found)
            for t in local:
                name = t.name if t is not None else (REMOTE if next(it) else None)
                if name is None:
                    break
                tiers.append(name)
        cs = ns.layout.chunk_size
        self.metrics.inc("lookups")
        self.metrics.inc("requested_tokens", len(keys) * cs)
        self.metrics.inc("hit_tokens", len(tiers) * cs)
        self._lookup_latency.observe(time.perf_counter() - t0)  # (metrics.observe("lookup"))
        return LookupResult(len(tiers), cs, tuple(tiers), len(keys))

    def exists(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[bool]:
        st = self._st
        st.check_keys(ns, keys)
        with st.lock:
            st.expire_leases()
            found = [st.locate(k) is not None for k in keys]
        if st.remote is not None and not all(found):
            missing = [i for i, f in enumerate(found) if not f]
            for i, f in zip(missing, st.remote.lookup([keys[i] for i in missing])):
                found[i] = f
        return found

    def get_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor | None]:
        """As ``KVStoreBase.get_chunks``; ``out`` (optional, one contiguous tensor per key of
        the layout's shape and dtype on ``config.return_device``) receives chunks read from a
        memory tier or from Redis, which are then returned as ``out[i]`` (a disk hit is a new
        tensor), so a caller reusing buffers allocates nothing per call. Without ``out``, a
        chunk read from Redis is a tensor over the received value's memory: copy it before
        writing into it.

        Raises:
            ValueError: a key of another namespace, or ``len(out) != len(keys)``.
        """
        t0 = time.perf_counter()
        st = self._st
        st.check_keys(ns, keys)
        if out is not None and len(out) != len(keys):
            raise ValueError(f"get_chunks: {len(keys)} keys but {len(out)} out tensors")
        bufs = list(out) if out is not None else [None] * len(keys)
        plan: list[tuple[ChunkKey, Tier] | None] = []
        with st.lock:
            st.expire_leases()
            for k in keys:
                t = st.locate(k)
                if t is not None:
                    st.pins.add_reader(k)
                    t.touch(k)
                    st.record(k)
                plan.append((k, t) if t is not None else None)
        out: list[torch.Tensor | None] = []
        try:
            for item, buf in zip(plan, bufs):
                out.append(None if item is None else st.read_checked(ns.layout, *item, buf))
        finally:
            with st.lock:
                # promote while still reader-pinned: a chunk removed during the read is in
                # doomed now; once its last pin drops it is freed and leaves doomed, and a
                # promotion then would bring the removed chunk back
                if self.config.promote_on_hit:
                    st.mover.promote(plan, out, st.doomed)
                for item in plan:
                    if item is not None:
                        st.pins.drop_reader(item[0])
                        st.maybe_free(item[0])
        for item, kv in zip(plan, out):
            if kv is not None:
                self.metrics.inc("hits", tier=item[1].name)
        if st.remote is not None:
            todo = [i for i, item in enumerate(plan) if item is None]
            for i, kv in zip(todo, st.read_remote(ns.layout, [keys[i] for i in todo])):
                if kv is not None and bufs[i] is not None:
                    kv = bufs[i].copy_(kv)
                out[i] = kv
        self.metrics.inc("misses", sum(kv is None for kv in out))
        self.metrics.observe("get", time.perf_counter() - t0)
        return out

    def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
                   parents: Sequence[ChunkKey | None] | None = None) -> int:
        """As ``KVStoreBase.put_chunks``. A chunk whose parent is stored in no tier is not
        stored (it could never be reached; counted in ``rejected_chunks``), nor is one that
        fits only by evicting its own stored ancestors (``kvstore.movement``).

        Raises:
            ValueError: see ``KVStoreBase.put_chunks``; nothing is stored then.
        """
        parents = self._st.check_write(ns, keys, kvs, parents, "put_chunks")
        return self._place(keys, kvs, parents, ns.layout)

    def _place(self, keys: Sequence[ChunkKey], items: Sequence,
               parents: Sequence[ChunkKey | None], layout: KVLayout) -> int:
        """Store ``items[i]`` (a tensor, or a filled ``Reservation``) as ``keys[i]`` with the
        parent ``parents[i]``, in order. A key already stored (or removed while pinned and put
        again) keeps its value and its reservation is released; a key whose parent is stored
        nowhere is rejected. Returns how many were newly stored."""
        t0 = time.perf_counter()
        st = self._st
        stored = 0
        with st.lock:
            st.expire_leases()
            for key, item, parent in zip(keys, items, parents):
                if item is ALREADY_STORED:
                    continue
                res = item if isinstance(item, Reservation) else None
                if item is not None and (key in st.doomed or st.locate(key) is not None):
                    st.doomed.discard(key)  # removed while pinned, put again: keep it
                    if res is not None:
                        st.end_reservation(res)
                    continue
                if res is None and item is not None:
                    st.record(key)  # (reserve_chunks counted the reserved and the dropped)
                if item is None:  # dropped by the caller (no room was reserved)
                    ok = False
                elif parent is not None and not st.mover.present(parent):
                    ok = False  # its prefix is gone: a lookup could never reach it
                    if res is not None:
                        st.end_reservation(res)
                elif res is not None:
                    ok = st.commit_reserved(res, key, parent, layout)
                else:
                    ok = any(st.mover.insert(j, key, item, parent)
                             for j in range(len(self.tiers)))
                if ok and st.remote is not None:
                    if res is not None:
                        st.write_behind(key, res.tier.read(key), parent, owned=True)
                    else:
                        st.write_behind(key, item, parent)
                stored += ok
                if not ok:
                    self.metrics.inc("rejected_chunks")
                    if res is not None:
                        st.end_reservation(res)
        self.metrics.inc("stored_chunks", stored)
        self.metrics.observe("put", time.perf_counter() - t0)
        return stored

    def stored_keys(self) -> set[ChunkKey]:
        return {k for t in self.tiers for k in t.keys()}

    def metrics_registry(self):
        return self.metrics.registry

    def check_integrity(self) -> None:
        """Check every memory owner (tiers, pins); raises ``AssertionError``."""
        self._admin.check_integrity()

    def shared_arena(self) -> tuple[int, int, int] | None:
        """The CPU tier's shared arena (``StoreConfig.cpu_shared``) as ``(fd, nbytes,
        page_bytes)``: its memfd (owned by the tier, valid until ``close``), its size and page
        size in bytes; None without one. Chunks borrowed from it (``borrow_chunks``) lie at
        ``BorrowedChunks.runs``."""
        for t in self.tiers:
            if isinstance(t, CpuTier) and t.shared_fd is not None:
                return t.shared_fd, t.pool.numel(), t.page_bytes
        return None

    def close(self, persist_s: float | None = None) -> None:
        """Release the tiers (queued disk writes committed). Idempotent. ``persist_s``: seconds
        for ``persist_memory_tiers`` first (None: ``config.persist_on_close_s``; 0: none).
        Raises ValueError: a negative ``persist_s`` (nothing is closed then)."""
        budget = self.config.persist_on_close_s if persist_s is None else persist_s
        if not 0 <= budget < float("inf"):
            raise ValueError(f"persist_s must be a number of seconds >= 0, got {persist_s!r}")
        if self._st.remote is not None:
            self._st.remote.on_close()  # (its restart pass reads no tier while they close)
        with self._st.lock:
            if self._st.closed:
                return
            self._st.closed = True
            try:
                self._prepare_close(budget)
            finally:  # (a failed pass still releases the tiers and the disk path)
                for t in self.tiers:
                    t.close()
        if self._st.remote is not None:
            self._st.remote.close()

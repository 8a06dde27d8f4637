"""The state one ``ChunkStore`` shares between its parts, and the checks every operation makes.

``kvstore.store.ChunkStore`` (the data path: lookup, get, put), ``kvstore.store_admin.StoreAdmin``
(removal, pins, durability, introspection) and ``kvstore.direct.DirectIO`` (reservations and
borrowed reads) each hold the same ``StoreState``: the tiers, the store lock, the pin table, the
chunks removed while pinned, the open reservations, the tier mover and the metrics. Anything
reading or changing the tiers' indexes or the pins holds ``lock``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from itertools import repeat, takewhile
from operator import eq
from typing import TYPE_CHECKING, Sequence

import torch

from kvstore.api import chain_parents
from kvstore.config import StoreConfig
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout
from kvstore.metrics import StoreMetrics
from kvstore.eviction.admission import create_admission
from kvstore.movement import TierMover
from kvstore.pins import PinTable
from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.memory import MemoryTier

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.direct import Reservation
    from kvstore.tiers.remote import RemoteTier

log = logging.getLogger("kvstore.store")

_KEY_TYPE = {ChunkKey}
_NS_ID = ChunkKey.ns_id.fget  # a key's ns_id


class StoreState:
    """Tiers, lock, pins and bookkeeping of one store (see module docstring).

    Args:
        config: the store's configuration.
        tiers: the tiers, top (fastest) first.
        metrics: the store's counters.

    Attributes:
        lock: guards the tiers' indexes, ``pins``, ``doomed`` and ``reserved`` (re-entrant).
        pins: reader, explicit and leased pins per chunk.
        doomed: chunks removed while pinned: invisible, freed at their last unpin.
        reserved: open reservations (``reserve_chunks``): key -> parent, until committed or
            released.
        mover: insert, evict, spill and promote across ``tiers``.
        closed: set once by ``ChunkStore.close``.
    """

    def __init__(self, config: StoreConfig, tiers: list[Tier], metrics: StoreMetrics) -> None:
        self.config, self.tiers, self.metrics = config, tiers, metrics
        self.lock = threading.RLock()
        self.closed = False
        self.pins = PinTable()
        self.doomed: set[ChunkKey] = set()
        self.reserved: dict[ChunkKey, ChunkKey | None] = {}
        #: the admission filter shared by every tier (None: admit), fed by ``record``
        self.admission = create_admission(config.admission)
        self.mover = TierMover(tiers, metrics, self.pins.evictable, self.doomed, self.reserved,
                               self.admission)
        #: the remote tier (Redis) below ``tiers``, or None (``kvstore.tiers.remote``)
        self.remote: "RemoteTier | None" = None
        #: the namespaces checked by ``register`` by id, least recently used first (at most
        #: ``config.max_namespaces``)
        self._namespaces: OrderedDict[bytes, Namespace] = OrderedDict()
        self._namespaces_lock = threading.Lock()
        #: keys a tier lost on its own (a disk write that failed, a corrupt chunk deleted),
        #: appended from any thread without the store lock (``tier_lost``); their stored
        #: descendants leave at the next operation under the lock (``expire_leases``)
        self.lost: deque[ChunkKey] = deque()
        for t in tiers:  # a tier evicting on its own: chosen and counted as ``mover`` does
            t.evicted, t.reachable = self.tier_evicted, self.mover.reachable
        # at the open only the disk tier holds chunks: those it holds without their parent
        # are unreachable (unless a remote tier holds the parent): its first victims
        for t in tiers if not config.remote_url else ():
            if isinstance(t, DiskTier):
                t.demote_unreachable()

    # ---- namespaces and argument checks -------------------------------------------------------
    def register(self, ns: Namespace) -> None:
        """See ``ChunkStore.register``.

        Raises:
            ValueError: a tier smaller than one chunk.
        """
        known, ns_id = self._namespaces, ns.ns_id
        try:
            known.move_to_end(ns_id)  # known: now the most recently used
            return
        except KeyError:
            pass
        self.config.check_layout(ns.layout)
        evicted = 0
        with self._namespaces_lock:
            known[ns_id] = ns
            while len(known) > self.config.max_namespaces:
                known.popitem(last=False)
                evicted += 1
        self.metrics.inc("namespace_evictions", evicted)

    @property
    def num_namespaces(self) -> int:
        """Namespaces remembered by ``register`` now (at most ``config.max_namespaces``)."""
        return len(self._namespaces)

    def lossy_codec_of(self, ns_id: bytes) -> str:
        """The lossy codec the registered namespace ``ns_id`` accepts (``Namespace.lossy_codec``;
        ``""`` for none, and for a namespace not remembered: its chunks are written exactly).
        Called by the disk and remote tiers on a put, from any thread."""
        ns = self._namespaces.get(ns_id)
        return ns.lossy_codec if ns is not None else ""

    def check_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> None:
        """Register ``ns`` and check each key is a ``ChunkKey`` of it.

        Raises:
            RuntimeError: the store is closed. ValueError: a bad key, or ``ns`` does not fit.
        """
        if self.closed:
            raise RuntimeError("store is closed")
        self.register(ns)
        ns_id = ns.ns_id
        # the usual case in two C-level passes: every key a ChunkKey of ``ns``
        if set(map(type, keys)) <= _KEY_TYPE and all(map(eq, repeat(ns_id), map(_NS_ID, keys))):
            return
        for k in keys:
            if k.__class__ is not ChunkKey and not isinstance(k, ChunkKey):
                raise ValueError(f"expected ChunkKey, got {type(k).__name__}")
            if k.ns_id != ns_id:
                raise ValueError(f"key {k!r} belongs to namespace {k.ns_id.hex()}, not {ns.ns_id.hex()}")

    def check_parents(self, ns: Namespace, keys: Sequence[ChunkKey],
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

    def check_write(self, ns: Namespace, keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor],
                    parents: Sequence[ChunkKey | None] | None, op: str) -> list[ChunkKey | None]:
        """Validate a write of ``kvs`` under ``keys`` (keys, counts, parents, each tensor's
        shape and dtype against ``ns.layout``); returns the per-key parents.

        Raises:
            ValueError: any of those is wrong (the message names ``op``); nothing is stored.
        """
        self.check_keys(ns, keys)
        if len(keys) != len(kvs):
            raise ValueError(f"{op}: {len(keys)} keys but {len(kvs)} tensors")
        parents = self.check_parents(ns, keys, parents)
        for kv in kvs:
            ns.layout.validate(kv)
        return parents

    # ---- index, pins and removal (caller holds ``lock``) --------------------------------------
    def record(self, key: ChunkKey) -> None:
        """Count one request of ``key`` for the admission filter (a read served by a tier,
        or a put or reservation of a chunk not stored); no-op without a filter. Under the
        lock."""
        if self.admission is not None:
            self.admission.record(key)

    def locate(self, key: ChunkKey) -> Tier | None:
        """Fastest tier holding ``key`` (None when absent or removed)."""
        if key in self.doomed:
            return None
        for t in self.tiers:
            if t.contains(key):
                return t
        return None

    def locate_leading(self, keys: Sequence[ChunkKey]) -> list[Tier]:
        """The fastest tier holding each of ``keys``' leading located keys, as ``locate``
        gives them, up to the first key none holds (so ``len(result)`` is the number of
        leading keys found). Under the lock."""
        if self.doomed:
            out = []
            for k in keys:
                t = self.locate(k)
                if t is None:
                    break
                out.append(t)
            return out
        tiers = self.tiers
        if len(tiers) == 1:  # one tier: count the leading keys it holds in one C-level pass
            return [tiers[0]] * len(list(takewhile(tiers[0].contains, keys)))
        probes = [(t, t.contains) for t in tiers]
        out = []
        for k in keys:
            for t, has in probes:
                if has(k):
                    out.append(t)
                    break
            else:
                break
        return out

    def expire_leases(self) -> None:
        """Drop the leased pins whose time is up (freeing chunks removed meanwhile), and the
        stored descendants of chunks a tier lost (``tier_lost``). Under the store lock."""
        for key in self.pins.expire(time.monotonic()):
            self.maybe_free(key)
        while self.lost:
            self.drop_stranded(self.lost.popleft())

    def tier_lost(self, key: ChunkKey) -> None:
        """A tier dropped ``key`` on its own (its disk write failed, it was corrupt): queue
        it for ``drop_stranded``. Any thread; never blocks (a disk writer calls it while the
        store's thread may wait, under the store lock, for that writer's queue to drain)."""
        self.lost.append(key)

    def tier_evicted(self, key: ChunkKey) -> None:
        """A tier evicted ``key`` on its own (the disk tier when lmdb's map is full): count
        it in ``dropped_chunks`` when no tier holds it now (``TierMover.evict``'s count; the
        tier counted ``evictions``). Any thread; never blocks on the store lock."""
        if not self.mover.present(key):
            self.metrics.inc("dropped_chunks")

    def drop_stranded(self, key: ChunkKey) -> int:
        """Remove the stored descendants of ``key`` when ``key`` is stored nowhere any more
        (a lookup can never reach them: they would fill the tiers as ``unreachable_bytes``),
        deepest first; pinned ones are removed as ``remove`` does (at their last unpin).
        Returns how many went. Under the store lock."""
        if self.locate(key) is not None:
            return 0
        gone = list(reversed(self.mover.descendants(key)))
        for d in gone:
            if self.pins.count(d):
                self.doomed.add(d)
            else:
                self.delete_everywhere(d)
        if gone:
            log.warning("chunk %r was lost by its tier; removed its %d stored descendants "
                        "(unreachable without it)", key, len(gone))
            self.metrics.inc("stranded_removals", len(gone))
        return len(gone)

    def maybe_free(self, key: ChunkKey) -> None:
        """Delete ``key`` everywhere if it was removed while pinned and has no pin left."""
        if key in self.doomed and self.pins.count(key) == 0:
            self.delete_everywhere(key)

    def delete_everywhere(self, key: ChunkKey) -> None:
        for t in self.tiers:
            t.delete(key)
        self.doomed.discard(key)

    # ---- reads and reservations ---------------------------------------------------------------
    def read_checked(self, layout: KVLayout, key: ChunkKey, tier: Tier,
                     buf: torch.Tensor | None = None) -> torch.Tensor | None:
        """Read the reader-pinned ``key`` from ``tier`` (which indexed it) as
        ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` on ``config.return_device``
        (into ``buf`` for a memory tier when given). A read that cannot serve an indexed chunk
        (value missing, corrupt, wrong shape or dtype) is a stale index entry: the entry is
        dropped from the tier (so the next lookup no longer reports it), counted in
        ``stale_index_entries`` and the chunk is a miss (None)."""
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
        with self.lock:
            tier.delete(key)
        self.tier_lost(key)  # (its stored descendants go at the next operation)
        self.metrics.inc("stale_index_entries", tier=tier.name)

    def read_remote(self, layout: KVLayout, keys: Sequence[ChunkKey],
                    later: list | None = None) -> list[torch.Tensor | None]:
        """Read ``keys`` (stored in no local tier) from the remote tier: per key the chunk
        ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` on ``config.return_device``, or
        None. Hits are counted (``hits{tier="remote"}``) and, with ``promote_on_hit``, copied
        into the top tier in order (each after its parent), unless a local tier holds them
        by now: at once, or, when ``later`` (a list) is given, appended to it for
        ``promote_remote`` (so a caller sends the chunks first and copies them after)."""
        if not keys:
            return []
        got = self.remote.get(keys, layout)
        out: list[torch.Tensor | None] = []
        hits = [(key, *item) for key, item in zip(keys, got) if item is not None]
        self.metrics.inc("hits", len(hits), tier="remote")
        if self.config.promote_on_hit:
            if later is not None:
                later.extend(hits)
            else:
                self.promote_remote(hits)
        dev = self.config.return_device
        for item in got:
            out.append(None if item is None else item[0] if str(dev) == "cpu"
                       else item[0].to(dev))
        return out

    def promote_remote(self, hits: Sequence[tuple]) -> None:
        """Copy chunks read from the remote tier (``(key, kv, parent)``, in prompt order) into
        the top tier, skipping those a local tier holds by now or that were removed. Failures
        are logged and counted, never raised."""
        with self.lock:
            for key, kv, parent in hits:
                if self.locate(key) is not None or key in self.doomed:
                    continue
                try:
                    if self.mover.insert(0, key, kv, parent):
                        self.metrics.inc("promotions", tier="remote")
                except Exception:
                    log.exception("promotion of %r from the remote tier failed", key)
                    self.metrics.inc("errors", tier=self.tiers[0].name)

    def write_behind(self, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None,
                     owned: bool = False) -> None:
        """Queue a newly stored chunk for the remote tier (a CPU copy unless ``owned``: a CPU
        tensor nobody else writes); dropped and counted there when its queue is full."""
        cpu = kv.detach()
        if not owned or cpu.device.type != "cpu":
            cpu = cpu.to("cpu", copy=True)
        self.remote.put_behind(key, cpu.contiguous(), parent)

    def commit_reserved(self, res: "Reservation", key: ChunkKey, parent: ChunkKey | None,
                        layout: KVLayout) -> bool:
        """Make a filled reservation the chunk ``key`` of ``layout`` (in place). False if the
        reservation was released already (e.g. the store was closed)."""
        try:
            res.tier.commit(key, res.pages, layout.shape(), layout.torch_dtype, parent)
        except KeyError:
            return False
        self.reserved.pop(key, None)
        return True

    def end_reservation(self, res: "Reservation") -> None:
        """Give back a reservation's pages (idempotent) and forget its key."""
        res.tier.release(res.pages)
        if res.key is not None:
            self.reserved.pop(res.key, None)

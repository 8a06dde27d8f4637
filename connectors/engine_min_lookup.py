"""Scheduler-side lookups of ``connectors.engine_min.EngineMinConnector``: the ``PrefixLookup``
it owns.

The request's chunk plan (``connectors.chunk_plan.RequestChunks.lookup_query``) says which keys
to ask about: the full chunks past the engine's own hit, then the tail pieces after the leading
stored chunks, up to the end of the first missing chunk. ``PrefixLookup.run`` asks the store
(``lookup_keys``) within ``deadline_s``: inline when the store answers without waiting (an
in-process ``ChunkStore`` whose lock is free: no thread hop on the engine's critical path),
else on a worker thread. A timeout or a store error is a miss, counted as a lookup fallback
and logged once per cause (again after lookups worked again); the engine then prefills those
tokens itself.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Executor, wait

from connectors.chunk_plan import LookupQuery
from connectors.chunk_records import LookupHit
from connectors.engine_min_stats import ConnectorStats
from kvstore.api import KVStoreBase, LookupResult
from kvstore.config import TIER_NAMES
from kvstore.keys import Namespace
from kvstore.layered import LayeredStore
from kvstore.store import REMOTE

_NO_HIT = LookupResult(0, 0, (), 0)   # what an empty lookup answers


def _daemon_only(store: KVStoreBase) -> bool:
    """Whether every tier of ``store`` is behind a daemon (its client, or the client's
    breaker): its lookups name the daemon's tiers."""
    caps = store.capabilities
    return caps.remote and caps.tiers == (REMOTE,)


def _store_tier_names(store: KVStoreBase) -> tuple[str, ...]:
    """The tier names ``store.lookup_keys`` may answer: a daemon's client, those of any
    daemon (``kvstore.config.TIER_NAMES``, then ``REMOTE``: its Redis tier); a
    ``LayeredStore``, its local store's, then ``"remote:<name>"`` for its remote store's;
    any other store, its ``capabilities.tiers``."""
    if isinstance(store, LayeredStore):
        return _store_tier_names(store.local) + tuple(
            f"remote:{t}" for t in _store_tier_names(store.remote))
    if _daemon_only(store):
        return TIER_NAMES + (REMOTE,)
    return store.capabilities.tiers


def hit_tier_names(store: KVStoreBase) -> tuple[str, ...]:
    """Every tier name ``PrefixLookup.run`` may report a hit of ``store`` under (and the
    connector counts hit tokens by, ``kvstore_hit_tokens_by_tier``): ``"cpu"``, ``"disk"``...
    for in-process tiers, ``"remote:cpu"``... for a daemon's (all of a daemon's possible
    tiers: which it has is not known without asking it)."""
    names = _store_tier_names(store)
    return tuple(f"remote:{t}" for t in names) if _daemon_only(store) else names


class PrefixLookup:
    """Lookups of one connector's requests in its store.

    Args:
        store: the store asked (``lookup_keys``, ``try_lookup_keys``).
        pool: the worker threads a lookup that may wait runs on.
        stats: the connector's counters (lookup latency, fallbacks).
        deadline_s: longest wait for one lookup (seconds).
    """

    def __init__(self, store: KVStoreBase, pool: Executor, stats: ConnectorStats,
                 deadline_s: float) -> None:
        self.store, self._pool, self.stats, self.deadline_s = store, pool, stats, deadline_s
        caps = store.capabilities
        # a store whose every tier is behind a daemon (the daemon's client) reports the
        # daemon's tier names: shown as "remote:<tier>" (a layered store names them so itself)
        self._remote = _daemon_only(store)
        # an in-process store answers a lookup inline when its lock is free (no I/O); a
        # store whose lookup_keys is its own says nonblocking_lookup=False
        self._inline = caps.nonblocking_lookup and not caps.remote
        self.ns: Namespace | None = None
        self.tail_ns: Namespace | None = None

    def bind(self, ns: Namespace, tail_ns: Namespace | None) -> None:
        """Ask about full chunks in ``ns`` and tail pieces in ``tail_ns`` (None: no pieces)."""
        self.ns, self.tail_ns = ns, tail_ns

    def run(self, query: LookupQuery) -> LookupHit:
        """``query`` inline when the store answers without waiting, else on a worker thread,
        waited for at most ``deadline_s``; a miss on timeout or error (a counted fallback).
        Tiers of a daemon's chunks are named ``"remote:<tier>"``."""
        t0 = time.perf_counter()
        try:
            hit = self._lookup(query, inline=True) if self._inline else None
            if hit is None:
                # wait() then result(): a store error that is itself a TimeoutError (the
                # daemon client's StoreUnavailable, a refused connection) is reported as what
                # it is, not as this deadline passing
                fut = self._pool.submit(self._lookup, query)
                if not wait([fut], timeout=self.deadline_s).done:
                    self.stats.fallback("lookup", "lookup timed out after %.3f s; recomputing",
                                        self.deadline_s)
                    hit = LookupHit.miss(query.num_tokens, query.num_local)
                else:
                    hit = fut.result()
                    self.stats.recovered("lookup")
            else:
                self.stats.recovered("lookup")
        except Exception as exc:  # noqa: BLE001 - any store trouble means a miss
            self.stats.fallback("lookup", "lookup failed (%s: %s); recomputing",
                                type(exc).__name__, exc)
            hit = LookupHit.miss(query.num_tokens, query.num_local)
        self.stats.observe("lookup", time.perf_counter() - t0)
        if self._remote:
            hit = dataclasses.replace(hit, tiers={k: f"remote:{t}" for k, t in hit.tiers.items()})
        return hit

    def _lookup(self, q: LookupQuery, inline: bool = False) -> LookupHit | None:
        """The leading stored full chunks of ``q.keys``, then the stored tail pieces of
        ``q.tail_range`` after them. ``inline``: only what the store answers at once
        (``try_lookup_keys``); None when it would wait (ask again on a worker thread)."""
        look = self.store.try_lookup_keys if inline else self.store.lookup_keys
        full = look(self.ns, list(q.keys)) if q.keys else _NO_HIT
        if full is None:
            return None
        rng = q.tail_range(full.num_hit_chunks)
        tail = look(self.tail_ns, list(q.tail_keys[rng.start:rng.stop])) if rng else _NO_HIT
        if tail is None:
            return None
        return q.hit(full.num_hit_chunks, full.tiers, tail.num_hit_chunks, tail.tiers)

"""Prometheus metrics of one store, in a registry of its own (not the global default), so
several stores in one process (tests, a daemon with two stores) never collide.

Names follow the Prometheus guide (base units, ``_total`` on counters) and keep LMCache/vLLM
stems where one exists (``requested_tokens``, ``hit_tokens``). Tier labels are tier names; no
keys or request ids in labels; each tier's labelled counters are exported at 0 from the
start (``bind_tier``, ``add_tier``). ``snapshot()`` returns the same counts as a plain dict for
``ChunkStore.stats()``.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
#: store calls timed in ``kvstore_op_latency_seconds{op}`` (exported at 0 from the start)
OPS = ("lookup", "get", "put")

#: counter name -> (help, labelled by tier)
_COUNTERS = {
    "lookups": ("Lookups (prefix probes) served", False),
    "requested_tokens": ("Tokens of full chunks asked about by lookups", False),
    "hit_tokens": ("Leading tokens found by lookups", False),
    "hits": ("Chunks returned by get, by the tier that served them", True),
    "misses": ("Chunks asked by get and not returned (absent, evicted or corrupt)", False),
    "stored_chunks": ("Chunks newly stored by put in a local tier (gpu, cpu, disk)", False),
    "evictions": ("Chunks evicted from a tier, by that tier (also when a lower tier keeps a "
                  "copy: a spilled or promoted chunk)", True),
    "dropped_chunks": ("Chunks evicted out of every local tier (gpu, cpu, disk): none holds "
                       "them any more, a remote (Redis) copy may (each counted once, whatever "
                       "the tiers it left)", False),
    "removed_chunks": ("Chunks removed by remove or clear from a local tier (those pinned then "
                       "leave at their last unpin; remote copies not counted)", False),
    "spills": ("Evicted chunks copied to the next slower tier, by the tier they left", True),
    "promotions": ("Chunks copied to the top tier on a hit, by the tier they came from", True),
    "admission_refusals": ("Chunks the admission filter kept out of a full tier (a put, a "
                           "promotion or a spill), by that tier", True),
    "demoted_chunks": ("Stored chunks demoted to first eviction candidates (tail pieces "
                       "whose full chunk is stored), counted once per demote call", False),
    "corruptions": ("Stored chunks that failed a check on read or open (served as misses)", True),
    "dropped_writes": ("Disk writes dropped (lmdb's map full with nothing evictable, or the "
                       "write failed: a full disk, an I/O error)", True),
    "stranded_removals": ("Stored chunks removed because an ancestor was lost by its tier (a "
                          "dropped disk write, a corrupt chunk): no lookup could reach them",
                          False),
    "errors": ("Internal errors survived (eviction policy failures, writer failures)", True),
    "rejected_chunks": ("Chunks not stored: no tier could take them (all pinned, too large, or "
                        "room only by evicting their own prefix) or their parent chunk is "
                        "stored nowhere", False),
    "namespace_evictions": ("Namespaces the store stopped tracking (max_namespaces reached; "
                            "least recently used first)", False),
    "stale_index_entries": ("Indexed chunks a read could not serve (value missing, corrupt or "
                            "of the wrong shape), dropped from the index", True),
}

_TIER_COUNTERS = tuple(name for name, (_, by_tier) in _COUNTERS.items() if by_tier)


class StoreMetrics:
    """Counters, tier gauges and latency histograms of one ``ChunkStore``.

    Attributes:
        registry: the ``CollectorRegistry`` holding every metric of this store.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = defaultdict(int)
        self._counters = {
            name: Counter(f"kvstore_{name}_total", help_, ["tier"] if by_tier else [],
                          registry=self.registry)
            for name, (help_, by_tier) in _COUNTERS.items()
        }
        self._children: dict = {}
        self.used_bytes = Gauge("kvstore_used_bytes", "Bytes used by stored chunks", ["tier"],
                                registry=self.registry)
        self.capacity_bytes = Gauge("kvstore_capacity_bytes", "Tier capacity in bytes", ["tier"],
                                    registry=self.registry)
        self.chunks = Gauge("kvstore_chunks", "Chunks stored in a tier", ["tier"], registry=self.registry)
        self.latency = Histogram("kvstore_op_latency_seconds", "Store call latency by operation",
                                 ["op"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        for op in OPS:
            self.latency.labels(op=op)

    def inc(self, name: str, n: int = 1, tier: str | None = None) -> None:
        """Add ``n`` to counter ``name`` (per ``tier`` where the counter has that label).

        Raises:
            KeyError: unknown counter name.
        """
        if n <= 0:
            return
        c = self._children.get((name, tier))
        if c is None:  # (a labelled child is looked up once: labels() costs microseconds)
            c = self._counters[name]
            c = self._children[(name, tier)] = c.labels(tier=tier) if tier is not None else c
        c.inc(n)
        with self._lock:
            self._counts[name] += n
            if tier is not None:
                self._counts[f"{name}:{tier}"] += n

    def observe(self, op: str, seconds: float) -> None:
        self.latency.labels(op=op).observe(seconds)

    def bind_store(self, resident: Callable[[], float], unreachable: Callable[[], float],
                   pinned: Callable[[], float], namespaces: Callable[[], float]) -> None:
        """Store-wide gauges (callables read at scrape time): ``kvstore_resident_chunks``
        (distinct chunks some local tier holds, removed-while-pinned ones not counted; the
        remote tier's copies are not counted),
        ``kvstore_unreachable_bytes``, ``kvstore_pinned_chunks``, ``kvstore_namespaces``.
        With no tier losing chunks on its own (no corruptions, stale index entries, dropped
        disk writes) and nothing found on disk at open, ``stored_chunks_total`` (plus, with
        a remote tier, ``promotions_total{tier="remote"}``: chunks copied from Redis into the
        top tier, stored by no put here) equals ``resident_chunks + dropped_chunks_total +
        removed_chunks_total + stranded_removals_total``."""
        for name, help_, fn in (
                ("resident_chunks", "Distinct chunks held by at least one local tier (gpu, "
                                    "cpu, disk; remote copies not counted)", resident),
                ("unreachable_bytes", "Bytes of stored chunks no prefix lookup can reach (an "
                                      "ancestor is stored nowhere)", unreachable),
                ("pinned_chunks", "Chunks pinned (by readers or explicit pins)", pinned),
                ("namespaces", "Namespaces the store tracks (named by a request since start)",
                 namespaces)):
            Gauge(f"kvstore_{name}", help_, registry=self.registry).set_function(fn)

    def bind_tier(self, name: str, used: Callable[[], float], capacity: Callable[[], float],
                  chunks: Callable[[], float]) -> None:
        """Gauges of tier ``name`` (bytes used, capacity in bytes, chunk count: callables read
        at scrape time), and every tier-labelled counter of that tier exported at 0 (see
        ``add_tier``)."""
        self.used_bytes.labels(tier=name).set_function(used)
        self.capacity_bytes.labels(tier=name).set_function(capacity)
        self.chunks.labels(tier=name).set_function(chunks)
        self.add_tier(name)

    def add_tier(self, name: str, counters: tuple[str, ...] | None = None) -> None:
        """Export counters ``counters`` (all tier-labelled ones when None) of tier ``name`` at 0
        now, so that their series exist before the first event (``rate()`` and alerts on them
        work from the first scrape). Counts already there are kept.

        Raises:
            KeyError: an unknown counter name.
            ValueError: a counter without the tier label.
        """
        for counter in _TIER_COUNTERS if counters is None else counters:
            if not _COUNTERS[counter][1]:
                raise ValueError(f"counter {counter!r} has no tier label")
            if (counter, name) not in self._children:
                self._children[(counter, name)] = self._counters[counter].labels(tier=name)

    def count(self, name: str, tier: str | None = None) -> int:
        """Current value of a counter (summed over tiers when ``tier`` is None)."""
        with self._lock:
            return self._counts.get(name if tier is None else f"{name}:{tier}", 0)

    def snapshot(self) -> dict:
        """``{counter: total}`` plus ``{counter}_by_tier: {tier: n}`` for tier counters."""
        with self._lock:
            counts = dict(self._counts)
        out: dict = {}
        for name, (_, by_tier) in _COUNTERS.items():
            out[name] = counts.get(name, 0)
            if by_tier:
                out[f"{name}_by_tier"] = {k.split(":", 1)[1]: v for k, v in counts.items()
                                          if k.startswith(name + ":")}
        return out

    def exposition(self) -> bytes:
        """Prometheus text format of this store's metrics."""
        return generate_latest(self.registry)


def tier_codec_info(registry: CollectorRegistry, codecs: dict[str, str]) -> Gauge:
    """Register ``kvstore_tier_codec_info{tier, codec}`` in ``registry``: one series at 1 per
    lower tier of ``codecs`` (``StoreConfig.tier_codecs``: ``{"disk": "kivi"}``), an info-style
    gauge to join on (``* on(tier) group_left(codec)``); no series without lower tiers.

    Raises:
        ValueError: the metric is already registered in ``registry``.
    """
    info = Gauge("kvstore_tier_codec_info", "Value codec of a lower tier (a lossy one applies "
                 "only to namespaces whose lossy_codec names it); always 1",
                 ["tier", "codec"], registry=registry)
    for tier, codec in codecs.items():
        info.labels(tier=tier, codec=codec).set(1)
    return info

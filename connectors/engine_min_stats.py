"""Counters of ``connectors.engine_min.EngineMinConnector``, shared by its scheduler side and
its loader: cumulative token / chunk / byte counts, tokens hit per tier, latencies, fallbacks,
and warnings. Thread-safe (the lookup and load workers and the save writer count here too).

Warnings (``ConnectorStats.warn``, ``kvstore.cause_log.CauseLog``) are logged once per kind
of operation *and cause*: the cause is the error's class, its HTTP status when it has one and
the first characters of its message with numbers left out, so a store that first refuses
connections and later answers 400 logs both. After the operation succeeds again
(``ConnectorStats.recovered``) a cause is logged anew when it comes back, at most once per
``relog_interval_s`` per operation. A call
a daemon's circuit breaker skipped (``RemoteSkipped``) is counted, not logged: the breaker
logged the failure that opened it.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import threading
from typing import Sequence

from kvstore.cause_log import CauseLog
from kvstore.layered import RemoteSkipped

log = logging.getLogger("connectors.engine_min")

#: counter names, in the order ``get_stats`` reports them (as ``kvstore_<name>``)
COUNTERS = ("requests", "queried_tokens", "hit_tokens", "loaded_tokens", "loaded_chunks",
            "loaded_bytes", "saved_chunks", "saved_bytes", "queued_chunks",
            "dropped_save_chunks", "save_errors", "fallbacks", "lookup_fallbacks",
            "load_fallbacks", "load_failed_tokens", "loaded_tail_chunks", "saved_tail_chunks",
            "demoted_tail_chunks", "demote_errors", "refused_chunks")


#: upper bounds (seconds) of the latency histograms' buckets: a same-host lookup (well under
#: 1 ms) to a load or save that waited seconds for a slow store
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)


class Latency:
    """count / sum / max of durations in seconds, and their histogram over
    ``LATENCY_BUCKETS_S`` (a duration counts in the first bucket whose bound is >= it; one
    above all bounds only in ``count``, Prometheus' ``+Inf`` bucket)."""

    def __init__(self) -> None:
        self.count, self.sum, self.max = 0, 0.0, 0.0
        self.buckets = [0] * len(LATENCY_BUCKETS_S)   # (not cumulative)

    def add(self, s: float) -> None:
        """One duration of ``s`` seconds."""
        self.count += 1
        self.sum += s
        self.max = max(self.max, s)
        i = bisect.bisect_left(LATENCY_BUCKETS_S, s)
        if i < len(self.buckets):
            self.buckets[i] += 1

    def as_dict(self, prefix: str) -> dict:
        """``{prefix}_count``, ``{prefix}_seconds_sum``, ``{prefix}_seconds_max`` and
        ``{prefix}_seconds_bucket``: ``{upper bound in s: durations <= it}`` (cumulative, as
        Prometheus' ``le`` buckets; ``+Inf`` left out: it is ``count``)."""
        cumulative = dict(zip(LATENCY_BUCKETS_S, itertools.accumulate(self.buckets)))
        return {f"{prefix}_count": self.count, f"{prefix}_seconds_sum": self.sum,
                f"{prefix}_seconds_max": self.max, f"{prefix}_seconds_bucket": cumulative}


class ConnectorStats(CauseLog):
    """The counters (``c``: name -> int), tokens hit per tier, and the lookup / load / save
    latencies of one connector; its warnings per kind and cause (``CauseLog``:
    ``relog_interval_s``, ``max_causes``, ``recovered``).

    Args:
        tiers: tier names counted at 0 from the start
            (``connectors.engine_min_lookup.hit_tier_names``), so each tier's series exists
            before its first hit; another name is added at its first hit.
    """

    def __init__(self, tiers: Sequence[str] = ()) -> None:
        super().__init__(log, "kv connector: %s works again (%d failures since it last "
                              "worked)")
        self.lock = threading.Lock()
        self.c: dict[str, int] = {k: 0 for k in COUNTERS}
        self.hits_by_tier: dict[str, int] = dict.fromkeys(tiers, 0)
        self.lat = {k: Latency() for k in ("lookup", "load", "save")}

    def add(self, hits_by_tier: dict[str, int] | None = None, **counts: int) -> None:
        """Add to counters by name, and to the tokens hit per tier they came from."""
        with self.lock:
            for k, v in counts.items():
                self.c[k] += v
            for t, v in (hits_by_tier or {}).items():
                self.hits_by_tier[t] = self.hits_by_tier.get(t, 0) + v

    def observe(self, kind: str, seconds: float) -> None:
        """One ``kind`` (lookup, load, save) took ``seconds``."""
        with self.lock:
            self.lat[kind].add(seconds)

    def warn(self, kind: str, msg: str, *args, cause: BaseException | None = None) -> bool:
        """Log ``msg % args`` at WARNING unless this ``kind`` already logged the same cause
        and has not recovered since (module docstring; ``kvstore.cause_log.CauseLog.warn``).
        ``cause``: the error (default: the first exception in ``args``); a ``RemoteSkipped``
        is counted, not logged. Returns whether it logged."""
        if cause is None:
            cause = next((a for a in args if isinstance(a, BaseException)), None)
        if isinstance(cause, RemoteSkipped):   # the breaker logged why it is open
            self.failed(kind)
            return False
        return super().warn(kind, msg, *args, cause=cause)

    def fallback(self, kind: str, msg: str, *args) -> None:
        """A ``kind`` (lookup, load) fell back to recomputing: count it, warn once."""
        with self.lock:
            self.c["fallbacks"] += 1
            self.c[f"{kind}_fallbacks"] += 1
        self.warn(kind, "kv connector: " + msg, *args)

    def snapshot(self) -> dict:
        """The counters as ``get_stats`` reports them (``kvstore_``-prefixed, latencies as
        ``kvstore_<kind>_count`` / ``_seconds_sum`` / ``_seconds_max`` / ``_seconds_bucket``,
        see ``Latency.as_dict``), plus
        ``external_prefix_cache_queries`` / ``_hits`` and ``kvstore_hit_tokens_by_tier``."""
        with self.lock:
            c = dict(self.c)
            tiers = dict(self.hits_by_tier)
            lat = {k: v.as_dict(f"kvstore_{k}") for k, v in self.lat.items()}
        out = {"external_prefix_cache_queries": c["queried_tokens"],
               "external_prefix_cache_hits": c["hit_tokens"],
               "kvstore_hit_tokens_by_tier": tiers}
        out.update({f"kvstore_{k}": v for k, v in c.items()})
        for d in lat.values():
            out.update(d)
        return out


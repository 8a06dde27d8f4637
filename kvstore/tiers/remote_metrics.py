"""Prometheus metrics of the remote tier (``kvstore_remote_*``), in the store's registry.

Counters count chunks (or bytes), not commands; latency histograms are per call (one call is
one pipeline per node, sent at once). Labels: ``reason`` (a short fixed word), ``node``
(``host:port`` of a Redis master: bounded by the cluster's size), ``op``.
"""
from __future__ import annotations

import threading
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.tiers.breaker import STATE_VALUE

LATENCY_BUCKETS_S = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)

#: label values known in advance (exported at 0 from the start)
REASONS = {"validation_failures": ("header", "version", "truncated", "key", "layout", "checksum"),
           "dropped_writes": ("queue_full", "full", "unavailable", "error", "closed"),
           "late": ("lookup", "get")}
#: name -> (help, label or None)
_COUNTERS = {
    "lookups": ("Chunks probed in Redis by lookups (EXISTS)", None),
    "lookup_hits": ("Chunks a lookup found in Redis", None),
    "reads": ("Chunks asked of Redis by gets", None),
    "hits": ("Chunks read from Redis and validated", None),
    "misses": ("Chunks asked of Redis and not served (absent, failed node, invalid)", None),
    "read_bytes": ("Bytes of values read from Redis", None),
    "writes": ("Chunks written to Redis", None),
    "written_bytes": ("Bytes of values written to Redis", None),
    "validation_failures": ("Values that failed a check on read (deleted, served as misses)",
                            "reason"),
    "dropped_writes": ("Writes not done: queue_full, full (Redis maxmemory), unavailable "
                       "(node down or its breaker open), error, closed (queued at close)",
                       "reason"),
    "late": ("Chunks a lookup or get missed because their node had not answered by the call's "
             "deadline (a slow network or Redis; decoding is not charged to the deadline)", "op"),
    "deleted": ("Values deleted (remove, clear, invalid values)", None),
    "breaker_opens": ("Times a node's circuit breaker opened", "node"),
    "node_restarts": ("Restarts of a node noticed (a new run_id)", "node"),
    "republished": ("Chunks held locally queued to be written to Redis again after a node "
                    "restarted without them (a write then refused counts in dropped_writes)",
                    None),
}


class RemoteMetrics:
    """Counters, gauges and histograms of one remote tier.

    Args:
        registry: where the metrics live (the store's ``StoreMetrics.registry``; a new one
            when None).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = defaultdict(int)
        self._counters = {
            name: Counter(f"kvstore_remote_{name}_total", help_, [label] if label else [],
                          registry=self.registry)
            for name, (help_, label) in _COUNTERS.items()}
        self.breaker_state = Gauge("kvstore_remote_breaker_state",
                                   "Circuit breaker of a node: 0 closed, 1 open, 2 half-open",
                                   ["node"], registry=self.registry)
        self.queue_bytes = Gauge("kvstore_remote_queue_bytes",
                                 "Bytes of chunks waiting to be written to Redis",
                                 registry=self.registry)
        self.latency = Histogram("kvstore_remote_latency_seconds",
                                 "Remote tier call latency (all nodes of a call) by operation",
                                 ["op"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        for name, reasons in REASONS.items():
            for reason in reasons:
                self._counters[name].labels(reason)
        for op in ("lookup", "get", "put"):
            self.latency.labels(op=op)

    def add_node(self, node: str) -> None:
        """Export a master's breaker series (state 0, closed; no opens) before any change."""
        self.breaker_state.labels(node=node).set(STATE_VALUE["closed"])
        self._counters["breaker_opens"].labels(node)
        self._counters["node_restarts"].labels(node)

    def inc(self, name: str, n: int = 1, label: str | None = None) -> None:
        """Add ``n`` to counter ``name`` (with its label value when it has one).

        Raises:
            KeyError: unknown counter.
        """
        if n <= 0:
            return
        c = self._counters[name]
        (c.labels(label) if label is not None else c).inc(n)
        with self._lock:
            self._counts[name] += n
            if label is not None:
                self._counts[f"{name}:{label}"] += n

    def observe(self, op: str, seconds: float) -> None:
        self.latency.labels(op=op).observe(seconds)

    def breaker(self, node: str, state: str) -> None:
        """A node's breaker changed state."""
        self.breaker_state.labels(node=node).set(STATE_VALUE[state])
        if state == "open":
            self.inc("breaker_opens", label=node)

    def count(self, name: str, label: str | None = None) -> int:
        """Current value of a counter (summed over labels when ``label`` is None)."""
        with self._lock:
            return self._counts.get(name if label is None else f"{name}:{label}", 0)

    def snapshot(self) -> dict:
        """``{counter: total}`` plus ``{counter}_by_{label}: {value: n}`` for labelled ones."""
        with self._lock:
            counts = dict(self._counts)
        out: dict = {}
        for name, (_, label) in _COUNTERS.items():
            out[name] = counts.get(name, 0)
            if label:
                out[f"{name}_by_{label}"] = {k.split(":", 1)[1]: v for k, v in counts.items()
                                             if k.startswith(name + ":")}
        return out

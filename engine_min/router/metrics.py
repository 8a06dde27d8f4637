"""Prometheus metrics of the router, on its own ``CollectorRegistry``.

Series (``GET /metrics``; ``engine`` is the engine's base URL as given to ``--engines``; an
engine's series, each reason, store lookup result and failure code exist at 0 from the
start):
    router_requests_total{engine,reason}         counter; reason: hit | load | round_robin | retry
                                                 (retry: sent there after another engine failed)
    router_predicted_hit_tokens_total{engine}    counter, prompt tokens the index said the
                                                 engine held when it was picked
    router_reported_cached_tokens_total{engine}  counter, ``usage.prompt_tokens_details.
                                                 cached_tokens`` the engine then reported
                                                 (non-stream answers; streams with
                                                 ``stream_options.include_usage``)
    router_overhead_seconds                      histogram, request received -> upstream request
                                                 sent (read, parse, tokenize, hash, score)
    router_engine_healthy{engine}                gauge, 1 healthy, 0 taken out
    router_index_blocks{engine}                  gauge, block hashes in the engine's index
    router_stale_connection_retries_total{engine} counter, requests sent again on a fresh
                                                 connection after the engine closed their
                                                 pooled one before answering
    router_store_lookups_total{result}           counter, store lookups (``--kvstore-url``):
                                                 ok | timeout (past the deadline, skipped) |
                                                 error (skipped) | skipped (could not change
                                                 the pick: not asked)
    router_store_lookup_seconds                  histogram, how long a request waited for
                                                 its store lookup (lookups made: ok, timeout,
                                                 error); part of router_overhead_seconds
    router_store_hit_tokens_total                counter, prompt tokens the store held, in the
                                                 picked engine's namespace
    router_failed_requests_total                 counter, requests the router could not
                                                 complete: every cause below
    router_failed_requests_by_code_total{code}   counter, the same by the error code the client
                                                 got: no_healthy_engine (none left) |
                                                 engine_failed (an engine failed after bytes
                                                 went to the client) | server_shutting_down
                                                 (still in flight when the router's shutdown
                                                 timeout ran out: a stream ended, or a 503)
    router_client_gone_total                     counter, answers (streamed or whole) ended
                                                 because the client closed its connection as
                                                 the router wrote to it (not failures: the
                                                 engine stays in service, nothing is retried)

predicted / reported over the same requests is the index's accuracy.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from engine_min.router.policy import HIT, LOAD, RETRY, ROUND_ROBIN

#: why a request went to an engine (``router_requests_total{reason}``)
REQUEST_REASONS = (HIT, LOAD, ROUND_ROBIN, RETRY)

#: how a lookup in the shared store ended (``router_store_lookups_total{result}``)
STORE_LOOKUP_RESULTS = ("ok", "timeout", "error", "skipped")

#: the error codes a failed request's client gets (``router_failed_requests_by_code_total``)
FAILURE_CODES = ("no_healthy_engine", "engine_failed", "server_shutting_down")
OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1.0)


class RouterMetrics:
    """The router's series (see the module docstring) on a private registry."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("router_requests", "Requests sent to an engine, by reason",
                                ["engine", "reason"], registry=r)
        self.predicted_hit_tokens = Counter(
            "router_predicted_hit_tokens", "Prompt tokens the index predicted the picked "
            "engine held", ["engine"], registry=r)
        self.reported_cached_tokens = Counter(
            "router_reported_cached_tokens", "Cached prompt tokens the engine reported in usage",
            ["engine"], registry=r)
        self.overhead = Histogram("router_overhead_seconds", "Request received -> upstream "
                                  "request sent", buckets=OVERHEAD_BUCKETS_S, registry=r)
        self.engine_healthy = Gauge("router_engine_healthy", "1 if the engine is in service",
                                    ["engine"], registry=r)
        self.index_blocks = Gauge("router_index_blocks", "Block hashes in the engine's index",
                                  ["engine"], registry=r)
        self.stale_connection_retries = Counter(
            "router_stale_connection_retries", "Requests sent again to the same engine on a "
            "fresh connection after it closed the pooled one", ["engine"], registry=r)
        self.store_lookups = Counter("router_store_lookups", "Lookups of the prompt in the "
                                     "shared kvstore daemon, by result", ["result"], registry=r)
        for result in STORE_LOOKUP_RESULTS:
            self.store_lookups.labels(result)
        self.store_lookup_time = Histogram(
            "router_store_lookup_seconds", "Time a request waited for its store lookup "
            "(lookups made)", buckets=OVERHEAD_BUCKETS_S, registry=r)
        self.store_hit_tokens = Counter("router_store_hit_tokens", "Prompt tokens the shared "
                                        "store held (picked engine's namespace)", registry=r)
        self.failed_requests = Counter("router_failed_requests", "Requests the router could "
                                       "not complete", registry=r)
        self.failed_by_code = Counter("router_failed_requests_by_code", "Requests the router "
                                      "could not complete, by the error code the client got",
                                      ["code"], registry=r)
        for code in FAILURE_CODES:
            self.failed_by_code.labels(code)
        self.client_gone = Counter("router_client_gone", "Answers ended because the client "
                                   "closed its connection as the router wrote to it",
                                   registry=r)

    def failed(self, code: str) -> None:
        """Count a request the router could not complete; ``code`` is the error code the
        client got, one of ``FAILURE_CODES``.

        Raises:
            ValueError: another code.
        """
        if code not in FAILURE_CODES:
            raise ValueError(f"unknown failure code {code!r} (expected one of "
                             f"{', '.join(FAILURE_CODES)})")
        self.failed_requests.inc()
        self.failed_by_code.labels(code).inc()

    def add_engine(self, engine: str) -> None:
        """Create the engine's series at 0 (``router_requests_total`` for each of
        ``REQUEST_REASONS``), so they show before its first request."""
        for reason in REQUEST_REASONS:
            self.requests.labels(engine, reason)
        self.engine_healthy.labels(engine).set(0)
        self.index_blocks.labels(engine).set(0)
        self.predicted_hit_tokens.labels(engine)
        self.reported_cached_tokens.labels(engine)
        self.stale_connection_retries.labels(engine)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

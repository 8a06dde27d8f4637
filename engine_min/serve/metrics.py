"""Prometheus metrics of the OpenAI-compatible server, with vLLM's stems under ``engine_``.

One ``ServerMetrics`` per app, on its own ``CollectorRegistry`` (two servers in one process
never share series). Latencies are in seconds, measured by the engine thread at the moment a
step's output is handed to the request (arrival -> first token for TTFT, token -> token for
ITL). Engine-side figures (running/waiting requests, KV pool usage, prefix cache queries and
hits of the engine and of the external store) are copied from ``LLMEngine.stats()`` after each
step by ``update_from_stats``; cumulative stats become counters by adding their increase.

Series (``/metrics``):
    engine_time_to_first_token_seconds        histogram
    engine_inter_token_latency_seconds        histogram
    engine_e2e_request_latency_seconds        histogram
    engine_request_success_total{finished_reason}  counter; stop | length | abort | error,
                                              each at 0 from the start
    engine_prompt_tokens_total                counter
    engine_generation_tokens_total            counter
    engine_num_requests_running               gauge
    engine_num_requests_waiting               gauge
    engine_kv_cache_usage_perc                gauge, fraction of the KV pool in use (0..1)
    engine_prefix_cache_queries_total         counter, tokens looked up in the engine's cache
    engine_prefix_cache_hits_total            counter, tokens found there
    engine_external_prefix_cache_queries_total  counter, tokens looked up in the KV store
    engine_external_prefix_cache_hits_total     counter, tokens found there

and the KV connector's own figures (every ``kvstore_*`` key of ``LLMEngine.stats()``, see
``connectors.engine_min.EngineMinConnector.get_stats``), named ``engine_`` + the key:
    engine_kvstore_<count>_total              counter per cumulative count: requests,
                                              queried/hit/loaded tokens, loaded/saved chunks
                                              and bytes, fallbacks (lookup/load), dropped
                                              saves, save errors, remote skipped calls, ...
    engine_kvstore_hit_tokens_by_tier_total{tier}  counter, hit tokens by the tier that held them;
                                              every tier the store can name at 0 from the
                                              start (``connectors.engine_min_lookup.
                                              hit_tier_names``: a daemon's as ``remote:<tier>``)
    engine_kvstore_{lookup,load,save}_seconds histogram (``_bucket{le}``, ``_sum``, ``_count``)
                                              of the connector's calls, buckets 0.5 ms .. 10 s
                                              (``connectors.engine_min_stats.LATENCY_BUCKETS_S``)
    engine_kvstore_{lookup,load,save}_seconds_max, engine_kvstore_save_queue_bytes,
    engine_kvstore_remote_breaker_open        gauges

A connector whose stats give a latency's ``_seconds_sum`` and ``_count`` without its
``_seconds_bucket`` gets the counters ``engine_kvstore_<kind>_seconds_total`` and
``_count_total`` instead of the histogram.
"""
from __future__ import annotations

import threading
from typing import Mapping

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# vLLM's buckets for the same series.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

#: why a request finished (``engine_request_success_total{finished_reason}``)
FINISH_REASONS = ("stop", "length", "abort", "error")

# engine stats key -> counter attribute; the stat is cumulative since engine start.
_CUMULATIVE_STATS = {
    "prefix_cache_queries_tokens": "prefix_cache_queries",
    "prefix_cache_hits_tokens": "prefix_cache_hits",
    "external_prefix_cache_queries": "external_prefix_cache_queries",
    "external_prefix_cache_hits": "external_prefix_cache_hits",
}

# connector stats that are levels, not counts
_GAUGE_STATS = frozenset({"kvstore_save_queue_bytes", "kvstore_remote_breaker_open"})


def _increase(last: float, value: float) -> float:
    """Increase of a cumulative count from ``last`` to ``value``; a value below ``last`` means
    the count restarted from 0 (a new engine or connector), so all of it is new (as
    Prometheus' ``rate()`` reads a counter reset)."""
    return value - last if value >= last else value


class _MirroredHistograms:
    """Histograms copied from cumulative bucket counts reported by the connector (its stats
    hold ``{upper bound: count}``, not observations), kept monotonic as counters are: a
    count that went down (a new connector) is added whole. A collector: its families show
    from the first ``update`` of each name."""

    def __init__(self) -> None:
        self._acc: dict[str, tuple[dict[float, float], float, float]] = {}
        self._last: dict[str, tuple[dict[float, float], float, float]] = {}
        self._help: dict[str, str] = {}

    def update(self, name: str, help_: str, buckets: Mapping, total: float,
               count: float) -> None:
        """The connector's latest cumulative ``buckets`` (``{upper bound s: count}``, +Inf
        left out), ``total`` (sum of seconds) and ``count`` of histogram ``name``.

        Raises:
            ValueError: a bucket bound that is not a number.
        """
        now = ({float(b): float(n) for b, n in buckets.items()}, float(total), float(count))
        last = self._last.get(name, ({}, 0.0, 0.0))
        restarted = now[2] < last[2]
        acc_b, acc_sum, acc_count = self._acc.get(name, ({}, 0.0, 0.0))
        acc_b = dict(acc_b)
        for b, n in now[0].items():
            acc_b[b] = acc_b.get(b, 0.0) + (n if restarted else max(n - last[0].get(b, 0.0), 0.0))
        acc_sum += now[1] if restarted else max(now[1] - last[1], 0.0)
        acc_count += now[2] if restarted else now[2] - last[2]
        self._help[name] = help_  # (before _acc: a scrape reads both)
        self._last[name] = now
        self._acc[name] = (acc_b, acc_sum, acc_count)

    def collect(self):
        for name, (acc_b, acc_sum, acc_count) in list(self._acc.items()):
            buckets = [(floatToGoString(b), n) for b, n in sorted(acc_b.items())]
            buckets.append(("+Inf", acc_count))
            yield HistogramMetricFamily(name, self._help[name], buckets=buckets,
                                        sum_value=acc_sum)


class ServerMetrics:
    """The server's metric series on a private registry. Thread-safe.

    Attributes:
        registry: the ``CollectorRegistry`` that ``/metrics`` renders.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("engine_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("engine_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request.",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("engine_e2e_request_latency_seconds",
                             "Time from request arrival to its last token.",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.request_success = Counter("engine_request_success",
                                       "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        self.prompt_tokens = Counter("engine_prompt_tokens", "Prefill tokens of requests.",
                                     registry=r)
        self.generation_tokens = Counter("engine_generation_tokens",
                                         "Generated tokens.", registry=r)
        self.num_running = Gauge("engine_num_requests_running",
                                 "Requests in the running batch.", registry=r)
        self.num_waiting = Gauge("engine_num_requests_waiting",
                                 "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("engine_kv_cache_usage_perc",
                              "Fraction of the KV block pool in use (1 = full).", registry=r)
        self.prefix_cache_queries = Counter(
            "engine_prefix_cache_queries", "Prompt tokens looked up in the engine's prefix "
            "cache.", registry=r)
        self.prefix_cache_hits = Counter(
            "engine_prefix_cache_hits", "Prompt tokens found in the engine's prefix cache.",
            registry=r)
        self.external_prefix_cache_queries = Counter(
            "engine_external_prefix_cache_queries", "Prompt tokens looked up in the external "
            "KV store.", registry=r)
        self.external_prefix_cache_hits = Counter(
            "engine_external_prefix_cache_hits", "Prompt tokens found in the external KV "
            "store.", registry=r)
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._kv_series: dict[str, Counter | Gauge] = {}
        self._kv_histograms = _MirroredHistograms()
        r.register(self._kv_histograms)

    def update_from_stats(self, stats: Mapping[str, float]) -> None:
        """Copy an ``LLMEngine.stats()`` snapshot into the gauges and cumulative counters.

        Keys read (missing keys are skipped): ``num_running``, ``num_waiting``, ``kv_usage``
        (fraction 0..1), and the cumulative token counts ``prefix_cache_queries_tokens``,
        ``prefix_cache_hits_tokens`` (the engine's) and ``external_prefix_cache_queries``,
        ``external_prefix_cache_hits`` (the store's, merged in by the server). A cumulative
        value that went down (engine or connector restarted, counting from 0 again) is added
        whole and becomes the new baseline.
        """
        if "num_running" in stats:
            self.num_running.set(stats["num_running"])
        if "num_waiting" in stats:
            self.num_waiting.set(stats["num_waiting"])
        if "kv_usage" in stats:
            self.kv_usage.set(stats["kv_usage"])
        with self._lock:
            for key, attr in _CUMULATIVE_STATS.items():
                if key not in stats:
                    continue
                value = float(stats[key])
                inc = _increase(self._last.get(key, 0.0), value)
                if inc > 0:
                    getattr(self, attr).inc(inc)
                self._last[key] = value
            mirrored = set()
            for key, value in stats.items():  # latency histograms (with their sum and count)
                if key.startswith("kvstore_") and key.endswith("_seconds_bucket") \
                        and isinstance(value, Mapping):
                    kind = key[len("kvstore_"):-len("_seconds_bucket")]
                    sum_key, count_key = f"kvstore_{kind}_seconds_sum", f"kvstore_{kind}_count"
                    if sum_key in stats and count_key in stats:
                        self._kv_histograms.update(
                            f"engine_kvstore_{kind}_seconds", f"KV connector: {kind} latency "
                            "(see connectors.engine_min.EngineMinConnector.get_stats).", value,
                            stats[sum_key], stats[count_key])
                        mirrored.update((key, sum_key, count_key))
            for key, value in stats.items():
                if key.startswith("kvstore_") and key not in mirrored:
                    self._connector_stat(key, value)

    def _connector_stat(self, key: str, value) -> None:
        """Mirror one ``kvstore_*`` stat: gauges for levels (queue bytes, breaker state,
        maxima), labelled counter for per-tier hits, counters for every other count."""
        if isinstance(value, Mapping):  # {tier: hit tokens}
            series = self._series(key, Counter, ["tier"])
            for tier, v in value.items():
                self._add(series.labels(str(tier)), f"{key}:{tier}", float(v))
            return
        if isinstance(value, bool) or key in _GAUGE_STATS or key.endswith("_seconds_max"):
            self._series(key, Gauge).set(float(value))
        elif isinstance(value, (int, float)):
            self._add(self._series(key, Counter), key, float(value))

    def _series(self, key: str, kind, labels=()):
        series = self._kv_series.get(key)
        if series is None:
            name = key[:-len("_sum")] if key.endswith("_seconds_sum") else key  # -> _seconds_total
            series = kind("engine_" + name, f"KV connector: {key[len('kvstore_'):]} (see "
                          "connectors.engine_min.EngineMinConnector.get_stats).", list(labels),
                          registry=self.registry)
            self._kv_series[key] = series
        return series

    def _add(self, counter, last_key: str, value: float) -> None:
        inc = _increase(self._last.get(last_key, 0.0), value)
        if inc > 0:
            counter.inc(inc)
        self._last[last_key] = value

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

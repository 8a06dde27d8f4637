"""Figures of a routed run from the client's results and the processes' counter increases
(``bench.routing`` runs it; the fields are listed there), and the issue's speed targets.

Counters are Prometheus samples keyed as ``bench.metrics_scrape.sample_key`` writes them
(``name{label="v",...}``); a run's figures use their increases over the replay.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from bench import metrics_scrape
from bench.client import RequestResult


def histogram_quantile(samples: dict[str, float], name: str, q: float) -> float | None:
    """Quantile ``q`` (0..1) of a Prometheus histogram ``name`` from its ``name_bucket``
    samples (cumulative counts keyed by ``sample_key``, e.g. the increases over a run), with
    linear interpolation inside the bucket (as PromQL's ``histogram_quantile``; the first
    bucket starts at 0). ``None`` when the histogram counted nothing; the highest finite
    bound when the quantile falls in the ``+Inf`` bucket.

    Raises:
        ValueError: ``q`` outside [0, 1].
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    buckets = []
    for k, v in samples.items():
        if _name(k) == f"{name}_bucket":
            le = _label(k, "le")
            if le is not None:
                buckets.append((float(le), v))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > prev_count:
            if bound == float("inf"):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        if bound != float("inf"):
            prev_bound = bound
        prev_count = count
    return prev_bound


_name, _label, _sum = (metrics_scrape.series_name, metrics_scrape.label_value,
                       metrics_scrape.sum_series)


def labelled(samples: dict[str, float], name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label`` (``""`` where a sample lacks it)."""
    out: dict[str, float] = {}
    for k, v in samples.items():
        if _name(k) == name:
            key = _label(k, label) or ""
            out[key] = out.get(key, 0.0) + v
    return out


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def requests_per_engine(engines: Sequence[dict[str, float]], router: dict[str, float],
                        engine_urls: Sequence[str]) -> list[int]:
    """Requests each engine served over the run, in ``engine_urls`` order: the increase of its
    ``engine_request_success_total`` without ``finished_reason="abort"`` (an attempt the
    client or the router gave up, e.g. a request the router sent again elsewhere, is not a
    request served), or, for an engine whose increases lack that series, the router's
    ``router_requests_total{engine=URL}``."""
    by_router = labelled(router, "router_requests_total", "engine")
    out = []
    for url, d in zip(engine_urls, engines):
        served = sum(v for reason, v in labelled(d, "engine_request_success_total",
                                                 "finished_reason").items() if reason != "abort")
        if not served and not any(_name(k) == "engine_request_success_total" for k in d):
            served = sum(v for lab, v in by_router.items() if _same_url(lab, url))
        out.append(int(round(served)))
    return out


def routed_figures(results: Sequence[RequestResult], deltas: dict[str, dict[str, float]],
                   engine_urls: Sequence[str], store: bool, wall_s: float) -> dict:
    """The figures of one routed run (see the module docstring).

    Args:
        results: the client's results, one per request.
        deltas: counter increases over the replay per role: ``engine0``..``engineN-1`` (in
            ``engine_urls`` order), ``router``, and ``daemon`` with a store.
        engine_urls: the engines' base URLs, as given to the router.
        store: whether the engines had the shared store behind them.
        wall_s: first send to last completion, seconds.
    """
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    engines = [deltas.get(f"engine{i}", {}) for i in range(len(engine_urls))]
    router = deltas.get("router", {})
    q = sum(_sum(d, "engine_prefix_cache_queries_total") for d in engines)
    h = sum(_sum(d, "engine_prefix_cache_hits_total") for d in engines)
    sh = sum(_sum(d, "engine_external_prefix_cache_hits_total") for d in engines)
    count = router.get("router_overhead_seconds_count", 0.0)
    total = router.get("router_overhead_seconds_sum", 0.0)
    p50 = histogram_quantile(router, "router_overhead_seconds", 0.5)
    summary = metrics_scrape.summarize({**{f"engine{i}": d for i, d in enumerate(engines)},
                                        **({"daemon": deltas["daemon"]}
                                           if "daemon" in deltas else {})})
    return {
        "store": store,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p95_s": float(np.percentile(ttft, 95)) if ttft else None,
        "engine_hit_rate": h / q if q else None,
        "requests_per_engine": requests_per_engine(engines, router, engine_urls),
        "store_hit_rate": sh / q if q else None,
        "router_overhead_ms": 1000.0 * total / count if count else None,
        "router_overhead_p50_ms": 1000.0 * p50 if p50 is not None else None,
        "router_overhead_sum_s": total, "router_overhead_count": int(count),
        "routed_by_reason": {k: int(v) for k, v in sorted(
            labelled(router, "router_requests_total", "reason").items())},
        "predicted_hit_tokens": int(_sum(
            router, "router_predicted_hit_tokens_total")),
        "reported_cached_tokens": int(_sum(
            router, "router_reported_cached_tokens_total")),
        "engine_query_tokens": int(q), "engine_hit_tokens": int(h), "store_hit_tokens": int(sh),
        "preemptions": summary.get("preemptions"),
        "num_requests": len(results), "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s,
        "requests": [{"id": r.request_id, "send_s": _round(r.send_s), "ttft_s": _round(r.ttft_s),
                      "e2e_s": _round(r.e2e_s), "prompt_tokens": r.num_prompt_tokens,
                      "cached_tokens": r.num_cached_tokens} for r in results],
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def targets(routers: dict[str, dict], overhead_ms: float | None) -> dict:
    """The issue's speed targets checked on one report's entries; a figure whose entries are
    missing (not run, failed) is ``None`` with ``met`` ``None``:

        ttft_p50_speedup           round-robin / cache-aware TTFT p50, target >= 2
        ttft_p50_speedup_store     round-robin+store / cache-aware+store, target > 1
        max_engine_imbalance       largest max/min of requests_per_engine over the entries,
                                   target <= 1.5 (an engine with 0 requests: inf)
        router_overhead_ms         mean over every run, target < 2
    """
    def ratio(a: str, b: str) -> float | None:
        x, y = (routers.get(a) or {}).get("ttft_p50_s"), (routers.get(b) or {}).get("ttft_p50_s")
        return x / y if x and y else None

    imbalance = [max(c) / min(c) if min(c) > 0 else float("inf")
                 for f in routers.values() if (c := f.get("requests_per_engine"))]
    figures = {
        "ttft_p50_speedup": (ratio("round-robin", "cache-aware"), lambda v: v >= 2.0),
        "ttft_p50_speedup_store": (ratio("round-robin+store", "cache-aware+store"),
                                   lambda v: v > 1.0),
        "max_engine_imbalance": (max(imbalance) if imbalance else None, lambda v: v <= 1.5),
        "router_overhead_ms": (overhead_ms, lambda v: v < 2.0),
    }
    return {k: {"value": v, "met": None if v is None else bool(ok(v))}
            for k, (v, ok) in figures.items()}

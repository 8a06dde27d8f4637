"""Read servers' Prometheus ``/metrics`` and turn counter increases into per-tier figures.

A run scrapes every process of a configuration before and after the workload; the difference
of each counter is what the workload caused. ``summarize`` maps the series of engine_min's
server (``engine_prefix_cache_*``, ``engine_external_prefix_cache_*``), of the store
(``*hit_tokens*{tier=...}``, ``*load*bytes*``, ``*save*bytes*``) and of the daemon
(``kvstore_server_sent_bytes_total`` = loaded by engines, ``..._received_bytes_total`` = saved)
into one dict; series it does not know stay available in the raw deltas. engine_min's server
also answers ``GET /debug/stats`` (the engine's and connector's counters as JSON, with hit
tokens per store tier and loaded/saved bytes); those numbers join the samples as
``stats:<key>`` (``stats:kvstore_hit_tokens_by_tier{tier="cpu"}`` for the per-tier dict).
"""
from __future__ import annotations

import json
import urllib.request
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, float]


def sample_key(name: str, labels: Mapping[str, str]) -> str:
    """``name{a="x",b="y"}`` with labels sorted (``name`` alone without labels)."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_metrics(text: str) -> Samples:
    """All samples of a Prometheus text exposition, keyed by ``sample_key``.

    Raises:
        ValueError: the text is not valid exposition format.
    """
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[sample_key(s.name, s.labels)] = float(s.value)
    return out


def flatten_stats(stats: dict) -> Samples:
    """Numeric entries of a ``/debug/stats`` JSON object as ``stats:<key>`` samples; a dict of
    numbers under a ``*_by_tier`` key becomes one sample per tier."""
    out: Samples = {}
    for k, v in stats.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[f"stats:{k}"] = float(v)
        elif isinstance(v, dict) and k.endswith("_by_tier"):
            for tier, n in v.items():
                if isinstance(n, (int, float)):
                    out[sample_key(f"stats:{k}", {"tier": str(tier)})] = float(n)
    return out


def scrape(base_url: str, timeout_s: float = 5.0) -> Samples:
    """``GET base_url/metrics`` parsed, plus ``GET base_url/debug/stats`` flattened where the
    server has it; ``{}`` parts for what the server lacks or when it is unreachable (a
    benchmark against a foreign server must not fail for that)."""
    base = base_url.rstrip("/")
    out: Samples = {}
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=timeout_s) as r:
            out.update(parse_metrics(r.read().decode("utf-8", errors="replace")))
    except (OSError, ValueError):
        pass
    try:
        with urllib.request.urlopen(base + "/debug/stats", timeout=timeout_s) as r:
            data = json.loads(r.read())
            if isinstance(data, dict):
                out.update(flatten_stats(data))
    except (OSError, ValueError):
        pass
    return out


def delta(before: Samples, after: Samples) -> Samples:
    """``after - before`` for every series in ``after`` (missing in ``before`` counts as 0);
    only series that changed are kept, and every ``stats:`` entry (so a count that stayed 0,
    e.g. preemptions, reads 0 rather than absent). Gauges come out as changes too."""
    out = {}
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if d != 0 or k.startswith("stats:"):
            out[k] = d
    return out


def series_name(key: str) -> str:
    """The metric name of a sample key (``name{labels}`` -> ``name``)."""
    return key.split("{", 1)[0]


def label_value(key: str, label: str) -> str | None:
    """The value of ``label`` in a sample key, or None when the key has no such label."""
    marker = f'{label}="'
    if marker not in key:
        return None
    return key.split(marker, 1)[1].split('"', 1)[0]


def sum_series(samples: Samples, *names: str) -> float:
    """Sum of every sample whose metric name is one of ``names`` (all label sets)."""
    return sum(v for k, v in samples.items() if series_name(k) in names)


_name, _label, _sum = series_name, label_value, sum_series


def summarize(deltas: Mapping[str, Samples]) -> dict:
    """Figures of one run from the counter increases of each process (role -> deltas).

    Returns a dict with (tokens unless named ``*_bytes``):
        ``engine_query_tokens``, ``engine_hit_tokens``: the engines' own prefix caches;
        ``store_query_tokens``, ``store_hit_tokens``: the KV store as seen by the engines;
        ``hit_tokens_by_tier``: ``{"engine": ..., <store tier>: ...}`` (store tiers from a
        ``tier`` label where a series has one, tiers that served nothing left out, else one
        ``"store"`` entry);
        ``bytes_loaded``, ``bytes_saved``: KV bytes moved from/to the store (engine-side
        series if present, else the daemon's payload bytes), ``None`` when nothing reports it;
        ``preemptions``: requests preempted by the engines (a preempted request that resumes
        counts its own surviving blocks as cached, so hit rates of an overloaded run are
        inflated; ``None`` when not reported).
    """
    engines = [d for role, d in deltas.items() if role.startswith("engine")]
    daemons = [d for role, d in deltas.items() if not role.startswith("engine")]
    eq = sum(_sum(d, "engine_prefix_cache_queries_total") for d in engines)
    eh = sum(_sum(d, "engine_prefix_cache_hits_total") for d in engines)
    sq = sum(_sum(d, "engine_external_prefix_cache_queries_total") for d in engines)
    sh = sum(_sum(d, "engine_external_prefix_cache_hits_total") for d in engines)
    by_tier: dict[str, float] = {"engine": eh} if eh else {}
    for d in engines + daemons:
        for k, v in d.items():
            tier = _label(k, "tier")
            if tier and v and "hit_tokens" in _name(k) and _name(k).endswith("_total"):
                by_tier[tier] = by_tier.get(tier, 0.0) + v
    for d in engines:
        for k, v in d.items():
            if v and _name(k) == "stats:kvstore_hit_tokens_by_tier":
                tier = _label(k, "tier")
                by_tier[tier] = by_tier.get(tier, 0.0) + v
    if sh and not set(by_tier) - {"engine"}:
        by_tier["store"] = sh
    loaded = (_sum_all(engines, "stats:kvstore_loaded_bytes") or _bytes(engines, "load")
              or _sum_all(daemons, "kvstore_server_sent_bytes_total"))
    saved = (_sum_all(engines, "stats:kvstore_saved_bytes") or _bytes(engines, "save")
             or _sum_all(daemons, "kvstore_server_received_bytes_total"))
    return {"engine_query_tokens": eq, "engine_hit_tokens": eh, "store_query_tokens": sq,
            "store_hit_tokens": sh, "hit_tokens_by_tier": by_tier,
            "bytes_loaded": loaded, "bytes_saved": saved,
            "preemptions": _sum_all(engines, "stats:num_preemptions")}


def _bytes(engines: list[Samples], verb: str) -> float | None:
    total, found = 0.0, False
    for d in engines:
        for k, v in d.items():
            n = _name(k)
            if verb in n and "bytes" in n and n.endswith("_total"):
                total += v
                found = True
    return total if found else None


def _sum_all(samples: list[Samples], name: str) -> float | None:
    vals = [v for d in samples for k, v in d.items() if _name(k) == name]
    return sum(vals) if vals else None

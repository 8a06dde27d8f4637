"""Figures, table, JSON and plots of one replay run.

Per configuration (seconds, tokens): ``ttft_p50_s/p95/p99``, ``itl_p50_s/p95/p99``,
``tpot_p50_s``, ``e2e_p50_s/p95/p99``, ``output_tok_s`` (output tokens / wall time),
``req_s``, ``outputs_equal_recompute`` (``"k/n"``: greedy outputs identical to the
``recompute`` configuration's), ``hit_rate`` (reused prompt tokens / prompt tokens, from the
server's ``usage.prompt_tokens_details.cached_tokens``), ``ttft_p50_s_warm`` (requests that
are not the first of their session), per-index figures (round of a chat, question of a
document) and the metric summary (hit tokens per tier, bytes loaded/saved). Speed-ups are ratios between
configurations of the same run: ``speedups["ttft_p50_s"]["kvstore-cpu/recompute"] = 12.3``
means TTFT p50 was 12.3x lower with kvstore-cpu than with recompute.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.workloads import Request, first_in_session

BASELINES = ("recompute", "engine-cache")


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _hit_rate(results) -> float | None:
    pairs = [(r.num_cached_tokens, r.num_prompt_tokens) for r in results
             if r.ok and r.num_prompt_tokens]
    if not pairs or any(c is None for c, _ in pairs):
        return None
    return sum(c for c, _ in pairs) / sum(p for _, p in pairs)


def config_figures(run, first_ids: set[str]) -> dict:
    """The figures of one ``ConfigRun`` (see the module docstring)."""
    ok = [r for r in run.results if r.ok]
    ttft = [r.ttft_s for r in ok]
    itl = [x for r in ok for x in r.itl_s]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok]
    out_tokens = sum(r.num_output_tokens for r in ok)
    warm = [r.ttft_s for r in ok if r.request_id not in first_ids]
    cold = [r.ttft_s for r in ok if r.request_id in first_ids]
    fig = {"num_requests": len(run.results), "num_ok": len(ok),
           "num_failed": len(run.results) - len(ok), "wall_s": run.wall_s}
    for name, vals in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 95, 99):
            fig[f"{name}_p{q}_s"] = _pct(vals, q)
    fig["ttft_mean_s"] = float(np.mean(ttft)) if ttft else None
    fig["tpot_p50_s"] = _pct(tpot, 50)
    fig["ttft_p50_s_warm"] = _pct(warm, 50)
    fig["ttft_p50_s_cold"] = _pct(cold, 50)
    fig["output_tokens"] = out_tokens
    fig["prompt_tokens"] = sum(r.num_prompt_tokens or 0 for r in ok)
    fig["cached_tokens"] = sum(r.num_cached_tokens or 0 for r in ok)
    fig["output_tok_s"] = out_tokens / run.wall_s if run.wall_s > 0 else None
    fig["req_s"] = len(ok) / run.wall_s if run.wall_s > 0 else None
    fig["hit_rate"] = _hit_rate(ok)
    m = run.metrics or {}
    q = m.get("engine_query_tokens") or 0
    fig["hit_rate_metrics"] = ((m.get("engine_hit_tokens", 0) + m.get("store_hit_tokens", 0)) / q
                               if q else None)
    fig["by_index"] = _by_index(ok)
    fig["outputs_equal_recompute"] = None  # filled in by build_report
    fig["metrics"] = m
    fig["errors"] = sorted({r.error for r in run.results if r.error})[:5]
    fig["notes"] = list(run.notes)
    fig["commands"] = dict(getattr(run, "commands", {}) or {})
    return fig


def _by_index(ok) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for idx in sorted({r.index for r in ok}):
        rs = [r for r in ok if r.index == idx]
        out[str(idx)] = {"n": len(rs), "ttft_p50_s": _pct([r.ttft_s for r in rs], 50),
                         "hit_rate": _hit_rate(rs)}
    return out


def speedups(configs: dict[str, dict], key: str = "ttft_p50_s") -> dict[str, float]:
    """``"X/B": figure(B) / figure(X)`` for each baseline B in ``BASELINES`` present and each
    other configuration X except ``recompute`` (a latency ratio: > 1 means X is faster)."""
    out = {}
    for base in BASELINES:
        b = configs.get(base, {}).get(key)
        if not b:
            continue
        for name, fig in configs.items():
            if name not in (base, "recompute") and fig.get(key):
                out[f"{name}/{base}"] = b / fig[key]
    return out


def versions() -> dict:
    """Versions of what produced the figures: Python, packages, git commit, machine."""
    out = {"python": sys.version.split()[0], "platform": platform.platform(),
           "cpu_count": os.cpu_count()}
    for mod in ("torch", "aiohttp", "numpy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a version is informative only
            out[mod] = None
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True, timeout=10,
                                           cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def build_report(bench: str, runs: dict, requests: Sequence[Request], params: dict,
                 args: dict) -> dict:
    """The whole report: figures per configuration, speed-ups, parameters, versions and every
    request's measurements."""
    first = first_in_session(requests)
    configs = {name: config_figures(run, first) for name, run in runs.items()}
    if "recompute" in runs:
        ref = {r.request_id: r.text for r in runs["recompute"].results if r.ok}
        for name, run in runs.items():
            same = [r.text == ref[r.request_id] for r in run.results
                    if r.ok and r.request_id in ref]
            configs[name]["outputs_equal_recompute"] = (f"{sum(same)}/{len(same)}"
                                                        if same else None)
    return {"benchmark": bench, "configs": configs,
            "speedups": {k: speedups(configs, k) for k in
                         ("ttft_p50_s", "ttft_p50_s_warm", "e2e_p50_s")},
            "params": {**params, "args": {k: v for k, v in args.items()}},
            "versions": versions(),
            "requests": {name: [r.to_dict() for r in run.results] for name, run in runs.items()}}


def _fmt(v, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def format_table(rep: dict) -> str:
    """A plain-text table of the main figures, then the speed-ups."""
    head = ("config", "ok", "TTFT p50", "p95", "p99", "warm p50", "ITL p50", "TPOT p50",
            "E2E p50", "out tok/s", "req/s", "hit rate", "same out")
    rows = [head]
    for name, f in rep["configs"].items():
        rows.append((name, f"{f['num_ok']}/{f['num_requests']}", _fmt(f["ttft_p50_s"]),
                     _fmt(f["ttft_p95_s"]), _fmt(f["ttft_p99_s"]), _fmt(f["ttft_p50_s_warm"]),
                     _fmt(f["itl_p50_s"]), _fmt(f["tpot_p50_s"]), _fmt(f["e2e_p50_s"]),
                     _fmt(f["output_tok_s"], digits=1), _fmt(f["req_s"], digits=2),
                     _fmt(f["hit_rate"], digits=3), f["outputs_equal_recompute"] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"== {rep['benchmark']} (latencies in s) =="]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if j else c.ljust(w)
                               for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for key, sp in rep["speedups"].items():
        if sp:
            lines.append(f"speed-up of {key} (baseline / config): " +
                         ", ".join(f"{k} {v:.1f}x" for k, v in sp.items()))
    for name, f in rep["configs"].items():
        for note in f["notes"] + f["errors"]:
            lines.append(f"[{name}] {note.splitlines()[0] if note else note}")
        tiers = f["metrics"].get("hit_tokens_by_tier") if f["metrics"] else None
        if tiers:
            lines.append(f"[{name}] hit tokens by tier: " +
                         ", ".join(f"{t}={int(v)}" for t, v in tiers.items()) +
                         f"; bytes loaded={f['metrics'].get('bytes_loaded')}"
                         f" saved={f['metrics'].get('bytes_saved')}"
                         f"; preemptions={f['metrics'].get('preemptions')}")
    return "\n".join(lines)


def run_line(name: str, results: Sequence, extra: str = "") -> str:
    """One line for a finished run, printed as the bench goes (also with ``--no-progress``):
    ``[NAME] done: N requests (K failed), TTFT p50 S s`` (``results``: ``RequestResult``s;
    ``extra`` appended after ``; ``)."""
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    failed = sum(1 for r in results if not r.ok)
    p50 = f"{float(np.median(ttfts)):.3f} s" if ttfts else "-"
    return (f"[{name}] done: {len(results)} requests ({failed} failed), TTFT p50 {p50}"
            + (f"; {extra}" if extra else ""))


def emit_json(res: dict, path: str | None, echo: bool = True) -> dict:
    """A bench's JSON result: printed (``echo``, indent 2) and written to ``path`` when given
    (indent 2; folders created). Returns ``res``."""
    if echo:
        print(json.dumps(res, indent=2))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
    return res


def write_json(rep: dict, path: str) -> None:
    """Write ``rep`` to ``path`` (folders created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=1, default=str)


def default_plot_dir(json_path: str) -> str:
    return str(Path(json_path).parent)


def plot_all(rep: dict, out_dir: str, prefix: str, group_by: str = "index") -> list[Path]:
    """TTFT CDF per configuration, hit rate per index (``group_by="index"``) or over time
    (``"time"``), and output-throughput bars; PNG files in ``out_dir``, paths returned."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, reqs in rep["requests"].items():
        t = np.sort([r["ttft_s"] for r in reqs if r["ok"]])
        if len(t):
            ax.step(t, np.arange(1, len(t) + 1) / len(t), where="post", label=name)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set(xlabel="TTFT (s, log)", ylabel="fraction of requests", title=f"{prefix}: TTFT CDF")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / f"{prefix}_ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, reqs in rep["requests"].items():
        xs, ys = _hit_series(reqs, group_by)
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    if group_by == "index":
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set(xlabel="round / question index" if group_by == "index" else "time (s)",
           ylabel="hit rate (cached / prompt tokens)", ylim=(-0.02, 1.02),
           title=f"{prefix}: hit rate")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out / f"{prefix}_hit_rate.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(rep["configs"])
    vals = [rep["configs"][n]["output_tok_s"] or 0 for n in names]
    ax.bar(names, vals)
    ax.set(ylabel="output tokens / s", title=f"{prefix}: throughput")
    ax.tick_params(axis="x", rotation=20)
    paths.append(_save(fig, out / f"{prefix}_throughput.png"))
    return paths


def _hit_series(reqs: list[dict], group_by: str, bins: int = 10):
    ok = [r for r in reqs if r["ok"] and r["num_prompt_tokens"]
          and r["num_cached_tokens"] is not None]
    if not ok:
        return [], []
    if group_by == "index":
        keys = sorted({r["index"] for r in ok})
        groups = [[r for r in ok if r["index"] == k] for k in keys]
    else:
        ok.sort(key=lambda r: r["send_s"])
        groups = [g.tolist() for g in np.array_split(np.array(ok, dtype=object),
                                                     min(bins, len(ok)))]
        keys = [float(np.mean([r["send_s"] for r in g])) for g in groups]
    ys = [sum(r["num_cached_tokens"] for r in g) / sum(r["num_prompt_tokens"] for r in g)
          for g in groups]
    return keys, ys


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path

"""Eviction policies judged on a real trace against Belady's offline optimum.

    python -m bench.policy_sim --trace mooncake-conv --json out.json --png out.png

Replays the trace's prefix-chunk accesses (``bench.policy_trace``) through the store's real
policy objects (``bench.policy_replay``), each without and with an admission filter
(``--admission``, default ``none`` and ``tinylfu``; a curve with one is named
``POLICY+FILTER``, e.g. ``lru+tinylfu``; ``--admission oracle`` adds a bound that admits only
chunks a later row reads, ``bench.policy_oracle``), at capacities given as fractions of the trace's
unique bytes, in one tier and in two (CPU over disk, ``--cpu-share`` of the capacity in CPU),
and the bound (``bench.policy_belady``) at the same capacities. Chunk bytes are tokens times
the layout's KV bytes per token; every size scales by the same factor, so hit rates do not
depend on the layout (only the byte figures do). Hit rates are token-weighted: prompt tokens
served by the store over prompt tokens of every row.

JSON (``--json``): ``{"trace", "default_policy", "infinite_hit_rate", "curves": {POLICY:
{FRACTION: hit_rate}}, "belady": {FRACTION: hit_rate}, "accesses_per_s"}`` (one tier; the
fractions as strings, e.g. "0.1"), plus ``default_admission`` (the store's), ``two_tier`` ({POLICY: {FRACTION: {"hit_rate",
"cpu_hit_rate", "disk_bytes_written"}}}), ``accesses_per_s_by_policy`` (per curve name),
``refused`` ({CURVE: {FRACTION: inserts the filter refused}}, one tier), ``layout``,
``token_bytes``, ``unique_bytes``, ``num_accesses``, ``cpu_share`` and ``calibration_ops_per_s``
(a plain dict-insert loop on this machine, to read the rate against). ``accesses_per_s`` is the
slowest curve's rate: chunk accesses replayed per CPU second of the replaying process (CPU
time, not wall time, so that other work on the machine does not count against the policy).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.policy_belady import belady_hit_tokens, next_uses
from bench.policy_oracle import ORACLE
from bench.policy_replay import PolicyReplay
from bench.policy_trace import TRACES, ChunkTrace, load_chunk_trace, prefix_reuse_tokens
from bench.trace_files import DEFAULT_TRACES_DIR, exit_if_missing
from kvstore.config import StoreConfig
from kvstore.eviction import ADMISSIONS, POLICIES
from kvstore.layout import KVLayout
from bench.outputs import output_file, plot_file

#: KV layouts to size chunks by: SmolLM2-135M (30 layers, 3 KV heads of 64) and an 8B-class
#: model (Llama-3-8B: 32 layers, 8 KV heads of 128), both 16-bit.
LAYOUTS = {
    "smollm2": KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16"),
    "llama8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
}
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


def _frac_key(f: float) -> str:
    return repr(float(f))


def tier_capacities(unique_bytes: int, fraction: float, tiers: int,
                    cpu_share: float) -> list[int]:
    """Bytes per tier (fastest first) for ``fraction`` of ``unique_bytes``: all of it in one
    tier, or ``cpu_share`` of it in CPU and the rest on disk (so the two tiers together hold
    no more than the bound's single cache)."""
    total = int(fraction * unique_bytes)
    if tiers == 1:
        return [total]
    cpu = int(total * cpu_share)
    return [cpu, total - cpu]


def calibration_ops_per_s(n: int = 200_000) -> float:
    """Dict inserts per CPU second of a plain Python loop here (the machine's speed right
    now, measured as the replays are)."""
    d: dict[int, int] = {}
    t0 = time.process_time()
    for i in range(n):
        d[i] = i
    return n / max(time.process_time() - t0, 1e-9)


def curve_name(policy: str, admission: str) -> str:
    """``lru`` without a filter, ``lru+tinylfu`` with one."""
    return policy if admission == "none" else f"{policy}+{admission}"


def simulate(trace: ChunkTrace, policies: list[str], fractions: list[float],
             token_bytes: int, two_tier: bool = True, cpu_share: float = 0.25,
             log=None, admissions: tuple[str, ...] = ("none",)) -> dict:
    """Replay ``trace`` for each policy, admission filter and fraction (one tier, and two
    when ``two_tier``) and compute the bound; returns the JSON document described in the
    module docstring (without the layout fields). ``log``: a callable given one progress line
    per replay."""
    unique_bytes = trace.unique_tokens() * token_bytes
    total = trace.total_tokens
    nxt = next_uses(trace)
    out: dict = {"trace": trace.name, "default_policy": StoreConfig().cpu_policy,
                 "default_admission": StoreConfig().admission, "refused": {},
                 "infinite_hit_rate": prefix_reuse_tokens(trace) / total,
                 "curves": {}, "belady": {}, "two_tier": {}, "accesses_per_s_by_policy": {},
                 "unique_bytes": unique_bytes, "num_accesses": len(trace.keys),
                 "cpu_share": cpu_share}
    for f in fractions:
        cap = tier_capacities(unique_bytes, f, 1, cpu_share)[0]
        out["belady"][_frac_key(f)] = belady_hit_tokens(trace, cap, token_bytes, nxt) / total
    for policy, adm in [(p, a) for a in admissions for p in policies]:
        name = curve_name(policy, adm)
        curve, two, refused, accesses, seconds = {}, {}, {}, 0, 0.0
        for f in fractions:
            for tiers in ((1, 2) if two_tier else (1,)):
                caps = tier_capacities(unique_bytes, f, tiers, cpu_share)
                res = PolicyReplay(trace, policy, caps, token_bytes, adm).run()
                accesses += res.num_accesses
                seconds += res.cpu_s or res.elapsed_s
                if tiers == 1:
                    curve[_frac_key(f)] = res.hit_rate
                    refused[_frac_key(f)] = res.refused
                else:
                    two[_frac_key(f)] = {"hit_rate": res.hit_rate,
                                         "cpu_hit_rate": res.top_hit_tokens / total,
                                         "disk_bytes_written": res.spilled_bytes}
                if log:
                    log(f"{trace.name} {name:15s} {f:5.2f} tiers={tiers} hit={res.hit_rate:.4f} "
                        f"{res.accesses_per_s:,.0f} accesses/s")
        out["curves"][name] = curve
        out["refused"][name] = refused
        if two:
            out["two_tier"][name] = two
        out["accesses_per_s_by_policy"][name] = accesses / seconds if seconds else 0.0
    rates = out["accesses_per_s_by_policy"].values()
    out["accesses_per_s"] = min(rates) if rates else 0.0
    return out


def plot(doc: dict, path: str | Path) -> None:
    """Hit rate vs capacity (fraction of unique bytes, log scale), one line per policy (one
    tier solid, two tiers dashed), the bound and the infinite-cache rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = sorted(doc["belady"], key=float)
    ax.plot([float(x) for x in xs], [doc["belady"][x] for x in xs], "k-", lw=2.5,
            label="Belady (MIN)")
    for i, (name, curve) in enumerate(sorted(doc["curves"].items())):
        color = f"C{i}"
        ks = sorted(curve, key=float)
        ax.plot([float(x) for x in ks], [curve[x] for x in ks], "o-", color=color, label=name)
        two = doc.get("two_tier", {}).get(name)
        if two:
            ks = sorted(two, key=float)
            ax.plot([float(x) for x in ks], [two[x]["hit_rate"] for x in ks], "--",
                    color=color, alpha=0.7, label=f"{name} (CPU+disk)")
    ax.axhline(doc["infinite_hit_rate"], color="grey", ls=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (fraction of the trace's unique KV bytes)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"{doc['trace']}: eviction policies vs the offline optimum")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(doc: dict) -> str:
    """A markdown table: policy x capacity (one tier), the bound last, each cell's share of
    the bound in parentheses."""
    xs = sorted(doc["belady"], key=float)
    lines = ["| policy | " + " | ".join(xs) + " |", "|---|" + "---:|" * len(xs)]
    for name, curve in sorted(doc["curves"].items()):
        cells = []
        for x in xs:
            b = doc["belady"][x]
            share = f" ({curve[x] / b:.0%})" if b > 0 else ""
            cells.append(f"{curve[x]:.3f}{share}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| belady | " + " | ".join(f"{doc['belady'][x]:.3f}" for x in xs) + " |")
    return "\n".join(lines)


_DURATION = ("Duration on the 2-core machine: --trace mooncake-conv --one-tier-only 105 s wall\n"
             "(nice 19, load average 2.4-5.0 from other work, 2026-12-02); without --one-tier-only\n"
             "the CPU+disk replays come on top (not timed); --limit N replays fewer rows.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 prog="python -m bench.policy_sim", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, choices=sorted(TRACES))
    ap.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR),
                    help="folder of the trace files (default: the repository's sibling "
                         "shared/data/traces)")
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES),
                    help="a policy to replay (repeat; default all)")
    ap.add_argument("--admission", action="append", choices=[*ADMISSIONS, ORACLE],
                    help="an admission filter to replay each policy with (repeat; default "
                         "none and tinylfu; 'oracle' admits only chunks a later row reads, "
                         "a bound: bench.policy_oracle)")
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS),
                    help="capacities as fractions of the unique bytes, comma-separated")
    ap.add_argument("--limit", type=int, help="replay the first N rows only (default all)")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="smollm2")
    ap.add_argument("--one-tier-only", action="store_true", help="skip the CPU+disk replays")
    ap.add_argument("--cpu-share", type=float, default=0.25,
                    help="share of the capacity in the CPU tier of the two-tier replay")
    ap.add_argument("--json", type=output_file, help="write the JSON document here")
    ap.add_argument("--png", type=plot_file,
                    help="write the hit-rate plot here (.png, .pdf, .svg, ...)")
    args = ap.parse_args(argv)
    try:
        fractions = [float(x) for x in args.fractions.split(",")]
    except ValueError:
        ap.error(f"--fractions: not numbers: {args.fractions!r}")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        ap.error(f"--fractions must be in (0, 1], got {args.fractions!r}")
    if args.limit is not None and args.limit <= 0:
        ap.error(f"--limit must be > 0, got {args.limit}")
    if not 0 < args.cpu_share < 1:
        ap.error(f"--cpu-share must be in (0, 1), got {args.cpu_share}")
    layout = LAYOUTS[args.layout]
    exit_if_missing(ap.prog, Path(args.traces_dir) / TRACES[args.trace][0], args.traces_dir)
    trace = load_chunk_trace(args.trace, args.traces_dir, args.limit)
    doc = simulate(trace, args.policy or sorted(POLICIES), fractions, layout.token_bytes,
                   two_tier=not args.one_tier_only, cpu_share=args.cpu_share,
                   log=lambda line: print(line, file=sys.stderr, flush=True),
                   admissions=tuple(dict.fromkeys(args.admission or ADMISSIONS)))
    doc.update(layout=args.layout, token_bytes=layout.token_bytes,
               calibration_ops_per_s=calibration_ops_per_s())
    print(table(doc))
    print(f"infinite cache: {doc['infinite_hit_rate']:.4f}; slowest policy "
          f"{doc['accesses_per_s']:,.0f} accesses per CPU second (a dict-insert loop here: "
          f"{doc['calibration_ops_per_s']:,.0f}/s)")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        plot(doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which newly stored chunks a trace reads again, by what a policy can see when storing them.

    python -m bench.policy_reuse --trace mooncake-conv [--json F]

``bench.policy_sim --admission oracle`` shows how much of a policy's distance from Belady's
bound comes from storing chunks that are never read again. This asks whether anything known
when a chunk is stored tells those apart: for every row's new chunks (chunks no earlier row
read; a row reads its chunks head first), whether a later row reads them, grouped by

* ``depth``: 0 for a row whose head no earlier row read; else 1 + the depth of the row that
  first read the last chunk of this row's hit prefix (on a chat trace: 1 for a conversation's
  first turn under a shared system prompt, 2 for its second turn, ...; capped at 8);
* ``new_chunks``: how many new chunks the row stores, bucketed by powers of two (the key is
  the bucket's lower end: 1, 2, 4, ...);
* ``partial``: whether the chunk has fewer tokens than the trace's fullest chunk (a prompt's
  partial last block, whose id a longer prompt cannot share).

Each group is ``[new chunks, of them read again]``. JSON (``--json``): ``{"trace", "overall", "read_once", "gap_rows_median",
"by_depth": {DEPTH: [n, again]}, "by_new_chunks": {LOW: [n, again]}, "by_partial": {"true" |
"false": [n, again]}}``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.arg_checks import int_at_least
from bench.outputs import output_file
from bench.policy_trace import TRACES, ChunkTrace, load_chunk_trace
from bench.trace_files import DEFAULT_TRACES_DIR, exit_if_missing

#: deeper rows are counted with this depth
MAX_DEPTH = 8


def _bucket(n: int) -> int:
    """The power of two at or below ``n`` (>= 1)."""
    return 1 << (n.bit_length() - 1)


def _read_gaps(trace: ChunkTrace) -> tuple[list[int], int]:
    """(rows between consecutive reads of a chunk, over all chunks, sorted; chunks read by one
    row only)."""
    last: dict[int, int] = {}
    reads: dict[int, int] = {}
    gaps: list[int] = []
    keys, start = trace.keys, trace.start
    for r in range(trace.num_rows):
        for k in set(keys[start[r]:start[r + 1]]):
            if k in last:
                gaps.append(r - last[k])
            last[k] = r
            reads[k] = reads.get(k, 0) + 1
    gaps.sort()
    return gaps, sum(1 for n in reads.values() if n == 1)


def reuse_by_feature(trace: ChunkTrace) -> dict:
    """The groups of the module docstring for ``trace``: a dict with ``overall``,
    ``read_once`` (chunks read by one row only), ``gap_rows_median`` (median rows between two
    consecutive reads of a chunk; None when no chunk is read twice) and ``by_depth`` /
    ``by_new_chunks`` / ``by_partial`` (keys as ints and bools here; the CLI writes them as
    strings)."""
    keys, tokens, start = trace.keys, trace.tokens, trace.start
    last_row: dict[int, int] = {}
    for r in range(trace.num_rows):
        last_row.update(dict.fromkeys(keys[start[r]:start[r + 1]], r))
    full = max(tokens, default=0)
    owner: dict[int, int] = {}  # chunk -> depth of the row that first read it
    overall = [0, 0]
    by_depth: dict[int, list[int]] = {}
    by_new: dict[int, list[int]] = {}
    by_partial: dict[bool, list[int]] = {}
    for r in range(trace.num_rows):
        a, b = start[r], start[r + 1]
        j = a
        while j < b and keys[j] in owner:
            j += 1
        depth = 0 if j == a else min(owner[keys[j - 1]] + 1, MAX_DEPTH)
        new = [p for p in range(j, b) if keys[p] not in owner]
        for p in new:
            owner.setdefault(keys[p], depth)
        if not new:
            continue
        groups = (overall, by_depth.setdefault(depth, [0, 0]),
                  by_new.setdefault(_bucket(len(new)), [0, 0]))
        for p in new:
            again = last_row[keys[p]] > r
            part = by_partial.setdefault(tokens[p] < full, [0, 0])
            for g in (*groups, part):
                g[0] += 1
                g[1] += again
    gaps, read_once = _read_gaps(trace)
    return {"overall": overall, "read_once": read_once,
            "gap_rows_median": gaps[len(gaps) // 2] if gaps else None,
            "by_depth": dict(sorted(by_depth.items())),
            "by_new_chunks": dict(sorted(by_new.items())),
            "by_partial": dict(sorted(by_partial.items()))}


def _table(title: str, groups: dict) -> str:
    lines = [f"| {title} | new chunks | read again | share |", "|---|---:|---:|---:|"]
    for k, (n, again) in groups.items():
        lines.append(f"| {k} | {n:,} | {again:,} | {again / n:.3f} |")
    return "\n".join(lines)


_DURATION = ("Duration on the 2-core machine: about 1 s wall for --trace mooncake-conv, the\n"
             "largest trace (0.85 s; nice 19, load average 2.4-5.0 from other work, 2026-12-02).")


def build_parser() -> argparse.ArgumentParser:
    """The command line (numeric flags checked as it is parsed: ``bench.arg_checks``)."""
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 prog="python -m bench.policy_reuse",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, choices=sorted(TRACES))
    ap.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR),
                    help="folder of the trace files (default: the repository's sibling "
                         "shared/data/traces)")
    ap.add_argument("--limit", type=int_at_least(1), help="the first N rows only (default all)")
    ap.add_argument("--json", type=output_file, help="write the JSON document here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    exit_if_missing(ap.prog, Path(args.traces_dir) / TRACES[args.trace][0], args.traces_dir)
    doc = reuse_by_feature(load_chunk_trace(args.trace, args.traces_dir, args.limit))
    n, again = doc["overall"]
    print(f"{args.trace}: {n:,} new chunks, {again:,} read again by a later row "
          f"({again / max(n, 1):.3f}); {doc['read_once']:,} chunks read by one row only; "
          f"median rows between two reads of a chunk: {doc['gap_rows_median']}")
    print(_table("depth", doc["by_depth"]))
    print(_table("new chunks in the row (from)", doc["by_new_chunks"]))
    print(_table("partial chunk", doc["by_partial"]))
    if args.json:
        out = {"trace": args.trace, "overall": doc["overall"], "read_once": doc["read_once"],
               "gap_rows_median": doc["gap_rows_median"],
               **{k: {str(g).lower(): v for g, v in doc[k].items()}
                  for k in ("by_depth", "by_new_chunks", "by_partial")}}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

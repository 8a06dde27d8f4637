"""Where the shipped trace files are: the repository's sibling folder ``shared/data/traces/``
(``<repo>/../shared/data/traces``), or a folder given with ``--traces-dir``.

``python -m bench.trace_files [--traces-dir DIR]`` prints the resolved folder and the files in
it (size in bytes; the trace files the benches read marked ``*``) and names those missing;
exit 0 when every trace file is there, 1 when the folder or one of them is missing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: the default folder of the trace files, beside the repository's checkout.
DEFAULT_TRACES_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"


def missing_trace(path: str | Path, traces_dir: str | Path | None) -> str | None:
    """Why trace file ``path`` (in ``traces_dir``, or a path given alone when None) cannot be
    read, in one line naming the folder and where the traces ship; None when it is a file."""
    path = Path(path)
    if path.is_file():
        return None
    where = (f"the traces ship in the repository's sibling folder shared/data/traces/ "
             f"({DEFAULT_TRACES_DIR}); point --traces-dir at the folder that holds them")
    if traces_dir is None:
        return f"no trace file {path}; {where}"
    if not Path(traces_dir).is_dir():
        return f"--traces-dir {traces_dir}: no such directory; {where}"
    return f"--traces-dir {traces_dir}: no {path.name} in it; {where}"


def exit_if_missing(prog: str, path: str | Path, traces_dir: str | Path | None) -> None:
    """Exit 2 with ``prog: error: <missing_trace>`` on stderr (one line, as argparse's
    errors) when the trace file cannot be read; return otherwise."""
    why = missing_trace(path, traces_dir)
    if why is not None:
        print(f"{prog}: error: {why}", file=sys.stderr)
        raise SystemExit(2)


#: the trace files ``bench.trace_replay``, ``bench.policy_sim`` and ``bench.policy_reuse`` read
#: (``bench.policy_trace.TRACES``, ``bench.trace_replay.TRACES``).
TRACE_FILES = ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl",
               "azure_llm_2023_conv.csv", "azure_llm_2023_code.csv")


def describe(traces_dir: str | Path = DEFAULT_TRACES_DIR) -> tuple[list[str], bool]:
    """The lines ``python -m bench.trace_files`` prints for ``traces_dir`` (the folder resolved
    to an absolute path, then one line per file: ``*`` for a trace file the benches read, its
    size in bytes and its name; then the trace files missing, if any) and whether every one of
    ``TRACE_FILES`` is there."""
    folder = Path(traces_dir).expanduser().resolve()
    lines = [f"traces directory: {folder}"]
    if not folder.is_dir():
        lines.append(missing_trace(folder / TRACE_FILES[0], folder))
        return lines, False
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if not files:
        lines.append("no files in it; the benches need " + ", ".join(TRACE_FILES))
        return lines, False
    for p in files:
        mark = "*" if p.name in TRACE_FILES else " "
        lines.append(f"  {mark} {p.stat().st_size:>12,}  {p.name}")
    missing = [n for n in TRACE_FILES if not (folder / n).is_file()]
    lines.append("* = a trace file the benches read (--traces-dir to use another folder)")
    if missing:
        lines.append("missing: " + ", ".join(missing))
    return lines, not missing


_DURATION = ("Duration on the 2-core machine: under 1 s (0.03 s wall; nice 19, load average\n"
             "2.4-5.0 from other work, 2026-12-02).")


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.trace_files``: print ``describe``'s lines; 0 when every trace file
    is there, else 1."""
    ap = argparse.ArgumentParser(epilog=_DURATION,
                                 prog="python -m bench.trace_files", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR),
                    help="folder of the trace files (default: %(default)s)")
    args = ap.parse_args(argv)
    lines, complete = describe(args.traces_dir)
    print("\n".join(lines))
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where the shipped trace files are: the repository's sibling folder ``shared/data/traces/``
(``<repo>/../shared/data/traces``), or a folder given with ``--traces-dir``."""
from __future__ import annotations

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

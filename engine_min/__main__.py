"""``python -m engine_min ...`` (see engine_min.cli). A Ctrl-C while the modules load (torch
takes seconds) ends as one during a command does: one line, exit status 130."""
import sys

from engine_min.omp import set_omp_wait_policy

set_omp_wait_policy()  # first: before anything imports torch (and loads OpenMP)

try:
    from engine_min.cli import main  # noqa: E402
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())

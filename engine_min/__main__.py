"""``python -m engine_min ...`` (see engine_min.cli)."""
import sys

from engine_min.omp import set_omp_wait_policy

set_omp_wait_policy()  # first: before anything imports torch (and loads OpenMP)

from engine_min.cli import main  # noqa: E402

sys.exit(main())

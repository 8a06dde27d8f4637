"""``python -m engine_min ...`` (see engine_min.cli). A Ctrl-C while the modules load (torch
takes seconds) ends the process at once with one line and exit status 130
(``engine_min.interrupt``: a ``KeyboardInterrupt`` raised inside torch's import is unsafe)."""
import sys

from engine_min.omp import set_omp_wait_policy

set_omp_wait_policy()  # first: before anything imports torch (and loads OpenMP)

from engine_min.interrupt import sigint_exits  # noqa: E402

with sigint_exits():
    from engine_min.cli import main  # noqa: E402
    import engine_min.router.cli  # noqa: E402,F401  (what build_parser imports: torch among them)
    import engine_min.serve.cli  # noqa: E402,F401

sys.exit(main())

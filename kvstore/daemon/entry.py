"""The ``kvstore`` console script and ``python -m kvstore``: ``kvstore.daemon.cli.main`` with a
Ctrl-C while its modules load ending the process at once, one line and status 130
(``kvstore.daemon.cli_interrupt``), instead of a ``KeyboardInterrupt`` traceback and death by
SIGINT."""
from __future__ import annotations

import sys

from kvstore.daemon.cli_interrupt import sigint_exits

#: the subcommands, to name the one interrupted (``kvstore serve: interrupted``)
COMMANDS = ("serve", "stats", "clear", "inspect")


def main() -> int:
    """Load the command line under ``sigint_exits``, then run ``cli.main`` on ``sys.argv``.
    Returns its exit status (``kvstore.daemon.cli`` lists them)."""
    cmd = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in COMMANDS else ""
    with sigint_exits(cmd):
        from kvstore.daemon.cli import main as cli_main
    return cli_main()

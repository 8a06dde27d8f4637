"""Ctrl-C that ends the process at once, for the phases where ``KeyboardInterrupt`` is unsafe.

Python raises ``KeyboardInterrupt`` at the next bytecode after SIGINT, wherever that is. Inside
torch's import or a torch op (its C++ calls back into Python through pybind11) or numpy's lazy
imports, that exception can abort the process (``std::terminate``: status -6), be swallowed so
the work goes on (``generate`` kept decoding), leave numpy half-imported (a later "module
'numpy' has no attribute ..." error), or make the interpreter kill itself with SIGINT at exit
although the exception was caught (status -2). Seen by sending SIGINT 0.95-1.25 s after
``python -m engine_min generate`` started. ``sigint_exits`` replaces that exception, while
active, by an immediate exit: stdout and stderr flushed, one line ``interrupted`` on stderr,
``os._exit(130)`` (128 + SIGINT, as a shell reports it). Use it where nothing needs cleaning
up on Ctrl-C: loading modules and the model, a one-shot ``generate``.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

#: exit status of an interrupted run (128 + SIGINT)
INTERRUPTED_STATUS = 130


def _exit_now(signum, frame) -> None:
    try:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - (a write of the main thread was cut short)
                pass
        os.write(2, b"interrupted\n")
    finally:
        os._exit(INTERRUPTED_STATUS)


@contextmanager
def sigint_exits():
    """While the block runs, SIGINT ends the process at once (module docstring). Only in the
    main thread and only when SIGINT has Python's default handler (an ignored SIGINT, as in a
    background job, or a handler of the caller's stays); the previous handler is restored
    after the block."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    signal.signal(signal.SIGINT, _exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)

"""Ctrl-C and SIGTERM in ``kvstore serve``'s start-up and close (and in ``kvstore inspect``).

Python raises ``KeyboardInterrupt`` at the next bytecode after SIGINT, wherever that is. Inside
``import torch``, a torch op or numpy's lazy imports (C++ that calls back into Python) that
exception can be swallowed, so the daemon went on to listen as if no Ctrl-C had come (seen once
in 24 tries of SIGINT 0.5-1.65 s after ``kvstore serve`` started), or make the interpreter kill
itself with SIGINT at exit although the exception was caught (status -2, twice in those 24).
``sigint_exits`` replaces that exception, while active, by an immediate exit: stdout and stderr
flushed, one line ``kvstore CMD: interrupted`` on stderr, ``os._exit(130)`` (128 + SIGINT, as a
shell reports it). The entry point (``kvstore.daemon.entry``) uses it while the command line's
modules load; ``serve`` uses it until the server listens and takes SIGINT itself (a
graceful drain); nothing before that needs cleaning up (a disk tier opened is left as after a
crash: consistent). ``inspect`` only reads, so it uses it throughout. While the store closes,
``exit_on_another_signal`` makes a second signal exit at once too.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager, suppress
from typing import Any

#: exit status of an interrupted command (128 + SIGINT)
INTERRUPTED_STATUS = 130


@contextmanager
def sigint_exits(cmd: str = ""):
    """While the block runs, SIGINT ends the process at once with ``kvstore CMD: interrupted``
    (``kvstore: interrupted`` without a ``cmd``; module docstring). Only in the main thread and only when SIGINT has Python's default
    handler (an ignored SIGINT, as in a background job, or a caller's own handler stays). At
    the end of the block the default handler is put back unless someone (the server's event
    loop) has replaced ours meanwhile."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    line = f"kvstore{' ' + cmd if cmd else ''}: interrupted\n".encode()

    def exit_now(signum, frame) -> None:
        # (a flush fails when the signal cut a write of the main thread short: exit anyway)
        with suppress(Exception):
            sys.stdout.flush()
        with suppress(Exception):
            sys.stderr.flush()
        with suppress(OSError):
            os.write(2, line)
        os._exit(INTERRUPTED_STATUS)

    signal.signal(signal.SIGINT, exit_now)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is exit_now:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_on_another_signal() -> dict:
    """While the store closes, SIGTERM/SIGINT exit at once with one line saying how many
    chunks of the memory tiers were not persisted (``kvstore.daemon.run.force_exit``, status
    130): the disk tier keeps what its writer committed, as after a crash. Returns the
    previous handlers (``restore_signals``); none are changed off the main thread."""
    from kvstore.close_persist import PROGRESS
    from kvstore.daemon.run import force_exit

    def again(signum: int, _frame: Any) -> None:
        what = (f"{PROGRESS.left} of {PROGRESS.todo} chunks of the memory tiers not persisted"
                if PROGRESS.running else "queued disk writes not flushed")
        force_exit(f"{signal.Signals(signum).name} again: exiting now, while closing the "
                   f"store ({what})")
    previous = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, again)
    except ValueError:  # not the main thread (an embedding caller): its handlers stay
        pass
    return previous


def restore_signals(previous: dict) -> None:
    """Put back the handlers ``exit_on_another_signal`` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)

"""``CauseLog``: warnings about a failing operation, logged once per kind of operation *and
cause*, logged anew after the operation worked again, rate-limited, with one INFO line when it
works again.

The cause of a failure (``cause_of``) is the error's class, its HTTP status when it has one
(``RemoteError.status``) and the first 60 characters of its message with numbers (ports, sizes,
seconds, retry counts) left out, so a store that first refuses connections and later answers
400 logs both, while "connection refused (2 tries)" and "(3 tries)" are one cause. Used by the
connectors' counters (``connectors.engine_min_stats``) and by ``kvstore.layered.LayeredStore``.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

_NUMBERS = re.compile(r"\d+(?:\.\d+)?")


def cause_of(exc: BaseException) -> str:
    """What tells one failure's cause from another: ``"Class|status|message prefix"``, the
    status empty without one, the first 60 characters of ``str(exc)`` with every number as
    ``#``."""
    status = getattr(exc, "status", "")
    return f"{type(exc).__name__}|{status}|{_NUMBERS.sub('#', str(exc))[:60]}"


class CauseLog:
    """Per-kind failure warnings (module docstring). Thread-safe.

    ``warn`` logs a failure unless its kind logged the same cause and has not recovered since;
    ``failed`` counts a failure that is not to be logged (a call a circuit breaker skipped);
    ``recovered`` ends a kind's failures: its causes may be logged again, and when one had been
    logged an INFO line says the kind works again, with the failures since it last worked.

    Args:
        logger: where the lines go.
        works_again: the INFO line's format, ``% (kind, failures)``.
        suffix: appended to every warning.
        clock: monotonic time source (seconds), for tests.

    Attributes:
        relog_interval_s: a cause seen again after a recovery (or a new cause past
            ``max_causes``) is logged at most once per this many seconds per kind; new causes
            are not held back.
        max_causes: distinct causes per kind logged as they come; further new causes are
            rate-limited like old ones (bounds the memory an ever-changing message takes).
    """

    relog_interval_s = 30.0
    max_causes = 32

    def __init__(self, logger: logging.Logger,
                 works_again: str = "%s works again (%d failures since it last worked)",
                 suffix: str = " (logged once per cause until it recovers)",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._works_again, self._suffix, self._clock = (logger, works_again,
                                                                   suffix, clock)
        self._cause_lock = threading.Lock()
        self._quiet: set[tuple[str, str]] = set()   # (kind, cause) logged, not recovered
        self._causes: dict[str, set[str]] = {}       # kind -> causes ever logged
        self._last_line: dict[str, float] = {}       # kind -> clock time of its last line
        self._failures: dict[str, int] = {}          # kind -> failures since its last success

    def failed(self, kind: str) -> None:
        """Count a ``kind`` failure without logging it (it shows in the next INFO line)."""
        with self._cause_lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1

    def warn(self, kind: str, msg: str, *args, cause: BaseException | None = None) -> bool:
        """Count a ``kind`` failure and log ``msg % args`` (+ the suffix) at WARNING unless
        this kind already logged the same cause and has not recovered since, or the rate
        limit holds it back. ``cause``: the error (default: the first exception in ``args``);
        without one the cause is the message with numbers left out. Returns whether it
        logged."""
        if cause is None:
            cause = next((a for a in args if isinstance(a, BaseException)), None)
        sig = cause_of(cause) if cause is not None else _NUMBERS.sub("#", msg % args)[:120]
        now = self._clock()
        with self._cause_lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            if (kind, sig) in self._quiet:
                return False
            seen = self._causes.setdefault(kind, set())
            fresh = sig not in seen and len(seen) < self.max_causes
            last = self._last_line.get(kind)
            if not fresh and last is not None and now - last < self.relog_interval_s:
                return False   # rate-limited: logged when it happens again later
            self._quiet.add((kind, sig))
            seen.add(sig)
            self._last_line[kind] = now
        self._log.warning(msg + self._suffix, *args)
        return True

    def recovered(self, kind: str) -> None:
        """A ``kind`` operation succeeded: the causes it logged may be logged again when they
        come back; when one had been logged, an INFO line (``works_again``) says so. Cheap
        when ``kind`` has no failure (no lock taken)."""
        if kind not in self._failures:   # the common case; a racing failure waits a call
            return
        with self._cause_lock:
            failures = self._failures.pop(kind, 0)
            if not failures:
                return
            had = {k for k in self._quiet if k[0] == kind}
            self._quiet -= had
        if had:
            self._log.info(self._works_again, kind, failures)

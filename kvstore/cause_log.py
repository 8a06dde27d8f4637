"""``CauseLog``: warnings about a failing operation, logged once per kind of operation *and
cause*, logged anew after the operation worked again, rate-limited, with one INFO line when it
works again.

The cause of a failure (``cause_of``) is the error's class, its HTTP status when it has one
(``RemoteError.status``) and the first 60 characters of its message with numbers (ports, sizes,
seconds, retry counts) left out, so a store that first refuses connections and later answers
400 logs both, while "connection refused (2 tries)" and "(3 tries)" are one cause. Used by the
connectors' counters (``connectors.engine_min_stats``) and by ``kvstore.layered.LayeredStore``.

``OutageLog``: when to log one outage of one service (the daemon behind
``kvstore.circuit_store.CircuitBreakerStore``, a Redis node of ``kvstore.tiers.remote``): when
it goes down, then at most once per ``relog_s`` (10 min) while it stays down, sooner (at most
once a minute) when the cause of its failures changes (a refused connection, then refused
credentials), and once when it answers again.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
#: least seconds between an outage's last line and one that says its cause changed
CAUSE_RELOG_S = 60.0


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


class OutageLog:
    """When to log one outage of one service (module docstring). Thread-safe.

    The caller logs; this says which line: ``failed`` for each failure (``"down"`` for the
    first of an outage, ``(seconds down, failed calls)`` once ``relog_s`` has passed since the
    outage's last line, or sooner when the failure's cause changed, else None), ``recovered``
    when the service answers again.

    Args:
        relog_s: least seconds between two lines of one outage (> 0).
        clock: monotonic time source (seconds), for tests.

    Attributes:
        relog_s: as given; may be changed.

    Raises:
        ValueError: ``relog_s`` not > 0.
    """

    def __init__(self, relog_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not relog_s > 0:
            raise ValueError(f"OutageLog needs relog_s > 0, got {relog_s}")
        self.relog_s, self._clock = relog_s, clock
        self._lock = threading.Lock()
        self._since: float | None = None   # clock time of the outage's first failure
        self._logged = 0.0                  # clock time of its last line
        self._failures = 0                  # failed calls in the outage
        self._cause: str | None = None      # the cause its last line named

    @property
    def down(self) -> bool:
        """Whether an outage is under way (a failure since the last recovery)."""
        return self._since is not None

    def failed(self, failures: int | None = None, cause: str | None = None
               ) -> str | tuple[float, int] | None:
        """A failure now. ``failures``: the outage's failed calls so far, as the caller counts
        them (None: one more than before). ``cause``: what failed this time, short (e.g. the
        error's class: a refused connection, then refused credentials); None: not told.

        Returns:
            ``"down"`` when it starts an outage; ``(seconds down, failed calls)`` when
            ``relog_s`` seconds have passed since the outage's last line, or when ``cause``
            differs from the one the outage's last line named and ``CAUSE_RELOG_S`` have
            passed since that line (this one is then the last, and names the new cause);
            else None (log nothing).
        """
        now = self._clock()
        with self._lock:
            if self._since is None:
                self._since, self._logged, self._cause = now, now, cause
                self._failures = 1 if failures is None else failures
                return "down"
            self._failures = self._failures + 1 if failures is None else failures
            changed = (cause is not None and cause != self._cause
                       and now - self._logged >= min(CAUSE_RELOG_S, self.relog_s))
            if now - self._logged < self.relog_s and not changed:
                return None
            self._logged = now
            if cause is not None:
                self._cause = cause
            return now - self._since, self._failures

    def recovered(self) -> tuple[float, int] | None:
        """The service answered: ends the outage. Returns ``(seconds it was down, failed
        calls)``, or None when there was no outage (log nothing)."""
        if self._since is None:   # the common case, without the lock
            return None
        now = self._clock()
        with self._lock:
            since, self._since = self._since, None
            if since is None:
                return None
            return now - since, self._failures

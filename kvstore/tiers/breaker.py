"""A circuit breaker per Redis node: stop sending to a node that keeps failing, try it again
after a pause.

States (the usual three): ``closed`` (requests go through), ``open`` (after
``failure_threshold`` consecutive failures: requests are refused at once for ``reset_s``
seconds, so a dead or hung node costs misses, not waits), ``half_open`` (after the pause: one
request is let through; its success closes the breaker, its failure opens it again).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
#: gauge value of each state (``kvstore_remote_breaker_state``)
STATE_VALUE = {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}


class CircuitBreaker:
    """Breaker of one node (thread-safe).

    Args:
        failure_threshold: consecutive failures that open it (>= 1).
        reset_s: seconds it stays open before one trial request (> 0).
        on_change: ``on_change(new_state)`` after each state change.
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: a threshold < 1 or a pause <= 0.
    """

    def __init__(self, failure_threshold: int = 3, reset_s: float = 5.0,
                 on_change: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1 or not reset_s > 0:
            raise ValueError(f"breaker needs failure_threshold >= 1 and reset_s > 0, got "
                             f"{failure_threshold} and {reset_s}")
        self.failure_threshold, self.reset_s = failure_threshold, reset_s
        self._on_change = on_change or (lambda state: None)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial = False
        self.opens = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.reset_s:
                return HALF_OPEN
            return self._state

    @property
    def failures(self) -> int:
        """Consecutive failures since the node last answered (0 after a success)."""
        return self._failures

    def allow(self) -> bool:
        """Whether a request may go to the node now (half-open: only the first caller)."""
        changed = None
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN:
                if self._clock() - self._opened_at < self.reset_s:
                    return False
                self._state, self._trial, changed = HALF_OPEN, False, HALF_OPEN
            if self._trial:
                ok = False
            else:
                self._trial, ok = True, True
        if changed:
            self._on_change(changed)
        return ok

    def success(self) -> None:
        """The node answered."""
        with self._lock:
            changed = self._state != CLOSED
            self._state, self._failures, self._trial = CLOSED, 0, False
        if changed:
            self._on_change(CLOSED)

    def failure(self) -> None:
        """The node failed (connection error, timeout, an answer past the deadline)."""
        with self._lock:
            self._failures += 1
            opening = self._state == HALF_OPEN or (
                self._state == CLOSED and self._failures >= self.failure_threshold)
            if opening:
                self._state, self._opened_at, self._trial = OPEN, self._clock(), False
                self.opens += 1
        if opening:
            self._on_change(OPEN)

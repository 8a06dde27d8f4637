"""``CircuitBreakerStore``: a remote ``KVStoreBase`` (the daemon client) behind a circuit
breaker, so a dead daemon costs ~nothing per request: after a call fails with an unavailability
error (timeout, refused or reset connection, 5xx), remote calls are skipped (``RemoteSkipped``,
at once) for a cool-down (2 s, doubling per consecutive failure up to 30 s); then one call
probes. A dead daemon is logged when the breaker opens, then at most once per
``CircuitBreakerStore.down_relog_s`` (10 min) while its probes keep failing, and once at INFO
when it answers again. ``kvstore.layered`` re-exports both names.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch

from kvstore.api import KVStoreBase, LookupResult, StoreCapabilities
from kvstore.cause_log import OutageLog, cause_of
from kvstore.errors import RemoteError, StoreUnavailable
from kvstore.keys import ChunkKey, Namespace

log = logging.getLogger("kvstore.layered")   # the name its lines always had


class RemoteSkipped(StoreUnavailable):
    """A remote call was not made: ``CircuitBreakerStore`` is cooling down after a failure."""


def _is_unavailable(exc: BaseException) -> bool:
    """True for failures that mean the remote cannot serve now (dead, hung, overloaded): a
    deadline or connection error, or a 5xx answer. Bad input (ValueError) and 4xx do not."""
    if isinstance(exc, RemoteError):
        return exc.status >= 500
    return isinstance(exc, (TimeoutError, OSError))


class CircuitBreakerStore(KVStoreBase):
    """A remote ``KVStoreBase`` (``KVStoreClient``) behind a circuit breaker.

    Closed: calls go to ``remote``. A call failing as unavailable (timeout, refused or reset
    connection, 5xx) re-raises and opens the breaker for ``cooldown_s`` seconds, doubled for
    each consecutive failure up to ``max_cooldown_s``. Open: every call raises ``RemoteSkipped``
    at once and counts in ``skipped_calls``. When the cool-down ends one call probes the remote
    (others still skip until it returns): success closes the breaker and resets the cool-down.

    Args:
        remote: the store to protect.
        cooldown_s: first cool-down after a failure (seconds, > 0).
        max_cooldown_s: longest cool-down (seconds, >= cooldown_s).
        clock: monotonic time source (seconds), for tests.
        put_timeout_s: deadline of one ``put_chunks`` (seconds; None: the remote's default).
            Saves run in the background, so they get far longer than lookups: a large save on
            a busy host must not time out, trip the breaker and so cost the next lookups.
        get_timeout_s_per_chunk: with it, ``get_chunks`` of n keys has the deadline
            ``get_timeout_s_base + n * get_timeout_s_per_chunk`` (seconds), matching the
            connector's per-step load deadline; None: the remote's default.
        get_timeout_s_base: see ``get_timeout_s_per_chunk`` (seconds).

    Logging (logger ``kvstore.layered``): a WARNING when the breaker opens after the remote
    worked, naming the failure; while it stays down (probes failing), one WARNING per
    ``down_relog_s`` at most, with the time it has been down and the failed probes; an INFO
    line when a call succeeds again, with the time it was down.

    Attributes:
        url: ``remote.url`` (None if it has none).
        skipped_calls: calls answered with ``RemoteSkipped`` (never sent).
        trips: times the breaker opened.
        down_relog_s: seconds between two WARNING lines of one outage (default 600).

    Raises:
        ValueError: a non-positive ``cooldown_s`` or ``max_cooldown_s < cooldown_s``.
    """

    def __init__(self, remote: KVStoreBase, *, cooldown_s: float = 2.0,
                 max_cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 put_timeout_s: float | None = None,
                 get_timeout_s_per_chunk: float | None = None,
                 get_timeout_s_base: float = 0.5):
        if not 0 < cooldown_s <= max_cooldown_s:
            raise ValueError(f"need 0 < cooldown_s <= max_cooldown_s, got {cooldown_s}, "
                             f"{max_cooldown_s}")
        self.remote = remote
        self.url = getattr(remote, "url", None)  # (for messages only)
        self.put_timeout_s = put_timeout_s
        self.get_timeout_s_per_chunk = get_timeout_s_per_chunk
        self.get_timeout_s_base = get_timeout_s_base
        self.cooldown_s, self.max_cooldown_s, self._clock = cooldown_s, max_cooldown_s, clock
        self.skipped_calls = 0
        self.trips = 0
        self._outage = OutageLog(600.0, clock)
        self._next_cooldown = cooldown_s
        self._open_until: float | None = None   # None: closed
        self._probing = False
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> StoreCapabilities:
        """Remote (calls go to the protected store, may block up to its deadline, or are
        skipped); its pins; one ``"remote"`` tier. Nothing else is forwarded."""
        return StoreCapabilities(remote=True, pins=self.remote.capabilities.pins,
                                 tiers=("remote",))

    @property
    def is_open(self) -> bool:
        """True while calls are being skipped (cooling down, or a probe is in flight)."""
        with self._lock:
            return self._open_until is not None and (
                self._probing or self._clock() < self._open_until)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        probe = False
        with self._lock:
            if self._open_until is not None:
                now = self._clock()
                if now < self._open_until or self._probing:
                    self.skipped_calls += 1
                    left = max(0.0, self._open_until - now)
                    raise RemoteSkipped(f"remote {what} skipped: the store at {self.url} failed "
                                        f"recently (retry in {left:.1f} s)")
                self._probing = probe = True
        try:
            out = fn(*args)
        except BaseException as exc:
            line = None
            with self._lock:
                if probe:
                    self._probing = False
                if _is_unavailable(exc):
                    now = self._clock()
                    cooldown = self._next_cooldown
                    self._next_cooldown = min(cooldown * 2, self.max_cooldown_s)
                    self._open_until = now + cooldown
                    self.trips += 1
                    line = self._outage.failed(cause=cause_of(exc))
            if line == "down":
                log.warning("remote store %s %s failed (%s: %s); skipping it for %.1f s, then "
                            "probing it (a failed probe is logged at most every %.0f s)",
                            self.url, what, type(exc).__name__, exc, cooldown,
                            self.down_relog_s)
            elif line is not None:
                log.warning("remote store %s still down after %.0f s (%d failed calls since "
                            "the first; the last, %s: %s: %s); skipping it for %.1f s",
                            self.url, line[0], line[1] - 1, what, type(exc).__name__, exc,
                            cooldown)
            raise
        with self._lock:
            if probe:
                self._probing = False
            self._open_until, self._next_cooldown = None, self.cooldown_s
            back = self._outage.recovered()
        if back is not None:
            log.info("remote store %s answers again (down %.1f s, %d failed calls)", self.url,
                     *back)
        return out

    @property
    def down_relog_s(self) -> float:
        """Least seconds between two WARNING lines of one outage (default 600; settable)."""
        return self._outage.relog_s

    @down_relog_s.setter
    def down_relog_s(self, seconds: float) -> None:
        self._outage.relog_s = seconds

    def breaker_stats(self) -> dict:
        """``{"remote_skipped_calls", "remote_breaker_trips", "remote_breaker_open"}``."""
        return {"remote_skipped_calls": self.skipped_calls, "remote_breaker_trips": self.trips,
                "remote_breaker_open": self.is_open}

    def lookup_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> LookupResult:
        return self._call("lookup", self.remote.lookup_keys, ns, keys)

    def get_chunks(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[torch.Tensor | None]:
        if self.get_timeout_s_per_chunk is None:
            return self._call("get", self.remote.get_chunks, ns, keys)
        timeout = self.get_timeout_s_base + self.get_timeout_s_per_chunk * len(keys)
        return self._call("get", functools.partial(self.remote.get_chunks, timeout_s=timeout),
                          ns, keys)

    def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   kvs: Sequence[torch.Tensor],
                   parents: Sequence[ChunkKey | None] | None = None) -> int:
        args = (ns, keys, kvs) if parents is None else (ns, keys, kvs, parents)
        if self.put_timeout_s is None:
            return self._call("put", self.remote.put_chunks, *args)
        return self._call("put", functools.partial(self.remote.put_chunks,
                                                   timeout_s=self.put_timeout_s), *args)

    def exists(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[bool]:
        return self._call("exists", self.remote.exists, ns, keys)

    def remove(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        return self._call("remove", self.remote.remove, ns, keys)

    def demote(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        return self._call("demote", self.remote.demote, ns, keys)

    def clear(self, ns: Namespace | None = None) -> int:
        return self._call("clear", self.remote.clear, ns)

    def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None) -> int:
        return self._call("pin", self.remote.pin, ns, keys, lease_s)

    def unpin(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        return self._call("unpin", self.remote.unpin, ns, keys)

    def stats(self) -> dict:
        return self._call("stats", self.remote.stats)

    def close(self) -> None:
        self.remote.close()

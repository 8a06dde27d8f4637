"""``LayeredStore``: in-process tiers in front of a remote daemon, as one ``KVStoreBase``.

Reads try the local store first and fetch only its misses from the remote one (and copy what
came back into the local store); writes go to both (write-through, so other engines sharing the
daemon see them). The remote store failing (dead daemon, timeout) never fails a local read or
write: the remote part is counted as an error and skipped, logged once.

Hit tiers: local tier names (``"cpu"``, ``"disk"``...) then ``"remote:<daemon tier>"``.

``CircuitBreakerStore`` wraps the remote store so a dead daemon costs ~nothing per request: after
a call fails with an unavailability error, remote calls are skipped (``RemoteSkipped``, at once)
for a cool-down (2 s, doubling per consecutive failure up to 30 s); then one call probes.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch

from kvstore.api import KVStoreBase, LookupResult, StoreCapabilities
from kvstore.errors import RemoteError, StoreUnavailable
from kvstore.keys import ChunkKey, Namespace

log = logging.getLogger("kvstore.layered")


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

    Attributes:
        url: ``remote.url`` (None if it has none).
        skipped_calls: calls answered with ``RemoteSkipped`` (never sent).
        trips: times the breaker opened.

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
            with self._lock:
                if probe:
                    self._probing = False
                if _is_unavailable(exc):
                    cooldown = self._next_cooldown
                    self._next_cooldown = min(cooldown * 2, self.max_cooldown_s)
                    self._open_until = self._clock() + cooldown
                    self.trips += 1
                    trip = True
                else:
                    trip = False
            if trip:
                log.warning("remote store %s %s failed (%s: %s); skipping it for %.1f s",
                            self.url, what, type(exc).__name__, exc, cooldown)
            raise
        with self._lock:
            if probe:
                self._probing = False
                log.info("remote store %s answers again", self.url)
            self._open_until, self._next_cooldown = None, self.cooldown_s
        return out

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


def remote_breaker(store: KVStoreBase) -> CircuitBreakerStore | None:
    """The ``CircuitBreakerStore`` of ``store``: itself, or a ``LayeredStore``'s remote."""
    if isinstance(store, CircuitBreakerStore):
        return store
    remote = store.remote if isinstance(store, LayeredStore) else None
    return remote if isinstance(remote, CircuitBreakerStore) else None


class LayeredStore(KVStoreBase):
    """Local ``KVStoreBase`` (usually ``ChunkStore``) in front of a remote one (``KVStoreClient``).

    Args:
        local: the in-process store.
        remote: the remote store.

    Attributes:
        remote_errors: remote calls that raised (each also skipped); calls a
            ``CircuitBreakerStore`` remote skipped (``RemoteSkipped``) are counted there.
    """

    def __init__(self, local: KVStoreBase, remote: KVStoreBase):
        self.local, self.remote = local, remote
        self.remote_errors = 0
        self._warned = False
        self._lock = threading.Lock()

    def _remote_failed(self, what: str, exc: BaseException) -> None:
        if isinstance(exc, RemoteSkipped):  # not sent; the breaker counts it
            return
        with self._lock:
            self.remote_errors += 1
            first, self._warned = not self._warned, True
        if first:
            log.warning("remote store %s failed (%s: %s); serving from local tiers only "
                        "(logged once)", what, type(exc).__name__, exc)

    def lookup_keys(self, ns: Namespace, keys: Sequence[ChunkKey]) -> LookupResult:
        loc = self.local.lookup_keys(ns, keys)
        tiers = list(loc.tiers)
        n = loc.num_hit_chunks
        if n < len(keys):
            try:
                rem = self.remote.lookup_keys(ns, keys[n:])
                tiers += [f"remote:{t}" for t in rem.tiers[:rem.num_hit_chunks]]
            except Exception as exc:  # noqa: BLE001 - remote trouble means a local-only answer
                self._remote_failed("lookup", exc)
        return LookupResult(len(tiers), ns.layout.chunk_size, tuple(tiers), len(keys))

    @property
    def capabilities(self) -> StoreCapabilities:
        """Remote when either part is (a local miss waits for the remote store);
        ``get_chunks`` takes ``parents`` (it copies remote hits into the local store); pins
        are the local store's; tiers: the local ones, then ``"remote"`` (lookups name remote
        hits ``"remote:<daemon tier>"``). Direct I/O and durable puts are not offered (they
        would bypass the remote store)."""
        loc, rem = self.local.capabilities, self.remote.capabilities
        return StoreCapabilities(remote=loc.remote or rem.remote, pins=loc.pins,
                                 get_takes_parents=True, tiers=loc.tiers + ("remote",))

    def get_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   parents: Sequence[ChunkKey | None] | None = None) -> list[torch.Tensor | None]:
        """Local chunks, then the local misses from the remote store; those are copied into
        the local store with their parents: ``parents`` (as ``put_chunks`` takes them), or,
        when None, key i-1 for key i (the keys taken as consecutive chunks of one prompt) and
        ``keys[0]``, whose parent is unknown then, not copied (a copy with a wrong parent
        could outlive its prefix)."""
        out = list(self.local.get_chunks(ns, keys))
        miss = [i for i, kv in enumerate(out) if kv is None]
        if miss:
            try:
                got = self.remote.get_chunks(ns, [keys[i] for i in miss])
            except Exception as exc:  # noqa: BLE001
                self._remote_failed("get", exc)
                return out
            fetched_keys, fetched, fetched_parents = [], [], []
            for i, kv in zip(miss, got):
                out[i] = kv
                if kv is not None and (parents is not None or i > 0):
                    fetched_keys.append(keys[i])
                    fetched.append(kv)
                    fetched_parents.append(parents[i] if parents is not None else keys[i - 1])
            if fetched:
                self.local.put_chunks(ns, fetched_keys, fetched, fetched_parents)
        return out

    def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                   kvs: Sequence[torch.Tensor],
                   parents: Sequence[ChunkKey | None] | None = None) -> int:
        args = (ns, keys, kvs) if parents is None else (ns, keys, kvs, parents)
        n = self.local.put_chunks(*args)
        try:
            n = max(n, self.remote.put_chunks(*args))
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("put", exc)
        return n

    def exists(self, ns: Namespace, keys: Sequence[ChunkKey]) -> list[bool]:
        loc = self.local.exists(ns, keys)
        if all(loc):
            return loc
        try:
            rem = self.remote.exists(ns, keys)
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("exists", exc)
            return loc
        return [a or b for a, b in zip(loc, rem)]

    def remove(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        n = self.local.remove(ns, keys)
        try:
            n = max(n, self.remote.remove(ns, keys))
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("remove", exc)
        return n

    def demote(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        """Demote in the local store and in the remote one (a remote failure is counted and
        skipped); returns the larger count."""
        n = self.local.demote(ns, keys)
        try:
            n = max(n, self.remote.demote(ns, keys))
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("demote", exc)
        return n

    def clear(self, ns: Namespace | None = None) -> int:
        n = self.local.clear(ns)
        try:
            n = max(n, self.remote.clear(ns))
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("clear", exc)
        return n

    def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None) -> int:
        return self.local.pin(ns, keys, lease_s)

    def unpin(self, ns: Namespace, keys: Sequence[ChunkKey]) -> int:
        return self.local.unpin(ns, keys)

    def stats(self) -> dict:
        out = {"local": self.local.stats(), "remote_errors": self.remote_errors}
        try:
            out["remote"] = self.remote.stats()
        except Exception as exc:  # noqa: BLE001
            self._remote_failed("stats", exc)
        return out

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            self.remote.close()

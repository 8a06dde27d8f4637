"""Which path the synchronous client's calls take (``kvstore.daemon.client.KVStoreClient``):
``SocketPaths`` discovers the daemon's Unix socket over HTTP, runs calls on it, re-discovers
when it fails or answers from another daemon start (at most once per ``REDISCOVER_S``), and
asks again every ``RECHECK_HTTP_S`` while re-discovery has left calls on HTTP.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_discovery import discover_socket
from kvstore.daemon.shm_errors import SocketGone
from kvstore.errors import RemoteError, StoreUnavailable

log = logging.getLogger("kvstore.daemon.client")

#: Least time (seconds) between two re-discoveries of a failing discovered socket.
REDISCOVER_S = 2.0
#: Seconds between two asks, while re-discovery has left calls on HTTP, whether the daemon
#: offers a socket again (asked before a restart's socket listened, or restarted without one).
RECHECK_HTTP_S = 30.0


class SocketPaths:
    """The socket-path half of ``KVStoreClient`` (a base of it, which sets the attributes
    used here: ``_shm``, ``_async``, ``_instance``, ``_discovering``, ``_discover_lock``,
    ``_discovered_at``, ``_recheck_at``, ``_uses_lock``, ``_uses``, ``_retired``,
    ``_shm_kwargs``, ``url``, and the ``_run`` of HTTP calls)."""

    _shm: ShmKVStoreClient | None
    _discover_lock: threading.Lock

    def _path(self, timeout_s: float | None) -> ShmKVStoreClient | None:
        """The Unix-socket client calls go to, or None for HTTP (discovering it first).

        Raises:
            StoreUnavailable: the daemon did not answer the discovery (nothing decided: the
                next call asks again).
        """
        if self._discovering:
            with self._discover_lock:
                if self._discovering:
                    self._shm = self._discover(timeout_s)
                    self._instance = _instance_of(self._shm)
                    self._discovering = False
        if (self._recheck_at is not None and self._shm is None
                and time.monotonic() >= self._recheck_at):
            self._recheck(timeout_s)
        return self._shm

    def _recheck(self, timeout_s: float | None) -> None:
        """On HTTP since a re-discovery: ask the daemon whether it offers a socket now and
        take it (next ask in ``RECHECK_HTTP_S`` otherwise). Never raises."""
        with self._discover_lock:
            if self._shm is not None or time.monotonic() < (self._recheck_at or float("inf")):
                return
            self._recheck_at = time.monotonic() + RECHECK_HTTP_S
            try:
                new = self._discover(timeout_s)
            except (StoreUnavailable, RemoteError, RuntimeError, ValueError):
                return
            if new is not None:
                with self._uses_lock:
                    self._shm, self._instance, self._recheck_at = new, _instance_of(new), None
                log.warning("kvstore daemon offers its socket %s again; now using it", new.path)

    def _discover(self, timeout_s: float | None) -> ShmKVStoreClient | None:
        """``discover_socket`` over this client's HTTP path (raises as it)."""
        return discover_socket(lambda route: self._run(getattr(self._async, route)(
            timeout_s=timeout_s), timeout_s), self._shm_kwargs, timeout_s)

    def _rediscover(self, failed: ShmKVStoreClient, error: Exception | str,
                    timeout_s: float | None) -> bool:
        """After ``failed`` (the discovered socket's client) raised ``error``, or answered
        from another daemon start: ask the daemon over HTTP (``shm_discovery``) which socket
        it offers now and switch to it (None: HTTP), at most once per ``REDISCOVER_S``.
        Returns whether calls now take another path (a caller may retry a call that sent
        nothing). Never raises: a daemon that does not answer over HTTP either leaves the
        path as it is."""
        with self._discover_lock:
            if self._shm is not failed:
                return True  # another thread switched already
            now = time.monotonic()
            if now - self._discovered_at < REDISCOVER_S:
                return False
            self._discovered_at = now
            try:
                new = self._discover(timeout_s)
            except (StoreUnavailable, RemoteError, RuntimeError, ValueError) as e:
                log.info("kvstore daemon's socket %s failed (%s); re-discovery failed too (%s)",
                         failed.path, error, e)
                return False
            if new is not None and new.path == failed.path:
                self._instance = _instance_of(new)  # the same socket: the daemon restarted
                new.close()
                return False
            self._switch(failed, new)
            log.warning("kvstore daemon's socket %s failed (%s); now using %s", failed.path,
                        error, new.path if new is not None else self.url)
            return True

    def _hold(self) -> ShmKVStoreClient | None:
        """The socket client calls take now (None: HTTP), in use until ``_unhold``."""
        with self._uses_lock:
            shm = self._shm
            if shm is not None:
                self._uses[id(shm)] = self._uses.get(id(shm), 0) + 1
            return shm

    def _unhold(self, shm: ShmKVStoreClient) -> None:
        """End a use of ``shm``; the last use of a replaced client closes it."""
        with self._uses_lock:
            left = self._uses.pop(id(shm)) - 1
            if left:
                self._uses[id(shm)] = left
                return
            if not any(r is shm for r in self._retired):
                return
            self._retired = [r for r in self._retired if r is not shm]
        shm.close()

    def _switch(self, failed: ShmKVStoreClient, new: ShmKVStoreClient | None) -> None:
        """Calls take ``new`` (None: HTTP) from now on; ``failed`` is closed at once, or by
        the last call still on it (its connections, thread and arena mapping are not kept)."""
        with self._uses_lock:
            self._shm, self._instance = new, _instance_of(new)
            self._recheck_at = time.monotonic() + RECHECK_HTTP_S if new is None else None
            busy = id(failed) in self._uses
            if busy:
                self._retired.append(failed)
        if not busy:
            failed.close()

    def _via_socket(self, call, timeout_s: float | None) -> Any:
        """``call(shm)`` on the socket client calls take now, retried once on the new path
        after a re-discovery (``_on_socket``). Returns ``_HTTP`` when calls go over HTTP (the
        caller makes the HTTP call); raises the call's error."""
        self._path(timeout_s)
        for attempt in range(2):
            shm = self._hold()
            if shm is None:
                return _HTTP
            try:
                out = (self._on_socket(shm, call, timeout_s) if attempt == 0 else call(shm))
            finally:
                self._unhold(shm)
            if out is not _RETRY:
                return out
        raise AssertionError("unreachable")  # the second attempt never answers _RETRY

    def _on_socket(self, shm: ShmKVStoreClient, call, timeout_s: float | None) -> Any:
        """``call(shm)``; for a discovered socket (not a ``unix://`` URL) the socket gone
        (``SocketGone``: refused, no socket file) for a call that sent nothing or is
        idempotent, a refused hello (401: nothing sent), or an answer from another daemon
        start re-discovers (``_rediscover``). Returns ``_RETRY`` when the call should be made
        again on the new path; raises the call's error otherwise (any other failure: the
        call may have been sent, and is not sent twice)."""
        try:
            out = call(shm)
        except SocketGone as e:
            if self._async is None or not e.resendable or not self._rediscover(
                    shm, e, timeout_s):
                raise
            return _RETRY
        except RemoteError as e:  # 401 comes from the hello only: another daemon's socket
            if self._async is None or e.status != 401 or not self._rediscover(
                    shm, e, timeout_s):
                raise
            return _RETRY
        if self._async is not None and _instance_of(shm) != self._instance:
            self._rediscover(shm, "it answers from another daemon start", timeout_s)
        return out


#: ``_on_socket``'s answer when the call should be made again (the path changed)
_RETRY = object()
#: ``_via_socket``'s answer when calls go over HTTP
_HTTP = object()


def _instance_of(shm: ShmKVStoreClient | None) -> str | None:
    """The daemon start (``hello``'s ``instance``) ``shm`` greeted last, or None."""
    arena = shm._arenas.get("current") if shm is not None else None
    return arena.instance if arena is not None else None

"""Client of the kvstore daemon: ``AsyncKVStoreClient`` (aiohttp) and ``KVStoreClient``, a
thread-safe synchronous ``KVStoreBase`` with the same surface as the in-process store.

Deadlines: every call has a deadline (``timeout_s``, per client or per call). A dead, hung or
restarting server yields ``StoreUnavailable`` (a ``TimeoutError``) within that deadline, never a
hang. Retries (exponential backoff, inside the deadline) happen for idempotent calls (lookup,
exists, get, put of content-addressed chunks, remove, clear, stats) on connection errors and
503; pin/unpin are retried only when the connection could not be opened (nothing was sent).
A refused connection (nothing listens on the port: the daemon is down) or a host name that does
not resolve (a DNS failure; the message names the host) fails fast: after ``refused_tries``
attempts ``refused_backoff_s`` apart, not at the deadline. Deadlines and
retries are ``kvstore.daemon.transport``'s; the typed HTTP calls ``kvstore.daemon.async_client``'s
(re-exported here); this module is the synchronous client over both paths.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from typing import Any

import torch

from kvstore.api import KVStoreBase, LookupResult
from kvstore.daemon.async_client import AsyncKVStoreClient
from kvstore.daemon.shm_borrow import ArenaBorrow, CopiedBorrow
from kvstore.daemon.shm_client import CAPABILITIES as SHM_CAPABILITIES
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.shm_discovery import discover_socket
from kvstore.daemon.shm_errors import SocketGone
from kvstore.daemon.transport import check_timeout, check_url
from kvstore.daemon.wire_codec import WIRE_CODECS
from kvstore.errors import RemoteError, StoreUnavailable

__all__ = ["AsyncKVStoreClient", "KVStoreClient", "RemoteError", "StoreUnavailable", "check_url"]

log = logging.getLogger("kvstore.daemon.client")

#: Least time (seconds) between two re-discoveries of a failing discovered socket.
REDISCOVER_S = 2.0
#: Seconds between two asks, while re-discovery has left calls on HTTP, whether the daemon
#: offers a socket again (asked before a restart's socket listened, or restarted without one).
RECHECK_HTTP_S = 30.0


def _stop_loop(loop: asyncio.AbstractEventLoop, client: AsyncKVStoreClient,
               thread: threading.Thread) -> None:
    """Close ``client``'s pooled connections on ``loop``, then stop the loop and its thread."""
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # (collected on the loop thread itself)
        loop.call_soon(loop.stop)
        return
    try:
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(5)
    except Exception:  # noqa: BLE001 - best effort (at exit the loop may be gone already)
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    if not loop.is_running():
        loop.close()


class KVStoreClient(KVStoreBase):
    """Synchronous, thread-safe ``KVStoreBase`` over the daemon (same surface as ``ChunkStore``).

    Two paths behind one surface:

    * ``unix:///PATH``: the daemon's Unix socket, its CPU arena mapped read-only
      (``kvstore.daemon.shm_client.ShmKVStoreClient``; gets copy straight out of the arena).
    * ``http://HOST:PORT``: HTTP on one private event loop thread. With ``same_host=True``
      (the default) the first call asks the daemon (``/v1/whoami``, else ``/v1/stats``) for
      its ``unix_socket``; when that socket exists on this host and its ``hello`` answers the
      same ``instance``, every later call goes over it. HTTP stays otherwise (no socket,
      another host, a refused hello); ``same_host=False`` forces HTTP. When the discovered
      socket fails later (refused, its file gone: the daemon restarted without it, on
      another path, or was killed), the client asks the daemon again (at most once per
      ``REDISCOVER_S`` seconds) and takes what the daemon offers now: its new socket, or
      HTTP (asked again every ``RECHECK_HTTP_S`` s then: a socket offered later is taken);
      the replaced socket client is closed once the calls still on it end (its connections,
      thread and old arena mapping are not kept). A ``unix://`` URL is kept as given.

    Every method blocks at most its deadline (``timeout_s``) and raises ``StoreUnavailable``
    when the daemon does not answer in time, ``RemoteError`` for error answers, ``ValueError``
    for bad tensors. Other arguments as in ``AsyncKVStoreClient`` (both paths take them).
    ``/metrics`` (``metrics_text``) is served over HTTP only. ``wire_codec`` (as
    ``AsyncKVStoreClient``'s) applies to HTTP only: the same-host path moves exact bytes
    through memory, no network in between.
    """

    def __init__(self, url: str, *, same_host: bool = True, wire_codec: str = "raw",
                 **kwargs: Any):
        self._shm: ShmKVStoreClient | None = None
        self._async: AsyncKVStoreClient | None = None
        self._closed = False
        self._discovering = False
        self._uses_lock = threading.Lock()
        self._uses: dict[int, int] = {}  # id(socket client) -> calls in flight on it
        self._retired: list[ShmKVStoreClient] = []  # replaced, closed after their last call
        self._recheck_at: float | None = None  # on HTTP by re-discovery: when to ask again
        if wire_codec not in WIRE_CODECS:
            raise ValueError(f"unknown wire_codec {wire_codec!r}; choose one of "
                             f"{list(WIRE_CODECS)}")
        if isinstance(url, str) and url.startswith("unix://"):
            self._shm = ShmKVStoreClient(url, **kwargs)
            self.url = self._shm.url
            return
        self._async = AsyncKVStoreClient(url, wire_codec=wire_codec, **kwargs)
        self.url = self._async.url
        self._shm_kwargs = kwargs
        self._discovering = same_host
        self._discover_lock = threading.Lock()
        self._discovered_at = float("-inf")  # time.monotonic() of the last re-discovery
        self._instance: str | None = None  # the discovered socket's daemon start
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client",
                                        daemon=True)
        self._thread.start()
        # ``close``, or a client dropped or still open at exit: no "Unclosed client session"
        self._stop = weakref.finalize(self, _stop_loop, self._loop, self._async, self._thread)

    #: Every call crosses to the daemon (blocks up to its deadline); the daemon pins; its
    #: tiers are one ``"remote"`` tier here; ``get_chunks`` takes ``out=`` on both paths.
    capabilities = SHM_CAPABILITIES

    @property
    def transport(self) -> str:
        """``"unix"`` or ``"http"``: the path calls take now (``"http"`` until a first call
        has discovered the daemon's socket)."""
        return "unix" if self._shm is not None else "http"

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

    def _call(self, name: str, timeout_s: float | None, *args: Any, **kw: Any) -> Any:
        def call(c: ShmKVStoreClient) -> Any:
            return getattr(c, name)(*args, timeout_s=timeout_s, **kw)
        out = self._via_socket(call, timeout_s)
        if out is not _HTTP:
            return out
        return self._run(getattr(self._async, name)(*args, timeout_s=timeout_s, **kw),
                         timeout_s)

    def _run(self, coro, timeout_s: float | None) -> Any:
        if self._closed or self._async is None:
            coro.close()
            raise RuntimeError("KVStoreClient is closed")
        if timeout_s is not None:
            try:
                check_timeout(timeout_s)
            except ValueError:
                coro.close()
                raise
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        wait = (self._async.timeout_s if timeout_s is None else timeout_s) + 5.0
        try:
            return fut.result(wait)
        except TimeoutError:
            if fut.done():  # the call's own StoreUnavailable (a TimeoutError)
                raise
            fut.cancel()
            raise StoreUnavailable(f"{self.url}: no answer within {wait} s") from None
        except KeyboardInterrupt:  # Ctrl-C while waiting: the call stops with it
            fut.cancel()
            raise

    def lookup_keys(self, ns, keys, *, timeout_s=None) -> LookupResult:
        return self._call("lookup_keys", timeout_s, ns, keys)

    def get_chunks(self, ns, keys, out=None, *, timeout_s=None) -> list[torch.Tensor | None]:
        """As ``AsyncKVStoreClient.get_chunks`` (``out``: buffers to read into)."""
        return self._call("get_chunks", timeout_s, ns, keys, out)

    def get_borrowed(self, ns, keys, *, timeout_s=None) -> ArenaBorrow | CopiedBorrow:
        """The chunks of ``keys`` to read in place until ``release`` (the reader's side of
        ``kvstore.direct.BorrowedChunks``: ``parts`` per key, ``lower`` empty): over the Unix
        socket, read-only views of the daemon's arena held by its reader pins
        (``ShmKVStoreClient.get_borrowed``, no copy); over HTTP, the chunks ``get_chunks``
        copied out (so too over the socket for more keys than the daemon's max_batch_keys:
        split gets). Call ``release`` on every path. Raises as ``get_chunks``."""
        def call(c: ShmKVStoreClient) -> ArenaBorrow | CopiedBorrow:
            if c.limits is not None and len(keys) > c.limits.max_batch_keys:
                return CopiedBorrow(keys, c.get_chunks(ns, keys, timeout_s=timeout_s))
            return c.get_borrowed(ns, keys, timeout_s=timeout_s)
        out = self._via_socket(call, timeout_s)
        if out is not _HTTP:
            return out
        return CopiedBorrow(keys, self.get_chunks(ns, keys, timeout_s=timeout_s))

    def put_chunks(self, ns, keys, kvs, parents=None, *, durable=None, timeout_s=None) -> int:
        return self._call("put_chunks", timeout_s, ns, keys, kvs, parents, durable=durable)

    def exists(self, ns, keys, *, timeout_s=None) -> list[bool]:
        return self._call("exists", timeout_s, ns, keys)

    def remove(self, ns, keys, *, timeout_s=None) -> int:
        return self._call("remove", timeout_s, ns, keys)

    def demote(self, ns, keys, *, timeout_s=None) -> int:
        return self._call("demote", timeout_s, ns, keys)

    def clear(self, ns=None, *, timeout_s=None) -> int:
        return self._call("clear", timeout_s, ns)

    def pin(self, ns, keys, lease_s=None, *, timeout_s=None) -> int:
        return self._call("pin", timeout_s, ns, keys, lease_s)

    def unpin(self, ns, keys, *, timeout_s=None) -> int:
        return self._call("unpin", timeout_s, ns, keys)

    def stats(self, *, timeout_s=None) -> dict:
        return self._call("stats", timeout_s)

    def whoami(self, *, timeout_s=None) -> dict:
        return self._call("whoami", timeout_s)

    def metrics_text(self, *, timeout_s=None) -> str:
        """The daemon's Prometheus text (HTTP only).

        Raises:
            RemoteError(404): a ``unix://`` client (``/metrics`` is an HTTP route).
        """
        if self._async is None:
            raise RemoteError(404, "/metrics is served over HTTP only; ask the daemon's "
                                   "http:// URL")
        return self._run(self._async.metrics_text(timeout_s=timeout_s), timeout_s)

    def healthy(self, *, timeout_s: float = 1.0) -> bool:
        if self._async is None:
            return self._shm.healthy(timeout_s=timeout_s)
        return self._run(self._async.healthy(timeout_s=timeout_s), timeout_s)

    def close(self) -> None:
        """Close connections (the daemon drops a Unix connection's pins) and stop the loop
        thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._shm is not None:
            self._shm.close()
        with self._uses_lock:
            retired, self._retired = self._retired, []
        for old in retired:
            old.close()
        if self._async is not None:
            self._stop()


#: ``_on_socket``'s answer when the call should be made again (the path changed)
_RETRY = object()
#: ``_via_socket``'s answer when calls go over HTTP
_HTTP = object()


def _instance_of(shm: ShmKVStoreClient | None) -> str | None:
    """The daemon start (``hello``'s ``instance``) ``shm`` greeted last, or None."""
    arena = shm._arenas.get("current") if shm is not None else None
    return arena.instance if arena is not None else None

"""Client of the kvstore daemon: ``AsyncKVStoreClient`` (aiohttp) and ``KVStoreClient``, a
thread-safe synchronous ``KVStoreBase`` with the same surface as the in-process store.

Deadlines: every call has a deadline (``timeout_s``, per client or per call). A dead, hung or
restarting server yields ``StoreUnavailable`` (a ``TimeoutError``) within that deadline, never a
hang. Retries (exponential backoff, inside the deadline) happen for idempotent calls (lookup,
exists, get, put of content-addressed chunks, remove, clear, stats) on connection errors and
503; pin/unpin are retried only when the daemon cannot have read them: the connection could
not be opened, or the daemon had closed the pooled connection, leaving the request unread
(same-host path: ``kvstore.daemon.shm_pool``; HTTP: ``kvstore.daemon.transport.never_read``).
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
import weakref
from typing import Any

import torch

from kvstore.api import KVStoreBase, LookupResult
from kvstore.daemon.batches import DaemonLimits
from kvstore.daemon.async_client import AsyncKVStoreClient
from kvstore.daemon.put_result import PutResult
from kvstore.daemon.client_paths import (_HTTP, RECHECK_HTTP_S,  # noqa: F401 (re-exported)
                                         REDISCOVER_S, SocketPaths)
from kvstore.daemon.shm_borrow import ArenaBorrow, CopiedBorrow
from kvstore.daemon.shm_client import CAPABILITIES as SHM_CAPABILITIES
from kvstore.daemon.shm_client import ShmKVStoreClient
from kvstore.daemon.transport import check_timeout, check_url
from kvstore.daemon.wire_codec import WIRE_CODECS
from kvstore.errors import RemoteError, StoreUnavailable

__all__ = ["AsyncKVStoreClient", "KVStoreClient", "PutResult", "RemoteError", "StoreUnavailable",
           "check_url"]

log = logging.getLogger("kvstore.daemon.client")


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


class KVStoreClient(SocketPaths, KVStoreBase):
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
            return c.get_borrowed(ns, keys, timeout_s=timeout_s)
        out = self._via_socket(call, timeout_s)
        if out is not _HTTP:
            return out
        return CopiedBorrow(keys, self.get_chunks(ns, keys, timeout_s=timeout_s))

    def put_chunks(self, ns, keys, kvs, parents=None, *, durable=None,
                   timeout_s=None) -> PutResult:
        """As ``AsyncKVStoreClient.put_chunks`` on either path: the number of chunks newly
        stored, a ``PutResult`` (an ``int``) whose ``already_stored``, ``refused`` and
        ``first_refused`` (``{index, key, reason}``, index from ``keys[0]``, or None) say what
        the daemon did with the rest; ``refused``/``already_stored`` are None from an older
        daemon that does not answer them. A chunk refused ``parent_missing`` or ``no_room``
        means the chunks after it in this call were not stored by its request."""
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

    @property
    def limits(self) -> DaemonLimits | None:
        """The daemon's request limits (``--max-body-bytes``, ``--max-batch-keys``) as the
        path calls take now learned them (the socket's ``hello``, an HTTP answer's headers),
        or None before a first answer, or from an older daemon that names none."""
        if self._shm is not None:
            return self._shm.limits
        return self._async._http.limits if self._async is not None else None

    def request_limits(self, *, timeout_s: float | None = None) -> DaemonLimits | None:
        """``limits``, asking the daemon first (one ``whoami``) when no call has been
        answered yet: what a caller checks its chunk size against at start. None when the
        daemon does not answer, refuses the token, or names no limits. Never raises."""
        if self.limits is None:
            try:
                self.whoami(timeout_s=timeout_s)
            except (StoreUnavailable, RemoteError, RuntimeError, ValueError):
                return None
        return self.limits

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

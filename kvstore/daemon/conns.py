"""Connections of ``kvstore serve`` under hostile clients: a cap on open connections, quiet
and counted client errors, rate-limited ``accept()`` failures.

* Cap (``ConnectionGuard``): the listening socket's protocol factory is wrapped so every
  connection is counted. Connections of the same-host path (``kvstore.daemon.shm_server``)
  count against the same cap (``others``), so the two paths together stay within the
  descriptors the cap leaves. A connection of either path arriving at the cap closes one
  *idle* connection of either path, so a legitimate client is served at once even while idle
  sockets hold every slot: an HTTP connection that never sent a complete request first
  (oldest first), else the one idle longest (``idle_since``): an HTTP connection serving no
  request, or a same-host connection with no request in flight or begun and no borrowed
  arena pages outstanding (``other_idle``; its client reconnects on its next call). A
  same-host connection holding borrows is never closed: its client may be reading the pages.
  One closing path, rather than a share of the cap reserved per path, so that neither path
  can lock the other out (HTTP is how engines on other hosts reach the daemon) and neither
  path's share sits unused. When every connection is busy the newcomer gets ``503`` and is
  closed. Counted in ``kvstore_server_connections_closed_total{reason}``
  (``CLOSE_REASONS``). The default cap (``default_max_connections``)
  leaves file descriptors below ``RLIMIT_NOFILE`` for the store and for one burst of accepts
  (asyncio accepts up to ``ACCEPT_BATCH`` sockets per loop pass before any reaches the
  guard, while the kernel queues up to ``LISTEN_BACKLOG``), so ``accept()`` never runs out of
  descriptors because of connections.
* Idle timeout: aiohttp's ``keepalive_timeout`` (``RequestHandler``, aiohttp >= 3.14) closes a
  connection that has not sent a complete request's headers within that many seconds of
  connecting or of its last response: a silent socket, or one trickling a request line.
  Slow *bodies* are bounded by the request timeout (``ServerLimits.request_timeout_s``).
* Client errors (``ClientErrorLog``): aiohttp logs every malformed HTTP request at ERROR with
  a traceback; this logger counts them in ``kvstore_server_client_errors_total{reason}`` and
  logs them at DEBUG. Errors that are not the client's (500s) still go to the log at ERROR.
* ``accept()`` failures (EMFILE, ENFILE, ENOBUFS, ENOMEM: asyncio logs one traceback per
  failed call, hundreds a second): counted in ``kvstore_server_accept_errors_total`` and
  logged at most once per ``ACCEPT_LOG_INTERVAL_S``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from aiohttp import http_exceptions as H
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvstore.daemon.config import default_max_connections  # noqa: F401 (the cap's default)

log = logging.getLogger("kvstore.daemon.server")

#: The most sockets asyncio accepts in one loop pass (its ``backlog`` argument). Accepted
#: sockets reach the guard two passes later, so up to ~3 batches of descriptors are in flight
#: above the cap; kept small so that room is small (``default_max_connections``).
ACCEPT_BATCH = 16
#: The kernel's listen queue (``listen()`` backlog, capped by ``net.core.somaxconn``): large,
#: so a burst of connections waits in the queue instead of having its SYNs dropped (a 1 s+
#: client retry each).
LISTEN_BACKLOG = 1024
#: Seconds between two log lines about failing ``accept()`` calls (the rest are counted).
ACCEPT_LOG_INTERVAL_S = 10.0
#: Labels of ``kvstore_server_client_errors_total``: what was wrong with a request that aiohttp
#: refused before any route saw it, or ``disconnect`` (the client went away mid-request).
CLIENT_ERROR_REASONS = ("request_line", "header", "too_long", "body", "malformed", "disconnect")
#: Labels of ``kvstore_server_connections_closed_total``.
#: ``idle_evicted``: an idle HTTP connection closed to admit a new one;
#: ``idle_evicted_same_host``: an idle same-host one; ``refused_busy``: the new one, all busy.
CLOSE_REASONS = ("idle_evicted", "idle_evicted_same_host", "refused_busy")
#: ``kvstore serve``'s default ``--idle-timeout-s``.
DEFAULT_IDLE_TIMEOUT_S = 30.0
_REFUSAL_BODY = b'{"error": "connection limit reached; every connection is busy", "status": 503}'
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
            % (len(_REFUSAL_BODY), _REFUSAL_BODY))


def _reason(exc: BaseException | None) -> str | None:
    """The ``CLIENT_ERROR_REASONS`` label of an aiohttp parse error, None if not one."""
    if isinstance(exc, web.RequestPayloadError):  # a body error, met reading the body
        exc = exc.__cause__
    if isinstance(exc, H.LineTooLong):
        return "too_long"
    if isinstance(exc, (H.BadStatusLine, H.BadHttpMethod, H.InvalidURLError)):
        return "request_line"
    if isinstance(exc, H.InvalidHeader):
        return "header"
    if isinstance(exc, (H.TransferEncodingError, H.ContentLengthError, H.ContentEncodingError,
                        H.PayloadEncodingError)):
        return "body"
    if isinstance(exc, H.HttpProcessingError) and 400 <= (exc.code or 400) < 500:
        return "malformed"
    return None


class ClientErrorLog(logging.LoggerAdapter):
    """aiohttp's server ``logger`` (``web.AppRunner(logger=...)``): a malformed request (an
    ``aiohttp.http_exceptions`` 4xx error) is counted in ``counter`` by ``_reason`` and logged
    at DEBUG; every other record goes to ``aiohttp.server`` unchanged."""

    def __init__(self, counter: Counter):
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.counter = counter

    def _client_error(self, kw: dict) -> bool:
        exc = kw.get("exc_info")
        reason = _reason(exc if isinstance(exc, BaseException) else None)
        if reason is None:
            return False
        self.counter.labels(reason).inc()
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("client error (%s): %r", reason, exc)
        return True

    def exception(self, msg: Any, *args: Any, **kw: Any) -> None:
        if not self._client_error(kw):
            self.logger.exception(msg, *args, **kw)

    def error(self, msg: Any, *args: Any, **kw: Any) -> None:
        if not self._client_error(kw):
            self.logger.error(msg, *args, **kw)

    def debug(self, msg: Any, *args: Any, **kw: Any) -> None:
        if not self._client_error(kw):
            self.logger.debug(msg, *args, **kw)


class _Conn(asyncio.Protocol):
    """One accepted connection: forwards every callback to aiohttp's ``RequestHandler``
    (``inner``) and tells the guard when it opens and closes."""

    __slots__ = ("inner", "guard", "transport", "active", "served", "admitted", "idle_since")

    def __init__(self, inner: asyncio.Protocol, guard: "ConnectionGuard"):
        self.inner, self.guard = inner, guard
        self.transport: asyncio.Transport | None = None
        self.active = 0  # requests being served (set by the server middleware)
        self.served = 0  # requests seen
        self.admitted = False
        #: ``time.monotonic()`` when it was admitted or last finished a request
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.guard._admit(self):
            transport.write(_REFUSAL)  # type: ignore[attr-defined]
            transport.close()
            return
        self.admitted, self.idle_since = True, time.monotonic()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.admitted:
            self.admitted = False
            self.guard._lost(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class ConnectionGuard:
    """Counts and caps the open connections of one server (see the module docstring).

    Attributes:
        max_connections: the cap (0: none).
        idle_timeout_s: aiohttp's ``keepalive_timeout`` for the runner (seconds; None: aiohttp's
            default, 3,630 s); set before the runner is made (``runner_kwargs``).
        client_errors, closed, accept_errors: the Prometheus counters (see module docstring).
    """

    def __init__(self, registry: CollectorRegistry, max_connections: int = 0,
                 idle_timeout_s: float | None = None):
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._conns: dict[Any, _Conn] = {}  # by aiohttp RequestHandler, oldest first
        self.client_errors = Counter("kvstore_server_client_errors_total", "Malformed HTTP "
                                     "requests refused before any route, and clients gone "
                                     "mid-request, by reason", ["reason"], registry=registry)
        self.closed = Counter("kvstore_server_connections_closed_total", "Connections the "
                              "server closed at its connection cap (idle_evicted: an idle HTTP "
                              "one, idle_evicted_same_host: an idle same-host one, to admit "
                              "a new one; refused_busy: the new one, all others busy)",
                              ["reason"], registry=registry)
        self.accept_errors = Counter("kvstore_server_accept_errors_total", "accept() calls "
                                     "failed for lack of resources (EMFILE, ENFILE, ...)",
                                     registry=registry)
        for r in CLIENT_ERROR_REASONS:
            self.client_errors.labels(r)
        for r in CLOSE_REASONS:
            self.closed.labels(r)
        gauge = Gauge("kvstore_server_connections", "Open client connections", registry=registry)
        gauge.set_function(lambda: len(self._conns))
        self._last_accept_log = -float("inf")
        self._unlogged_accept_errors = 0
        #: open connections held outside this guard that share its cap (the same-host path's)
        self.others: Callable[[], int] = _none
        #: the longest-idle of those that may be closed: ``(idle since, time.monotonic()
        #: seconds; a function closing it)``, or None when none is idle
        self.other_idle: Callable[[], tuple[float, Callable[[], None]] | None] = _no_idle

    @property
    def open(self) -> int:
        """Connections open now."""
        return len(self._conns)

    def runner_kwargs(self) -> dict:
        """Keyword arguments of ``web.AppRunner``: the client-error logger, and the idle
        timeout when set."""
        kw: dict = {"logger": ClientErrorLog(self.client_errors)}
        if self.idle_timeout_s is not None:
            kw["keepalive_timeout"] = self.idle_timeout_s
        return kw

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """Protocol factory for ``loop.create_server`` wrapping ``inner`` (aiohttp's
        ``web.Server``)."""
        return lambda: _Conn(inner(), self)

    # ---- middleware hooks -------------------------------------------------------------------
    def begin(self, request: web.BaseRequest) -> _Conn | None:
        """A request starts on its connection (None: a connection this guard does not see)."""
        conn = self._conns.get(request.protocol)
        if conn is not None:
            conn.active += 1
            conn.served += 1
        return conn

    @staticmethod
    def end(conn: _Conn | None) -> None:
        """The request ``begin`` returned ``conn`` for is done."""
        if conn is not None:
            conn.active -= 1
            if not conn.active:
                conn.idle_since = time.monotonic()

    # ---- connection events ------------------------------------------------------------------
    def make_room(self) -> bool:
        """For a connection of another path that shares the cap (counted in ``others``
        already): True when the open connections are within the cap, or an idle one (of
        either path, ``_evict_idle``) was closed to make room; False when the newcomer should
        be refused (every connection busy)."""
        if not self.max_connections or len(self._conns) + self.others() <= self.max_connections:
            return True
        return self._evict_idle()

    def _admit(self, conn: _Conn) -> bool:
        if (self.max_connections and len(self._conns) + self.others() >= self.max_connections
                and not self._evict_idle()):
            return False
        self._conns[conn.inner] = conn
        return True

    def _evict_idle(self) -> bool:
        """Close one idle connection (True): an HTTP one that never sent a request, else the
        one idle longest of the HTTP ones (``_idle_victim``) and the same-host path's
        (``other_idle``); or count a refusal when every one is busy (False)."""
        victim = self._idle_victim()
        if victim is None or victim.served:
            other = self.other_idle()
            if other is not None and (victim is None or other[0] < victim.idle_since):
                self.closed.labels("idle_evicted_same_host").inc()
                other[1]()
                return True
        if victim is None:
            self.closed.labels("refused_busy").inc()
            return False
        self.closed.labels("idle_evicted").inc()
        self._drop(victim)
        victim.transport.close()  # type: ignore[union-attr]
        return True

    def _idle_victim(self) -> _Conn | None:
        """The oldest HTTP connection that never sent a request, else the one idle longest
        (serving no request, and none received: ``_awaiting_request``); None when every one
        is busy."""
        fallback = None
        for c in self._conns.values():
            if not c.active and _awaiting_request(c):
                if not c.served:
                    return c
                if fallback is None or c.idle_since < fallback.idle_since:
                    fallback = c
        return fallback

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.inner, None)

    def _lost(self, conn: _Conn) -> None:
        self._drop(conn)

    # ---- accept() failures ------------------------------------------------------------------
    def install_accept_log(self, loop: asyncio.AbstractEventLoop,
                           interval_s: float = ACCEPT_LOG_INTERVAL_S) -> None:
        """Make ``loop``'s exception handler count ``accept()`` resource failures and log them
        at most once per ``interval_s`` seconds (other contexts go to the previous handler)."""
        previous = loop.get_exception_handler()

        def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
            if str(context.get("message", "")).startswith("socket.accept() out of system"):
                self.accept_errors.inc()
                now = time.monotonic()
                if now - self._last_accept_log >= interval_s:
                    log.error("accept() failed: %r (%d more since the last report; open "
                              "connections %d, cap %d: lower --max-connections or raise "
                              "the file-descriptor limit)", context.get("exception"),
                              self._unlogged_accept_errors, len(self._conns),
                              self.max_connections)
                    self._last_accept_log, self._unlogged_accept_errors = now, 0
                else:
                    self._unlogged_accept_errors += 1
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)


def _awaiting_request(conn: _Conn) -> bool:
    """Whether aiohttp's handler of ``conn`` waits for its next request with none received
    (its ``start`` loop awaits a request and none is queued). Only such a connection is closed
    as idle: a request aiohttp parsed but has not begun serving (``active`` is set by the
    server's middleware, a loop pass later) would still be served after the close, its answer
    lost, so a client could not tell it from one the daemon never read
    (``kvstore.daemon.transport.never_read``). Bytes of a request still incomplete, or
    unread, are dropped with the connection, never acted on. True with an aiohttp whose
    handler lacks these attributes (the busy ``active`` count decides alone)."""
    inner = conn.inner
    if not hasattr(inner, "_waiter") or not hasattr(inner, "_messages"):
        return True
    waiter = inner._waiter
    return not inner._messages and waiter is not None and not waiter.done()


def _none() -> int:
    return 0


def _no_idle() -> None:
    return None


class GuardedTCPSite(web.TCPSite):
    """``web.TCPSite`` whose connections go through a ``ConnectionGuard``; asyncio accepts
    ``ACCEPT_BATCH`` sockets per loop pass from a kernel queue of ``LISTEN_BACKLOG``."""

    __slots__ = ("_guard",)

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 **kw: Any):
        super().__init__(runner, host, port, **kw)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        assert self._runner.server is not None
        self._server = await loop.create_server(
            self._guard.factory(self._runner.server), self._host, self._port,
            backlog=ACCEPT_BATCH, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        for s in self._server.sockets:  # a long kernel queue; asyncio keeps its small batch
            with s.dup() as listening:
                listening.listen(LISTEN_BACKLOG)
        self._bound_port = self._server.sockets[0].getsockname()[1]

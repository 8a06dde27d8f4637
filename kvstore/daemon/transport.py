"""HTTP transport of the daemon client: one logical call with a deadline and retries.

``Transport`` sends requests over a pooled aiohttp session. Every call has a deadline
(``timeout_s``, per transport or per call); a dead, hung or restarting server yields
``StoreUnavailable`` (a ``TimeoutError``) within it, never a hang. Idempotent calls are retried
(exponential backoff, inside the deadline) on connection errors and 503; others (``pin``,
``unpin``) only when the daemon cannot have read them (``never_read``): the connection could
not be opened, or a pooled keep-alive connection the daemon had closed failed before any
answer. A refused connection (nothing listens on the
port: the daemon is down) or a host name that does not resolve (a DNS failure: a typo in the
URL; not a temporary failure of the resolver, retried) fails fast: after ``refused_tries``
attempts ``refused_backoff_s`` apart, not at the deadline; so does a TLS handshake failure, at
once. The typed calls are
``kvstore.daemon.client``'s. Neither this module nor what it imports imports torch (the
``kvstore stats``/``clear`` commands use it directly).

Why a non-idempotent call sent on a reused keep-alive connection may be sent again, once, on a
fresh connection: the daemon closes an HTTP connection of its own accord only while it waits
for the next request with none received (aiohttp's keep-alive timeout closes only a handler
waiting with no request queued; the connection cap's eviction, ``kvstore.daemon.conns``, only
one whose handler waits so). A request that races such a close is therefore never read: it
arrives at a closed socket (the kernel resets the connection) or is dropped unread with it.
Seen from the client, the pooled connection fails before the answer's status line and headers
(aiohttp raises from the request itself, no response object): the server disconnected
(``ServerDisconnectedError``) or the connection was reset (``ECONNRESET``, ``EPIPE``,
"Cannot write to closing transport"). The same failure on a new connection is not retried (that
daemon read nothing yet of ours: it may have read this request, e.g. then crashed), nor a
failure after the answer's headers came, nor a timeout. A daemon that died after reading the
request also looks so; the fresh connection then finds no daemon (refused) or a restarted one
with none of the old pins. The same rule on the same-host path: ``kvstore.daemon.shm_pool``.
"""
from __future__ import annotations

import asyncio
import errno
import json
import socket
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvstore.daemon.batches import DaemonLimits, limits_from
from kvstore.daemon.wire_version import PROTOCOL_VERSION, VERSION_HEADER
from kvstore.errors import NotADaemon, RemoteError, StoreUnavailable


_CONNECT_ERRORS = (aiohttp.ClientConnectorError,)
_TRANSPORT_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                     aiohttp.ClientPayloadError, ConnectionResetError,
                     asyncio.IncompleteReadError)


#: ``errno`` of a ``ClientOSError`` that says the daemon had closed the connection
_RESET_ERRNOS = (errno.ECONNRESET, errno.EPIPE)


def never_read(attempt: SimpleNamespace, error: BaseException) -> bool:
    """Whether the daemon cannot have read the request of ``attempt`` that failed with
    ``error`` (see the module docstring): the attempt ran on a connection reused from the pool
    (``attempt.reused``), no answer's headers came (``attempt.answered`` false), and the server
    disconnected or reset the connection."""
    if not attempt.reused or attempt.answered:
        return False
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return True
    if isinstance(error, aiohttp.ClientOSError):
        return error.errno in _RESET_ERRNOS
    return isinstance(error, (ConnectionResetError, BrokenPipeError))


async def _on_reuse(session, ctx, params) -> None:
    """aiohttp trace: the attempt's connection came from the pool."""
    if isinstance(ctx.trace_request_ctx, SimpleNamespace):
        ctx.trace_request_ctx.reused = True


def check_url(url: str) -> str:
    """``url`` unchanged if it is a usable server URL (``http[s]://HOST[:PORT][/]``).

    Raises:
        ValueError: anything else (no scheme, another scheme, a ``unix://`` URL: the message
            says to give the ``http://`` one, no host, a bad port, a path such as ``/v1``, a
            query), naming the URL and the expected form.
    """
    want = f"malformed kvstore URL {url!r}: expected http://HOST:PORT"
    if not isinstance(url, str):
        raise ValueError(want)
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises on a bad port
    except ValueError as e:  # a port out of range or not a number
        raise ValueError(f"{want} ({e})") from None
    if parts.scheme == "unix":
        raise ValueError(f"{want}: a unix:// URL is the daemon's same-host path, which only "
                         f"KVStoreClient takes; give the daemon's http:// URL here")
    if parts.scheme not in ("http", "https"):
        raise ValueError(want)
    if not host:
        raise ValueError(f"{want} (no host)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{want}: no path, query or fragment (got "
                         f"{parts.path + ('?' + parts.query if parts.query else '')!r}); the "
                         f"client adds the routes (/v1/...) itself")
    return url


#: statuses a proxy in front of a daemon answers for it (the daemon down or restarting): an
#: answer of these without the daemon's header is not taken for another server's
_GATEWAY_STATUSES = (502, 503, 504)


class _Retry(Exception):
    """Internal: a 503 answer to an idempotent call."""


def check_timeout(value: Any, what: str = "timeout_s") -> float:
    """``value`` as a deadline in seconds: a finite number > 0.

    Raises:
        ValueError: anything else (0, a negative, NaN or infinite value, a bool, a string):
            such a deadline passed before any attempt and was reported as a dead daemon.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value < float("inf")):
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class Transport:
    """Pooled HTTP calls to one daemon, with deadlines and retries (see module docstring).

    Args:
        url: server base URL, e.g. ``"http://127.0.0.1:8500"``.
        auth_token: bearer token, if the server requires one.
        timeout_s: default per-call deadline in seconds (retries included).
        pool_size: most pooled connections (aiohttp connector limit).
        retry_backoff_s: first retry delay (doubles, capped at 0.5 s).
        refused_tries: attempts of a call whose connections are refused, or whose host name
            does not resolve, before it raises ``StoreUnavailable``; None retries until the
            deadline.
        refused_backoff_s: wait between such attempts (seconds).

    ``limits`` holds the daemon's request limits once an answer named them
    (``kvstore.daemon.batches``).

    Raises:
        ValueError: ``url`` is not ``http[s]://HOST:PORT`` (``check_url``), or a bad
            ``refused_tries``.
    """

    def __init__(self, url: str, *, auth_token: str | None = None, timeout_s: float = 10.0,
                 pool_size: int = 32, retry_backoff_s: float = 0.02,
                 refused_tries: int | None = 2, refused_backoff_s: float = 0.05):
        if refused_tries is not None and (not isinstance(refused_tries, int)
                                          or refused_tries < 1):
            raise ValueError(f"refused_tries must be a positive int or None, got "
                             f"{refused_tries!r}")
        self.refused_tries, self.refused_backoff_s = refused_tries, refused_backoff_s
        self.url = check_url(url).rstrip("/")
        self.timeout_s = check_timeout(timeout_s)
        self.pool_size = pool_size
        self.retry_backoff_s = retry_backoff_s
        self._headers = {VERSION_HEADER: str(PROTOCOL_VERSION)}
        if auth_token:
            self._headers["Authorization"] = f"Bearer {auth_token}"
        self._session: aiohttp.ClientSession | None = None
        #: new connections only: a non-idempotent call's retry (``never_read``)
        self._fresh: aiohttp.ClientSession | None = None
        #: the daemon's request limits, from its latest answer that named them (None: none
        #: did yet, or an older daemon)
        self.limits: DaemonLimits | None = None

    def _new_session(self, fresh: bool) -> aiohttp.ClientSession:
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        conn = aiohttp.TCPConnector(limit=1 if fresh else self.pool_size, force_close=fresh,
                                    keepalive_timeout=None if fresh else 30)
        return aiohttp.ClientSession(connector=conn, headers=self._headers,
                                     timeout=aiohttp.ClientTimeout(total=None),
                                     read_bufsize=4 << 20, trace_configs=[trace])

    def _sess(self, fresh: bool = False) -> aiohttp.ClientSession:
        if fresh:
            if self._fresh is None or self._fresh.closed:
                self._fresh = self._new_session(True)
            return self._fresh
        if self._session is None or self._session.closed:
            self._session = self._new_session(False)
        return self._session

    async def close(self) -> None:
        """Close pooled connections. Idempotent."""
        for sess in (self._session, self._fresh):
            if sess is not None and not sess.closed:
                await sess.close()

    async def call(self, method: str, path: str, handle, *, idempotent: bool,
                   timeout_s: float | None, body=None, headers=None) -> Any:
        """One logical call with deadline and retries. ``body`` is bytes or a zero-arg factory
        of an async iterator (re-created per attempt); ``handle(resp)`` parses the answer (any
        status below 400, and 404).

        Raises:
            StoreUnavailable: no answer within the deadline, refused connections, a host name
                that does not resolve (the message names the host), a failed TLS handshake,
                or a non-idempotent call that failed after sending (but for one the daemon
                cannot have read, ``never_read``: sent once more, on a new connection).
            RemoteError: an error status other than 404 (and 503 for idempotent calls).
            NotADaemon: an answer without the daemon's protocol header (another server
                listens at the URL), other than a gateway's 502/503/504; never retried.
        """
        timeout = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        attempt, refused, last, fresh = 0, 0, None, False
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StoreUnavailable(f"{method} {self.url}{path}: no answer within {timeout} s "
                                       f"({_last_error(last)})")
            sent = SimpleNamespace(reused=False, answered=False)
            try:
                async with asyncio.timeout(remaining):
                    data = body() if callable(body) else body
                    async with self._sess(fresh).request(method, self.url + path, data=data,
                                                         headers=headers,
                                                         trace_request_ctx=sent) as resp:
                        sent.answered = True
                        if VERSION_HEADER not in resp.headers \
                                and resp.status not in _GATEWAY_STATUSES:
                            raise not_a_daemon(self.url, method, path, resp)
                        self.limits = limits_from(resp.headers) or self.limits
                        if resp.status == 503 and idempotent:
                            raise _Retry(await resp.text())
                        if resp.status >= 400 and resp.status != 404:
                            raise RemoteError(resp.status, await error_text(resp))
                        return await handle(resp)
            except TimeoutError:
                raise StoreUnavailable(f"{method} {self.url}{path}: no answer within "
                                       f"{timeout} s ({_last_error(last)})") from None
            except (aiohttp.ClientConnectorSSLError, aiohttp.ClientConnectorCertificateError,
                    aiohttp.ClientSSLError) as e:  # not transient: no retry
                raise StoreUnavailable(
                    f"{method} {self.url}{path}: TLS handshake failed ({_ssl_reason(e)}); "
                    f"`kvstore serve` speaks plain HTTP: use http://, or check the TLS proxy "
                    f"in front of it") from None
            except _CONNECT_ERRORS as e:
                last = e
                why = _unreachable(e, refused + 1)
                if why is not None:
                    refused += 1
                    if self.refused_tries is not None and refused >= self.refused_tries:
                        raise StoreUnavailable(f"{method} {self.url}{path}: {why}") from None
                    delay = min(self.refused_backoff_s, deadline - loop.time())
                    if delay > 0:
                        await asyncio.sleep(delay)
                    continue
            except (_Retry, *_TRANSPORT_ERRORS) as e:
                if not idempotent and not fresh and never_read(sent, e):
                    last, fresh = e, True   # the daemon did nothing of it: as if not sent
                    continue
                if not idempotent:
                    raise StoreUnavailable(f"{method} {self.url}{path} failed after sending; "
                                           f"not retried (not idempotent): {e!r}") from e
                last = e
            delay = min(self.retry_backoff_s * 2 ** attempt, 0.5, deadline - loop.time())
            attempt += 1
            if delay > 0:
                await asyncio.sleep(delay)

    async def post_json(self, path: str, payload: bytes, *, idempotent: bool,
                        timeout_s: float | None) -> dict:
        """POST a JSON ``payload``; the answer's JSON object. Raises as ``call`` (404 too)."""
        async def handle(resp):
            if resp.status == 404:
                raise RemoteError(404, await error_text(resp))
            return await resp.json()
        return await self.call("POST", path, handle, idempotent=idempotent, timeout_s=timeout_s,
                               body=payload, headers={"Content-Type": "application/json"})


def _unreachable(e: aiohttp.ClientConnectorError, tries: int) -> str | None:
    """Why retrying soon will not reach the daemon, after ``tries`` attempts, in words:
    nothing listens on the port (refused), or the URL's host name does not resolve (a DNS
    failure; aiohttp >= 3.10 raises it as ``ClientConnectorDNSError``). None for another
    connection error (retried until the deadline), a temporary failure of the resolver
    (``EAI_AGAIN``: a real host's name may resolve a moment later) included."""
    if isinstance(e.os_error, ConnectionRefusedError):
        return f"connection refused ({tries} tries); is the kvstore daemon running?"
    if isinstance(e.os_error, socket.gaierror) and e.os_error.errno != socket.EAI_AGAIN:
        reason = e.os_error.strerror or str(e.os_error)
        return (f"cannot resolve host {e.host!r}: {reason} ({tries} tries); check the host "
                f"name in the URL")
    return None


def _last_error(e: BaseException | None) -> str:
    """The last failed attempt's error for a deadline message, in words."""
    if e is None:
        return "nothing answered: the host dropped the connection attempt, or whatever " \
               "listens there (a hung daemon, a server that is not HTTP) never replied"
    return f"last error: {type(e).__name__}: {e}"


def _ssl_reason(e: BaseException) -> str:
    """The SSL library's reason of a TLS failure (e.g. ``WRONG_VERSION_NUMBER``)."""
    inner = getattr(e, "os_error", None) or getattr(e, "certificate_error", None) or e
    return getattr(inner, "reason", None) or str(inner)


async def error_text(resp: aiohttp.ClientResponse) -> str:
    """The ``"error"`` text of a JSON error answer (else, from a proxy, its status line and
    content type: never an HTML page)."""
    text = await resp.text()
    try:
        return json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        if VERSION_HEADER not in resp.headers:
            ctype = resp.headers.get("Content-Type") or "no content type"
            return (f"{resp.reason or 'error'} ({ctype}, without the {VERSION_HEADER} "
                    f"header: a proxy's answer)")
        return text[:500]


def not_a_daemon(url: str, method: str, path: str, resp: aiohttp.ClientResponse) -> NotADaemon:
    """The error for an answer that did not come from a kvstore daemon (see ``NotADaemon``)."""
    ctype = resp.headers.get("Content-Type") or "no content type"
    return NotADaemon(resp.status, f"{url} is not a kvstore daemon: {method} {path} answered "
                                   f"{resp.status} ({ctype}) without the {VERSION_HEADER} "
                                   f"header; check the URL and port")

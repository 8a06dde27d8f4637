"""Running a kvstore server app: SIGTERM/SIGINT drain (``serve_until_signal``) and a
private event-loop thread (``ThreadedServer``); either also serves the same-host path
(``kvstore.daemon.shm_server``) when given a Unix socket path. A second SIGTERM/SIGINT while
stopping exits at once (``force_exit``), as ``engine_min serve`` does."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

from aiohttp import web

from kvstore.daemon.conns import (DEFAULT_IDLE_TIMEOUT_S, ConnectionGuard, GuardedTCPSite,
                                  default_max_connections)

log = logging.getLogger("kvstore.daemon.server")


#: exit status of a stop cut short by a second SIGTERM/SIGINT (128 + SIGINT, as a shell
#: reports Ctrl-C; ``engine_min serve``'s status for the same)
FORCED_EXIT_STATUS = 130
_exiting = False


def force_exit(message: str, status: int = FORCED_EXIT_STATUS) -> None:
    """Log ``message`` (WARNING, one line), flush the log handlers and stderr, and
    ``os._exit(status)``: no cleanup runs (a crash's state: the disk tier keeps what its
    writer committed, consistent; the rest is lost). A signal that lands while the line is
    being written exits without a line of its own."""
    global _exiting
    if _exiting:
        os._exit(status)
    _exiting = True
    log.warning("%s", message)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    sys.stderr.flush()
    os._exit(status)


def http_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` for a bound address, an IPv6 literal in brackets
    (``http://[::1]:8500``): the form a client and a browser take."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _state_key():
    from kvstore.daemon.server import STATE_KEY  # late: kvstore.daemon.server re-exports this module
    return STATE_KEY


def set_ready(app: web.Application, ready: bool) -> None:
    """Flip /readyz (False while draining on SIGTERM)."""
    app[_state_key()].ready = ready


def _guard(app: web.Application, max_connections: int | None,
           idle_timeout_s: float | None) -> ConnectionGuard:
    """The app's ``ConnectionGuard`` set to a cap (None: ``default_max_connections()``, 0: no
    cap) and an idle timeout (None: aiohttp's default)."""
    guard: ConnectionGuard = app[_state_key()].conns
    guard.max_connections = default_max_connections() if max_connections is None \
        else max_connections
    guard.idle_timeout_s = idle_timeout_s
    guard.install_accept_log(asyncio.get_running_loop())
    return guard


async def serve_until_signal(app: web.Application, host: str, port: int, *,
                             shutdown_timeout_s: float = 30.0, on_listen=None,
                             max_connections: int | None = None,
                             idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
                             unix_socket: str | None = None) -> None:
    """Serve ``app`` until SIGTERM/SIGINT, then drain: /readyz turns 503, the listening socket
    closes (no new connections), in-flight requests finish (up to ``shutdown_timeout_s``), and
    the app's cleanup runs; another SIGTERM/SIGINT meanwhile exits the process at once
    (``force_exit``: one line, status 130). The caller closes (flushes) the store afterwards
    (``kvstore serve`` persists the memory tiers to the disk tier first:
    ``--persist-on-shutdown-s``; a signal during that exits at once too). Once listening it
    logs (INFO) the connection cap and one line naming the lower tiers' codecs and the wire
    codecs accepted (``kvstore.daemon.state.codec_text``).

    Args:
        on_listen: called with the bound ``(host, port)`` once listening (port 0 resolves).
        max_connections: cap on open connections (``kvstore.daemon.conns``; None: derived from
            ``RLIMIT_NOFILE``, 0: no cap).
        idle_timeout_s: a connection without a complete request's headers this many seconds
            after connecting or after its last response is closed (None: aiohttp's default).
        unix_socket: also serve the same-host path on this socket path (``ShmServer``);
            started before ``on_listen`` is called, drained with the HTTP requests.

    Raises:
        ValueError: ``host:port`` or ``unix_socket`` cannot be listened on (in use, not this
            host's), naming it.
    """
    import signal
    guard = _guard(app, max_connections, idle_timeout_s)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=shutdown_timeout_s,
                           access_log=None, **guard.runner_kwargs())
    await runner.setup()
    site = GuardedTCPSite(runner, host, port, guard, reuse_address=True)
    try:
        await site.start()
    except OSError as e:  # port in use, an address not of this host, an unknown host name
        await runner.cleanup()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise ValueError(f"cannot listen on {where}: {e}") from None
    bound = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
    shm = None
    if unix_socket is not None:
        shm = await _start_shm(app, unix_socket, runner, guard.max_connections)
    log.info("connection cap %s, idle timeout %s s",
             guard.max_connections or "none (0)", idle_timeout_s)
    from kvstore.daemon.state import codec_text
    log.info("%s", codec_text(app[_state_key()].tier_codecs))
    if on_listen is not None:
        on_listen(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("signal received: draining (SIGTERM or Ctrl-C again to exit at once)")
        state = app[_state_key()]
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: force_exit(
                f"{signal.Signals(s).name} again: exiting now, while draining ({state.active} "
                f"requests in flight dropped; the memory tiers not persisted)"))
        set_ready(app, False)
        for s in list(runner.sites):  # stop accepting connections
            await s.stop()
        if shm is not None:
            shm.stop_accepting()
        # aiohttp's own shutdown stops reading request bodies at once, so uploads in flight
        # would be lost: wait for them here first (new requests on open connections get 503).
        if not await app[_state_key()].wait_idle(shutdown_timeout_s):
            log.warning("%d requests still in flight after %.1f s; cancelling them",
                        app[_state_key()].active, shutdown_timeout_s)
    finally:
        if shm is not None:
            await shm.stop()
        await runner.cleanup()


async def _start_shm(app: web.Application, path: str, runner: web.AppRunner,
                     max_connections: int = 0):
    """Start the same-host path's ``ShmServer`` on ``path`` with its own cap of
    ``max_connections`` (0: none) (the runner is cleaned up if it cannot listen). Raises
    ValueError naming the path."""
    from kvstore.daemon.shm_server import ShmServer
    try:
        shm = ShmServer(app, path, max_connections)
        await shm.start()
    except ValueError:
        await runner.cleanup()
        raise
    return shm


class ThreadedServer:
    """Serve an app on a private event-loop thread (embedding in a process, tests, benches).

    ``with ThreadedServer(create_app(store)) as srv: KVStoreClient(srv.url)``. The store is not
    closed on stop (the caller owns it).
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0, *,
                 max_connections: int = 0, idle_timeout_s: float | None = None,
                 unix_socket: str | None = None):
        """``max_connections``, ``idle_timeout_s`` and ``unix_socket`` as
        ``serve_until_signal`` (defaults here: no cap, aiohttp's idle timeout, no same-host
        path). ``shm`` is the ``ShmServer`` (or None); ``unix_url`` its ``unix://`` URL."""
        import threading
        self.app = app
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-server",
                                        daemon=True)
        self._thread.start()
        self.shm = None
        try:
            self.host, self.port = asyncio.run_coroutine_threadsafe(
                self._start(host, port, max_connections, idle_timeout_s, unix_socket),
                self._loop).result(30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            raise

    async def _start(self, host: str, port: int, max_connections: int,
                     idle_timeout_s: float | None, unix_socket: str | None):
        guard = _guard(self.app, max_connections, idle_timeout_s)
        self._runner = web.AppRunner(self.app, handle_signals=False, shutdown_timeout=5,
                                     access_log=None, **guard.runner_kwargs())
        await self._runner.setup()
        site = GuardedTCPSite(self._runner, host, port, guard)
        await site.start()
        if unix_socket is not None:
            self.shm = await _start_shm(self.app, unix_socket, self._runner,
                                        guard.max_connections)
        return site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def unix_url(self) -> str | None:
        return self.shm.url if self.shm is not None else None

    async def _stop(self) -> None:
        if self.shm is not None:
            await self.shm.stop()
        await self._runner.cleanup()

    def stop(self) -> None:
        """Stop listening, finish in-flight requests, stop the loop thread. Idempotent."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "ThreadedServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

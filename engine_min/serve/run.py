"""Running the OpenAI server: until Ctrl-C / SIGTERM, shut down in bounded time
(``run_server``, the ``serve`` command), or on its own event loop thread (``ServerThread``:
tests, notebooks, benchmarks in-process).

The first SIGINT or SIGTERM starts a graceful shutdown: it is logged with the number of
requests in flight, the listening socket closes, new requests on open connections get 503
(``server_shutting_down``) and ``/health`` turns 503; the requests in flight may finish for up
to ``shutdown_timeout_s`` seconds; the ones still running then are aborted (a stream ends with a
chunk whose ``finish_reason`` is ``"abort"``, an error event and ``[DONE]``; a non-streamed
request gets 503), the engine thread stops and the caller closes the connector (queued KV saves
are flushed).

A second SIGINT/SIGTERM during that shutdown exits at once (status 130) with one log line:
queued saves not yet written are dropped, the disk tier stays consistent (lmdb commits are
atomic, its lock dies with the process and the tier rebuilds its index on open). The process
leaves through ``os._exit``, so the interpreter never finalizes while the engine thread is
inside torch (that raced into "terminate called without an active exception" and SIGABRT).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from aiohttp import web

logger = logging.getLogger("engine_min.serve.server")

#: default grace period for requests in flight at shutdown (seconds)
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
#: exit status of a forced exit on the second interrupt (128 + SIGINT, as a shell reports it)
FORCED_EXIT_STATUS = 130
_POLL_S = 0.05


class Interrupts:
    """SIGINT/SIGTERM handling for one server run: the first signal calls ``on_first`` on the
    event loop; any later one (also after the loop has ended, while the connector closes)
    logs one line and exits the process at once with ``FORCED_EXIT_STATUS``.

    ``install`` replaces the handlers; ``restore`` puts the previous ones back."""

    def __init__(self) -> None:
        self.count = 0
        self._on_first: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def bind(self, loop: asyncio.AbstractEventLoop, on_first: Callable[[], None]) -> None:
        """Call ``on_first`` on ``loop`` at the first signal (at once if one already came)."""
        self._loop, self._on_first = loop, on_first
        if self.count:
            loop.call_soon_threadsafe(on_first)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            if self._loop is not None and self._on_first is not None:
                try:
                    self._loop.call_soon_threadsafe(self._on_first)
                except RuntimeError:  # the loop has closed: the server is already stopping
                    pass
            return
        force_exit(f"{signal.Signals(signum).name} again: exiting now without waiting for "
                   f"requests or queued KV saves")


def force_exit(message: str, status: int = FORCED_EXIT_STATUS) -> None:
    """Log ``message`` (WARNING), flush the log handlers and stderr, and ``os._exit(status)``
    (default 130)."""
    logger.warning(message)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    sys.stderr.flush()
    os._exit(status)


async def drain(serving: Any, timeout_s: float) -> None:
    """Stop taking requests, wait up to ``timeout_s`` seconds for those in flight, abort the
    rest (their handlers end them as shutting down) and wait for their handlers to answer.

    Args:
        serving: the app's ``OpenAIServing`` (``draining``, ``num_inflight``,
            ``abort_inflight``).
        timeout_s: grace period in seconds (>= 0).
    """
    serving.draining = True
    n = serving.num_inflight
    if not n:
        logger.info("shutting down: no requests in flight")
        return
    logger.info("shutting down: waiting up to %.1f s for %d request%s in flight "
                "(Ctrl-C again to exit at once)", timeout_s, n, "" if n == 1 else "s")
    deadline = time.monotonic() + timeout_s
    while serving.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    n = serving.num_inflight
    if not n:
        logger.info("shutting down: every request finished")
        return
    logger.warning("shutting down: aborting %d request%s still running after %.1f s",
                   n, "" if n == 1 else "s", timeout_s)
    serving.abort_inflight()
    deadline = time.monotonic() + 5.0   # their handlers write the final events
    while serving.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)


async def _serve(app: web.Application, host: str, port: int, interrupts: Interrupts,
                 shutdown_timeout_s: float, started: Callable[[str], None]) -> bool:
    """Serve until the first signal, drain, clean up; returns whether the engine thread
    stopped (False: it is still inside a step after the app's cleanup waited for it)."""
    from engine_min.serve.server import SERVING_KEY
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                           access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {exc}") from None
    bound = runner.addresses[0]
    started(f"http://{bound[0]}:{bound[1]}")
    stop = asyncio.Event()
    interrupts.bind(asyncio.get_running_loop(), stop.set)
    try:
        await stop.wait()
        for s in list(runner.sites):  # no new connections
            await s.stop()
        await drain(app[SERVING_KEY], shutdown_timeout_s)
    finally:
        await runner.cleanup()    # the app's cleanup stops the engine thread
    return not app[SERVING_KEY].engine_loop.alive


def run_server(app: web.Application, host: str, port: int, *,
               shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
               started: Callable[[str], None] = lambda url: None,
               after: Callable[[], None] = lambda: None) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM, then shut down as the module says;
    ``after`` (closing the connector) runs last, still under the second-signal handler, once
    the engine thread has stopped (if it has not, the process exits with status 1 instead).

    Args:
        started: called with the bound ``http://host:port`` once listening.

    Raises:
        SystemExit: ``host:port`` cannot be listened on (message names it).
    """
    interrupts = Interrupts()
    interrupts.install()
    try:
        try:
            stopped = asyncio.run(_serve(app, host, port, interrupts, shutdown_timeout_s,
                                         started))
        except BaseException:   # could not listen: the engine thread never started
            after()
            raise
        if not stopped:   # finalizing the interpreter under a running torch op aborts
            force_exit("the engine thread did not stop; exiting without closing the KV "
                       "store connector", status=1)
        after()
        logger.info("shut down")
    finally:
        interrupts.restore()


class ServerThread:
    """Runs an app on its own event loop thread (tests, notebooks, benchmarks in-process).

    Usage: ``with ServerThread(app) as srv: openai.OpenAI(base_url=srv.url + "/v1", ...)``.

    Attributes:
        url: ``http://host:port`` once started (``port=0`` picks a free port).
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-server",
                                        daemon=True)

    def start(self) -> "ServerThread":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=60)
        return self

    async def _serve(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

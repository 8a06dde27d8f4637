"""The engine thread of the OpenAI-compatible server: the one thread that owns an ``LLMEngine``.

Handlers submit and abort requests through a ``SimpleQueue``; the thread drains it, runs
``engine.step()`` while requests are unfinished, and hands each ``RequestOutput`` (or an
``ApiError``) to the asyncio queue of its request with ``call_soon_threadsafe``.

Failures: a request the engine failed alone (finish reason ``"error"``: its admission,
forward, sampling, stop check or detokenizing raised) gets its own ``ApiError`` (HTTP 500,
``server_error``, code ``request_failed``); the others in flight go on. Only an error that
``engine.step()`` itself raises (nothing in the engine pins it on one request) fails every
request in flight (code ``engine_error``, their blocks freed by aborting them); the thread keeps
serving new requests either way.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from engine_min.serve import protocol as proto
from engine_min.serve.metrics import ServerMetrics

logger = logging.getLogger("engine_min.serve.server")

_EMPTY_STEP_WAIT_S = 0.002
#: While idle with saves still queued (a finished request's last save is queued by its last
#: step), the thread wakes this often (seconds) to refresh ``stats`` until the queue drains:
#: the save queue gauge and the save counters then show the saves' outcome.
_SAVE_POLL_S = 0.1


@dataclass
class _Sink:
    """Where one request's outputs go (owned by the engine thread after submit)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival_s: float
    last_token_s: float | None = None


@dataclass(frozen=True)
class _Add:
    """Command: add a request to the engine; its outputs go to ``sink``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Any
    sink: _Sink


@dataclass(frozen=True)
class _Abort:
    """Command: abort a request (no-op if it already finished); ``error``, when given, is
    delivered to the request's queue first (its handler answers with it)."""

    request_id: str
    error: Exception | None = None


@dataclass(frozen=True)
class _Stop:
    """Command: abort everything in flight and end the engine thread."""


_Command = _Add | _Abort | _Stop


class ShuttingDown(proto.ApiError):
    """The request was aborted because the server is shutting down (HTTP 503,
    ``server_error``, code ``server_shutting_down``); a stream ends with finish reason
    ``"abort"``, this error event and ``[DONE]``."""

    def __init__(self, message: str = "The server is shutting down; the request was "
                 "aborted.") -> None:
        super().__init__(message, status=503, type="server_error", code="server_shutting_down")


def request_failed(error: str) -> proto.ApiError:
    """The error reply of a request that failed alone (``RequestOutput.error``): HTTP 500,
    type ``server_error``, code ``request_failed``."""
    return proto.ApiError(f"The request failed: {error}", status=500, type="server_error",
                          code="request_failed")


class EngineLoop:
    """Runs one engine on one dedicated thread; the only code that calls into the engine.

    ``submit`` and ``abort`` are thread-safe and never block. Outputs (``RequestOutput``) are
    put on the request's asyncio queue; if the request cannot be added or the engine fails,
    an ``Exception`` is put there instead (an ``ApiError`` for a refused request).

    Attributes:
        stats: the latest ``engine.stats()`` snapshot (refreshed after every step or command,
            and every ``_SAVE_POLL_S`` while idle with the connector's saves still queued).
        error: the last exception raised by ``engine.step()``, or ``None``.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.stats: dict = {}
        self._stats_failing = False   # the last engine.stats() raised (logged once)
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._refresh_stats()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort everything in flight and join the thread."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: Any,
               arrival_s: float | None = None) -> asyncio.Queue:
        """Queue a request; returns the asyncio queue (of the calling loop) its outputs go to.

        ``arrival_s`` is the ``time.monotonic()`` the request arrived (TTFT starts there);
        default now.
        """
        arrival_s = time.monotonic() if arrival_s is None else arrival_s
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), arrival_s)
        self._commands.put(_Add(request_id, prompt_token_ids, sampling, sink))
        return sink.queue

    def abort(self, request_id: str, error: Exception | None = None) -> None:
        """Abort a request (no-op if it already finished); its blocks are freed. ``error``,
        when given, is put on the request's queue first (e.g. ``shutting_down()``)."""
        self._commands.put(_Abort(request_id, error))

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        wait_s: float | None = None  # None: block until a command arrives
        while True:
            cmds = self._drain(wait_s)
            if any(isinstance(c, _Stop) for c in cmds):
                self._shutdown()
                return
            for cmd in cmds:
                self._apply(cmd)
            wait_s = None
            if self.engine.has_unfinished():
                # a step that reports nothing (a prefill chunk, or nothing schedulable) is
                # followed by a short wait, so a stuck queue cannot spin a core
                wait_s = 0.0 if self._step() else _EMPTY_STEP_WAIT_S
            fresh = self._refresh_stats()
            if wait_s is None and fresh and self.stats.get("kvstore_save_queue_bytes"):
                wait_s = _SAVE_POLL_S   # idle, saves still queued: refresh until written

    def _drain(self, wait_s: float | None) -> list[_Command]:
        """Commands queued now; first waits up to ``wait_s`` seconds (None: forever)."""
        cmds = []
        try:
            if wait_s is None:
                cmds.append(self._commands.get())
            elif wait_s > 0:
                cmds.append(self._commands.get(timeout=wait_s))
        except queue.Empty:
            pass
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            sink = self._sinks.pop(cmd.request_id, None)
            if sink is not None:
                self.metrics.request_success.labels("abort").inc()
                if cmd.error is not None:
                    self._deliver(sink, cmd.error)
            self.engine.abort(cmd.request_id)
            return
        try:
            self.engine.add_request(cmd.prompt_token_ids, cmd.sampling,
                                    request_id=cmd.request_id)
        except ValueError as exc:
            self._deliver(cmd.sink, proto.ApiError(str(exc)))
            return
        self._sinks[cmd.request_id] = cmd.sink

    def _step(self) -> bool:
        """One engine step; delivers its outputs. Returns whether it produced any."""
        try:
            outputs = self.engine.step()
        except Exception as exc:  # keep serving; fail the requests in flight
            logger.exception("engine step failed; aborting %d requests", len(self._sinks))
            self.error = exc
            for request_id, sink in list(self._sinks.items()):
                self._deliver(sink, proto.ApiError(f"The engine step failed: {exc!r}",
                                                   status=500, type="server_error",
                                                   code="engine_error"))
                self._safe_abort(request_id)
            self._sinks.clear()
            return True
        now = time.monotonic()
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            self._observe(sink, out, now)
            if out.finished:
                del self._sinks[out.request_id]
            self._deliver(sink, out if out.error is None else request_failed(out.error))
        return bool(outputs)

    def _observe(self, sink: _Sink, out: Any, now: float) -> None:
        num_new = len(out.new_token_ids)
        if num_new:
            if sink.last_token_s is None:
                self.metrics.ttft.observe(now - sink.arrival_s)
                self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
            else:
                self.metrics.itl.observe(now - sink.last_token_s)
            sink.last_token_s = now
            self.metrics.generation_tokens.inc(num_new)
        if out.finished:
            self.metrics.e2e.observe(now - sink.arrival_s)
            self.metrics.request_success.labels(str(out.finish_reason)).inc()

    def _deliver(self, sink: _Sink, item: Any) -> None:
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is going down
            pass

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)

    def _refresh_stats(self) -> bool:
        """Take a new ``stats`` snapshot; False when ``engine.stats()`` raised (logged once
        until a snapshot succeeds again)."""
        try:  # includes the connector's external_prefix_cache_* counters when it has one
            stats = dict(self.engine.stats())
        except Exception:
            if not self._stats_failing:
                logger.exception("engine.stats() failed")
            self._stats_failing = True
            return False
        if self._stats_failing:
            logger.info("engine.stats() works again")
        self._stats_failing = False
        self.stats = stats
        self.metrics.update_from_stats(stats)
        return True

    def _shutdown(self) -> None:
        for request_id, sink in list(self._sinks.items()):
            self._deliver(sink, ShuttingDown())
            self._safe_abort(request_id)
        self._sinks.clear()
        self._refresh_stats()

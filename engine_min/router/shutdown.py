"""The router's requests in flight and its shutdown (``Inflight``).

Every generation request runs under ``Inflight.run``. At shutdown (``Inflight.drain``, the
app's ``on_shutdown``, after the listener closed) the router logs how many requests and
streams are in flight and lets them run for up to the grace period. Then each request still
in flight gets an answer before the router exits:

- a stream being relayed ends as an engine's stream does at its shutdown: a chunk with
  ``finish_reason`` ``"abort"``, an error event (code ``server_shutting_down``) and
  ``data: [DONE]`` (``RouterStopping`` set on its engine's reader; the relay in
  ``engine_min.router.stream_end`` writes the ending); one whose first event had not come yet
  gets the 503 below;
- any other request (waiting for its engine's answer, or not yet sent) is cancelled and gets
  503 with an OpenAI error object ``{"error": {"message", "type": "server_error", "param",
  "code": "server_shutting_down"}}``;
- an answer already being written to the client is left to finish.

Each of them counts in ``router_failed_requests_total`` (and
``router_failed_requests_by_code_total{code="server_shutting_down"}``).
"""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from engine_min.serve.engine_loop import ShuttingDown
from engine_min.serve.errors import error_response

#: set on a request once its answer is being written (a relayed stream, or a whole answer):
#: the shutdown no longer cancels it
ANSWERING: web.RequestKey[bool] = web.RequestKey("engine_min.router.answering", bool)
#: how long the shutdown waits for the requests it ended to be answered (seconds)
END_WAIT_S = 2.0
MESSAGE = "The router is shutting down; the request was aborted."
_CUT = "the router's shutdown timeout ran out"   # the message of its cancellations


class RouterStopping(Exception):
    """Set on an engine's stream by the router's shutdown: the relay ends the client's stream
    (abort chunk, error event ``server_shutting_down``, ``[DONE]``)."""


def answering(request: web.Request, on: bool = True) -> None:
    """Mark ``request``'s answer as being written (or a stream as being relayed): the shutdown
    lets it finish. ``on=False``: no longer (the engine failed first; the request is sent to
    another engine)."""
    request[ANSWERING] = on


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class Inflight:
    """The router's generation requests in flight, and their end at shutdown.

    Args:
        metrics: the router's ``RouterMetrics`` (``failed``).

    Attributes:
        requests: handler task -> its ``web.Request``, for each request in flight.
        streams: engine ``StreamReader`` -> ``SseRelayState`` of each stream being relayed
            (filled by ``engine_min.router.stream_end.relay_stream``).
    """

    def __init__(self, metrics) -> None:
        self.metrics = metrics
        self.requests: dict[asyncio.Task, web.Request] = {}
        self.streams: dict = {}
        self._cut = False   # the grace period is over: requests are ended
        self._ended: set[asyncio.Task] = set()   # cancelled by the shutdown

    async def run(self, request: web.Request, handler) -> web.StreamResponse:
        """``await handler(request)`` on the current task, which the shutdown cancels once its
        grace period is over (``drain``): the request is then answered 503
        (``server_shutting_down``) and counted as failed, unless its answer is being written
        (``answering``). A request that comes after that is answered so at once. Any other
        cancellation (the client left) propagates."""
        task = asyncio.current_task()
        if self._cut:
            return self._shutting_down()
        self.requests[task] = request
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if task not in self._ended or task.cancelling() != 1:
                raise                         # the client left (too)
            task.uncancel()
            return self._shutting_down()
        finally:
            self.requests.pop(task, None)
            self._ended.discard(task)

    def _shutting_down(self) -> web.Response:
        self.metrics.failed("server_shutting_down")
        return error_response(ShuttingDown(MESSAGE))

    async def drain(self, timeout_s: float, logger, poll_s: float = 0.05) -> None:
        """The router's shutdown: log how many requests and streams are in flight, wait up
        to ``timeout_s`` seconds for them, then end each still in flight (see the module
        docstring), log how many, and wait up to ``END_WAIT_S`` for their answers.

        Args:
            timeout_s: grace period in seconds (>= 0).
            logger: where the lines go.
            poll_s: seconds between checks of what is still in flight.
        """
        n, s = len(self.requests), len(self.streams)
        logger.info("stopping: %s in flight (%s); waiting up to %.1f s",
                    _plural(n, "request"), _plural(s, "stream"), timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        self._cut = True
        if not self.requests:
            return
        streams = list(self.streams)
        others = [t for t, r in self.requests.items() if not r.get(ANSWERING)]
        logger.warning("stopping: after %.1f s, ending %s still open and answering %s 503 "
                       "(server_shutting_down)", timeout_s,
                       _plural(len(streams), "stream"), _plural(len(others), "request"))
        for reader in streams:
            reader.set_exception(RouterStopping())
        for task in others:
            self._ended.add(task)
            task.cancel(_CUT)
        deadline = time.monotonic() + END_WAIT_S
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)

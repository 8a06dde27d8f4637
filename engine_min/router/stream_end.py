"""Ending a relayed SSE stream that the router cannot finish: the engine died mid-stream, or
the router is stopping with the stream still open.

The client then gets what an engine sends when it is shut down mid-stream
(``engine_min.serve.run``): a chunk whose ``finish_reason`` is ``"abort"`` (unless the engine
already sent a finishing chunk), an OpenAI error event and ``data: [DONE]``, instead of a
connection cut in the middle of an event. The error event of a stream its engine cut names
the engine and how far the stream got (``cut_message``); the cause in aiohttp's words goes to
the router's log only.

``SseRelayState`` sees every chunk the engine sends; it passes on only whole events (up to the
last blank line), so a cut never leaves half an event with the client, and remembers the
stream's ``id``, ``object``, ``model`` and ``created`` (from its first JSON event) to write the
abort chunk in the stream's own shape.
"""
from __future__ import annotations

import json
import logging

import aiohttp
from aiohttp import web

from engine_min.router.reasons import describe_error
from engine_min.router.shutdown import MESSAGE, RouterStopping, answering
from engine_min.router.usage import UsageScanner
from engine_min.serve import protocol as proto
from engine_min.serve import responses as wire
from engine_min.serve.engine_loop import ShuttingDown
from engine_min.serve.errors import error_response

logger = logging.getLogger("engine_min.router")

#: an incomplete event longer than this is passed on as is (no SSE engine sends such events)
MAX_HELD_BYTES = 1 << 20
_SEPARATORS = (b"\n\n", b"\r\n\r\n")


class UpstreamFailed(Exception):
    """The engine failed before the client received any byte: the request may be retried."""


class ClientGone(Exception):
    """The client's connection closed (or is closing) as the router wrote its answer to it:
    the client left, e.g. it stopped reading at ``data: [DONE]``. Not the engine's failure, and
    deliberately not an ``aiohttp.ClientError`` (aiohttp reports the failed write as
    ``ClientConnectionResetError``, which would read as the engine's connection failing)."""


async def to_client(write) -> None:
    """``await write`` (a write of the router's response to the client); a ``ConnectionError``
    (aiohttp: "Cannot write to closing transport", a reset) is raised as ``ClientGone``."""
    try:
        await write
    except ConnectionError as exc:
        raise ClientGone(f"{type(exc).__name__}: {exc}") from exc


class _ToClient:
    """The router's streamed response to the client, started (status, headers) with its first
    bytes. ``resp`` is None until then; writes raise ``ClientGone`` when the client left."""

    def __init__(self, request: web.Request, status: int, headers: dict) -> None:
        self.request, self.status, self.headers = request, status, headers
        self.resp: web.StreamResponse | None = None

    async def write(self, data: bytes) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(status=self.status, headers=self.headers)
            await to_client(self.resp.prepare(self.request))
        if data:
            await to_client(self.resp.write(data))

    async def end(self, data: bytes = b"") -> web.StreamResponse:
        await self.write(data)
        await to_client(self.resp.write_eof())
        return self.resp


class SseRelayState:
    """What the router has relayed of one SSE stream.

    Attributes:
        bytes_relayed: bytes passed on to the client so far.
        events_relayed: whole events passed on so far.
        request_id: the stream's ``id`` (from its first JSON event; None before one).
        finished: a chunk with a non-null ``finish_reason`` was passed on.
    """

    def __init__(self) -> None:
        self.bytes_relayed = self.events_relayed = 0
        self.request_id: str | None = None
        self.finished = False
        self._shape: dict | None = None   # id, object, model, created of the first event
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``chunk`` (after what was held back) that complete whole events; the
        rest is held until its event is complete (or over ``MAX_HELD_BYTES``)."""
        data = self._held + chunk
        end = max(data.rfind(sep) + len(sep) if data.rfind(sep) >= 0 else 0
                  for sep in _SEPARATORS)
        if end == 0 and len(data) > MAX_HELD_BYTES:
            end = len(data)
        out, self._held = data[:end], data[end:]
        if out:
            self._scan(out)
            self.bytes_relayed += len(out)
            self.events_relayed += out.count(b"\n\n") + out.count(b"\r\n\r\n")
        return out

    def flush(self) -> bytes:
        """What is held back, at the stream's normal end (the engine ended it so)."""
        out, self._held = self._held, b""
        self.bytes_relayed += len(out)
        return out

    def _scan(self, events: bytes) -> None:
        for line in events.split(b"\n"):
            if not line.startswith(b"data:") or line[5:].strip()[:1] != b"{":
                continue
            if self._shape is not None and b'"finish_reason"' not in line:
                continue
            try:
                obj = json.loads(line[5:])
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if self._shape is None and isinstance(obj.get("id"), str):
                self._shape = {k: obj.get(k) for k in ("id", "object", "model", "created")}
                self.request_id = obj["id"]
            for choice in obj.get("choices") or ():
                if isinstance(choice, dict) and choice.get("finish_reason") is not None:
                    self.finished = True

    def ending(self, message: str, code: str) -> bytes:
        """The events that end the stream: an abort chunk (in the stream's shape, when one
        was seen and no choice finished yet), the error event (``server_error`` with
        ``message`` and ``code``) and ``[DONE]``."""
        out = b""
        shape = self._shape
        if shape is not None and not self.finished:
            if shape.get("object") == "chat.completion.chunk":
                chunk = wire.chat_chunk(shape["id"], shape.get("model"), shape.get("created"),
                                        {}, "abort", False)
            else:
                chunk = wire.completion_chunk(shape["id"], shape.get("model"),
                                              shape.get("created"), "", "abort", False)
                chunk["object"] = shape.get("object") or chunk["object"]
            out += wire.sse(chunk)
        out += wire.sse(proto.error_body(message, "server_error", None, code))
        return out + wire.SSE_DONE


def cut_message(url: str, state: SseRelayState) -> str:
    """The error event's message of a stream its engine cut: the engine's URL and how far the
    stream got (events, bytes). The cause in aiohttp's words goes to the router's log only."""
    return (f"The engine {url} failed mid-stream: its stream was cut after "
            f"{state.events_relayed} event{'' if state.events_relayed == 1 else 's'} "
            f"({state.bytes_relayed} bytes) had been relayed; the request was aborted.")


async def relay_stream(request: web.Request, up: aiohttp.ClientResponse, e, headers: dict,
                       metrics, streams: dict) -> web.StreamResponse:
    """Relay an SSE stream whole event by whole event (``SseRelayState``). A stream the
    engine cuts after events went out, or that is open when the router stops, is ended
    as an engine ends one at its shutdown (``SseRelayState.ending``). A client that left
    (``ClientGone``) ends the relay there, counted in ``router_client_gone_total``; the engine
    stays in service. Raises
    UpstreamFailed: the engine failed before any event went to the client.

    Args:
        request: the client's request; up: the engine's response (``text/event-stream``).
        e: the engine (``engine_min.router.subscriber.Engine``: ``url``, ``mark_down``).
        headers: the response headers to send the client.
        metrics: the router's ``RouterMetrics``.
        streams: the router's open streams (this one is in it while relayed).
    """
    client = _ToClient(request, up.status, headers)
    try:
        return await _relay(client, up, e, metrics, streams)
    except ClientGone as exc:
        logger.debug("%s: the client left before its stream's end (%s)", e.url, exc)
        metrics.client_gone.inc()
        return client.resp


async def _relay(client: _ToClient, up: aiohttp.ClientResponse, e, metrics, streams: dict
                 ) -> web.StreamResponse:
    scanner, state = UsageScanner(), SseRelayState()
    streams[up.content] = state
    answering(client.request)   # the shutdown ends it with RouterStopping, not a cancel
    try:
        async for chunk in up.content.iter_any():
            out = state.feed(chunk)
            if not out:
                continue
            await client.write(out)
            scanner.feed(out)
    except RouterStopping:
        metrics.failed("server_shutting_down")
        if client.resp is None:
            return error_response(ShuttingDown(MESSAGE))
        return await client.end(state.ending(MESSAGE, "server_shutting_down"))
    except aiohttp.ClientError as exc:
        if client.resp is None:
            answering(client.request, False)   # sent again: cancellable until answered
            raise UpstreamFailed(describe_error(exc)) from exc
        why = describe_error(exc)
        metrics.failed("engine_failed")
        was_up = e.healthy
        e.mark_down(f"stream cut: {why}", log=False)
        logger.warning("engine %s failed mid-stream (request %s, %d bytes relayed): %s; %sthe "
                       "client's stream ended with an error event", e.url,
                       state.request_id or "unknown", state.bytes_relayed, why,
                       "taken out; " if was_up else "")
        return await client.end(state.ending(cut_message(e.url, state), "engine_failed"))
    finally:
        streams.pop(up.content, None)
    tail = state.flush()
    resp = await client.end(tail)
    if tail:
        scanner.feed(tail)
    if scanner.cached_tokens is not None:
        metrics.reported_cached_tokens.labels(e.url).inc(scanner.cached_tokens)
    return resp

"""An OpenAI-compatible HTTP server over one ``LLMEngine`` (its command line, ``python -m
engine_min serve``, is ``engine_min.serve.cli``).

Threads::

    aiohttp event loop (handlers)  --submit/abort (SimpleQueue)-->  engine thread (EngineLoop)
          ^                                                             | engine.step()
          +------ per-request asyncio.Queue <- call_soon_threadsafe ----+

The engine is synchronous and single-threaded, so exactly one thread (``EngineLoop``) owns it:
it drains submitted and aborted requests, runs ``step()`` while requests are unfinished, and
hands each ``RequestOutput`` to the asyncio queue of its request. Handlers validate and
tokenize (chat template included) on the default thread pool, so a long prompt never stalls the
event loop (``/health``, streams), then wait on their queue. A text prompt longer than
``MAX_CHARS_PER_TOKEN`` characters per token of the context is refused (400) before tokenizing,
unless ``truncate_prompt_tokens`` is given (then up to ``MAX_TRUNCATED_TEXT_CHARS`` characters
are tokenized and cut). A client that disconnects (the handler is cancelled, or a write to the closed transport fails) gets its request aborted, which frees
its KV blocks.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``; a
chat stream's role chunk goes out with the first token, as vLLM's), ``POST /tokenize`` and
``POST /detokenize`` (vLLM's shapes; ``engine_min.serve.tokenize_routes``), ``GET /v1/models``,
``GET /v1/models/{id}`` and ``GET /version`` (``engine_min.serve.model_routes``),
``GET /health``, ``GET /metrics`` (Prometheus), ``GET /v1/kv_events`` and
``GET /v1/kv_events/snapshot`` (the prefix cache's KV events for routers;
``engine_min.serve.kv_event_routes``), ``GET /debug/stats`` (the engine's ``stats()``
snapshot as JSON). Unknown model names get 404 (``model_not_found``); a request without
``model`` uses the served model. Every error, unknown routes (404) and methods (405) included,
is an OpenAI error object (``engine_min.serve.errors``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, Sequence

from aiohttp import web

from engine_min.serve import protocol as proto
from engine_min.serve import responses as wire
from engine_min.serve.engine_loop import EngineLoop, ShuttingDown
from engine_min.serve.errors import error_response, openai_error_middleware
from engine_min.serve.metrics import ServerMetrics
from engine_min.serve.prepare import MAX_CHARS_PER_TOKEN, RequestPreparation  # noqa: F401
from engine_min.serve.prepare import Prepared as _Prepared
from engine_min.serve.run import ServerThread  # noqa: F401  (re-exported: tests, benches)
from engine_min.serve.kv_event_routes import add_kv_event_routes
from engine_min.serve.tokenize_routes import add_tokenize_routes
from engine_min.serve.model_routes import add_model_routes, model_card

logger = logging.getLogger(__name__)

SERVING_KEY: web.AppKey["OpenAIServing"] = web.AppKey("serving")


def _dumps_lenient(obj: Any) -> str:
    return json.dumps(obj, default=str)


_json_error = error_response


class OpenAIServing(RequestPreparation):
    """The HTTP handlers; one per app.

    Args:
        engine_loop: the ``EngineLoop`` owning the engine.
        model_name: the served name, or several (as vLLM's ``--served-model-name``):
            ``/v1/models`` lists each, a request may name any (or omit it), responses report
            the first.
        max_model_len: prompt + completion limit in tokens.
    """

    def __init__(self, engine_loop: EngineLoop, model_name: str | Sequence[str],
                 max_model_len: int):
        self.engine_loop = engine_loop
        self.engine = engine_loop.engine
        self.tokenizer = self.engine.tokenizer
        self.model_names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        if not self.model_names:
            raise ValueError("at least one served model name is needed")
        self.model_name = self.model_names[0]
        self.max_model_len = max_model_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.created = int(time.time())
        #: set at shutdown (``engine_min.serve.run.drain``): new requests get 503
        self.draining = False
        self._inflight: set[str] = set()   # request ids submitted and not yet answered

    @property
    def num_inflight(self) -> int:
        """Generation requests submitted to the engine and not yet answered."""
        return len(self._inflight)

    def abort_inflight(self) -> None:
        """Abort every request in flight as shutting down (``ShuttingDown``: a stream ends
        with finish reason ``"abort"``, an error event and ``[DONE]``; others get 503)."""
        for request_id in list(self._inflight):
            self.engine_loop.abort(request_id, ShuttingDown())

    # ---- endpoints -------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        arrival_s = time.monotonic()
        raw = await request.read()
        try:  # off the event loop: tokenizing a long prompt takes a while
            p = await asyncio.get_running_loop().run_in_executor(None, self._prepare, raw, kind)
        except proto.ApiError as exc:
            return _json_error(exc)
        if self.draining:
            return _json_error(ShuttingDown("The server is shutting down."))
        if not self.engine_loop.alive:
            return _json_error(proto.ApiError("The engine is not running.", status=503,
                                              type="server_error"))
        outputs = self.engine_loop.submit(p.request_id, p.prompt_token_ids, p.sampling,
                                         arrival_s)
        self._inflight.add(p.request_id)
        done = False
        try:
            if p.req.stream:
                resp, done = await self._stream(request, p, outputs)
            else:
                resp = await self._collect(p, outputs)
                done = True
            return resp
        finally:
            self._inflight.discard(p.request_id)
            if not done:  # client gone (cancelled / write failed) or error: free the blocks
                self.engine_loop.abort(p.request_id)

    async def _collect(self, p: _Prepared, outputs: asyncio.Queue) -> web.Response:
        while True:
            out = await outputs.get()
            if isinstance(out, proto.ApiError):
                return _json_error(out)
            if isinstance(out, Exception):
                return _json_error(proto.ApiError(str(out), status=500, type="server_error"))
            if out.finished:
                break
        build = wire.chat_response if p.req.kind == "chat" else wire.completion_response
        usage = wire.usage(out.num_prompt_tokens, len(out.output_token_ids),
                            out.num_cached_tokens)
        body = build(p.request_id, self.model_name, p.created, out.text, out.finish_reason, usage,
                     out.stop_reason)
        if p.req.return_token_ids:
            wire.add_token_ids(body, p.req.kind, out.output_token_ids, p.prompt_token_ids)
        return web.json_response(body)

    def _chunk(self, p: _Prepared, text: str | None, finish_reason: str | None,
               role: bool = False, ids: Any = None, out: Any = None) -> bytes:
        """One SSE chunk; ``text`` None means an empty chat delta. With ``return_token_ids``,
        ``ids`` (``responses.StreamTokenIds``) gives it the token ids not sent yet. ``out``:
        the latest output, for a finishing chunk's ``stop_reason`` and the usage so far of
        ``continuous_usage_stats`` (None: nothing generated yet)."""
        args = (p.request_id, self.model_name, p.created)
        usage = (self._usage_of(p, out) if p.req.include_usage and p.req.continuous_usage
                 else None)
        stop_reason = out.stop_reason if out is not None and finish_reason else None
        if p.req.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            chunk = wire.chat_chunk(*args, delta, finish_reason, p.req.include_usage,
                                    stop_reason, usage)
        else:
            chunk = wire.completion_chunk(*args, text or "", finish_reason,
                                          p.req.include_usage, stop_reason, usage)
        if ids is not None:
            ids.attach(chunk, p.req.kind, tokens=not role)
        return wire.sse(chunk)

    async def _stream(self, request: web.Request, p: _Prepared, outputs: asyncio.Queue
                      ) -> tuple[web.StreamResponse, bool]:
        """Send the SSE stream; returns the response and whether the request ran to its end
        (False: the client went away mid-stream)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._stream_events(resp, p, outputs)
        except ConnectionResetError:
            logger.info("client of %s disconnected mid-stream; aborting", p.request_id)
            return resp, False
        return resp, True

    async def _stream_events(self, resp: web.StreamResponse, p: _Prepared,
                             outputs: asyncio.Queue) -> None:
        """Write the request's SSE chunks as its outputs arrive.

        A chat stream's ``{"role": "assistant", "content": ""}`` chunk goes out together with
        the first generated token (after prefill), as vLLM's ``serving_chat`` sends it: clients
        (``vllm bench serve --backend openai-chat``, genai-perf) time the first chunk that has
        ``choices`` as the first token, so sent at acceptance it made their TTFT the queueing
        time instead of the prefill."""
        # a stop string kept in the output needs no holding back (vLLM's stop buffer is 0)
        streamer = wire.TextStreamer(() if p.req.sampling.get("include_stop_str_in_output")
                                     else p.req.sampling.get("stop", ()))
        role_sent = p.req.kind != "chat"
        last = None  # the latest output (its usage ends a stream cut by shutdown)
        ids = wire.StreamTokenIds(p.prompt_token_ids) if p.req.return_token_ids else None
        while True:
            out = await outputs.get()
            if isinstance(out, Exception):
                err = out if isinstance(out, proto.ApiError) else proto.ApiError(
                    str(out), status=500, type="server_error")
                if isinstance(out, ShuttingDown):  # cut by shutdown: say so in the choices too
                    await resp.write(self._chunk(p, None if p.req.kind == "chat" else "",
                                                 "abort", ids=ids, out=last))
                    if p.req.include_usage:
                        await resp.write(self._usage_chunk(p, last))
                await resp.write(wire.sse(proto.error_body(err.message, err.type, err.param,
                                                            err.code)))
                break
            if ids is not None:
                ids.update(out.output_token_ids)
            if not role_sent and (out.output_token_ids or out.finished):
                await resp.write(self._chunk(p, None, None, role=True, ids=ids))
                role_sent = True
            delta = streamer.delta(out.text, out.finished)
            if p.req.kind == "chat":
                if delta:
                    await resp.write(self._chunk(p, delta, None, ids=ids, out=out))
                if out.finished:
                    await resp.write(self._chunk(p, None, out.finish_reason, ids=ids, out=out))
            elif delta or out.finished:
                await resp.write(self._chunk(p, delta, out.finish_reason if out.finished
                                             else None, ids=ids, out=out))
            last = out
            if out.finished:
                if p.req.include_usage:
                    await resp.write(self._usage_chunk(p, out))
                break
        await resp.write(wire.SSE_DONE)
        await resp.write_eof()

    @staticmethod
    def _usage_of(p: _Prepared, out: Any) -> dict:
        """``out``'s token counts (None: nothing generated yet, the prompt's length and no
        cached tokens)."""
        return (wire.usage(len(p.prompt_token_ids), 0, 0) if out is None else
                wire.usage(out.num_prompt_tokens, len(out.output_token_ids),
                           out.num_cached_tokens))

    def _usage_chunk(self, p: _Prepared, out: Any) -> bytes:
        """The SSE chunk of ``stream_options.include_usage``: ``out``'s token counts."""
        return wire.sse(wire.usage_chunk(p.request_id, self.model_name, p.created, p.req.kind,
                                         self._usage_of(p, out)))

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            model_card(self, name) for name in self.model_names]})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "shutting down"}, status=503)
        if not self.engine_loop.alive:
            return web.json_response({"status": "engine thread stopped"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.engine_loop.metrics.render()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp

    async def debug_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine_loop.stats, dumps=_dumps_lenient)


# ---- app ---------------------------------------------------------------------------------

def model_max_len(engine: Any) -> int:
    """The engine's prompt + completion limit in tokens (``LLMEngine.max_model_len``: model
    context, config cap and KV pool size)."""
    return int(engine.max_model_len)


def create_app(engine: Any, model_name: str | Sequence[str],
               max_model_len: int | None = None) -> web.Application:
    """An aiohttp app serving ``engine``; the engine thread starts and stops with the app.

    Args:
        engine: an ``LLMEngine`` (or anything with its surface); the app's engine thread becomes
            its only caller.
        model_name: the served model name, or several (the first is reported; any is
            accepted in a request's ``model``).
        max_model_len: prompt + completion limit; default ``model_max_len(engine)``.
    """
    engine_loop = EngineLoop(engine, ServerMetrics())
    serving = OpenAIServing(engine_loop, model_name, max_model_len or model_max_len(engine))
    app = web.Application(client_max_size=64 * 1024 * 1024,
                          middlewares=[openai_error_middleware])
    app[SERVING_KEY] = serving
    app.router.add_post("/v1/completions", serving.completions)
    app.router.add_post("/v1/chat/completions", serving.chat_completions)
    app.router.add_get("/v1/models", serving.models)
    app.router.add_get("/health", serving.health)
    app.router.add_get("/metrics", serving.metrics)
    app.router.add_get("/debug/stats", serving.debug_stats)
    add_tokenize_routes(app, serving)
    add_model_routes(app, serving)
    add_kv_event_routes(app, engine)

    async def _start(_app: web.Application) -> None:
        engine_loop.start()

    async def _stop(_app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, engine_loop.stop)

    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


if __name__ == "__main__":
    from engine_min.serve.cli import main
    main()

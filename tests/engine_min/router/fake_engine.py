"""A fake engine for the router's tests of streams it cannot finish and of its shutdown: a real
aiohttp server on its own thread (``ServerThread``) that answers ``/health``, a chat stream
that is cut, hangs or finishes, and non-streamed completions that take as long as the request
asks; its ``/health`` can be made to fail (``srv.sick``) while its requests hang, as a hung
(``kill -STOP``) engine's do."""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from engine_min.serve.server import ServerThread

ID = "chatcmpl-fake42"


def event(delta: dict, finish=None) -> bytes:
    """One chat chunk event of the fake stream (id ``ID``, model ``fake``, created 7)."""
    return b"data: " + json.dumps({
        "id": ID, "object": "chat.completion.chunk", "created": 7, "model": "fake",
        "choices": [{"index": 0, "delta": delta, "logprobs": None,
                     "finish_reason": finish}]}).encode() + b"\n\n"


EVENTS = [event({"role": "assistant", "content": ""}), event({"content": "Hello"}),
          event({"content": " world"})]
HALF = event({"content": " PARTIAL"})[:-30]


def completion_body(delay_s: float) -> bytes:
    """A non-streamed ``/v1/completions`` body the fake engine answers after ``delay_s``."""
    return json.dumps({"model": "fake", "prompt": "hi", "delay_s": delay_s}).encode()


def fake_engine(mode: str) -> ServerThread:
    """An engine that answers /health and a chat stream: ``EVENTS``, then (mode "cut") half an
    event and a dropped connection, or (mode "hang") nothing more until the client leaves; in
    mode "cut-at-once" the stream's headers and a dropped connection, in mode "silent" nothing
    until the client leaves (not even the headers), in mode "ok" ``EVENTS``, a finishing
    event and ``data: [DONE]``. ``/health`` answers 503 once ``srv.sick`` (an Event) is set.
    ``POST /v1/completions`` answers a completion (text ``"done"``) after the body's
    ``delay_s`` seconds. ``srv.received`` lists the paths of the generation requests it got,
    ``srv.cancelled`` those of completions cancelled before their answer (the router closed the
    connection)."""
    received: list[str] = []
    cancelled: list[str] = []
    sick = threading.Event()

    async def health(_r):
        if sick.is_set():
            return web.json_response({"status": "sick"}, status=503)
        return web.json_response({"status": "ok"})

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        received.append(request.path)
        if mode == "silent":
            await asyncio.sleep(3600)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "cut-at-once":
            await asyncio.sleep(0.1)
            request.transport.abort()
            return resp
        for ev in EVENTS:
            await resp.write(ev)
        if mode == "ok":
            await resp.write(event({}, "stop") + b"data: [DONE]\n\n")
            return resp
        if mode == "cut":
            await resp.write(HALF)
            await asyncio.sleep(0.1)
            request.transport.abort()     # as the kernel does for a SIGKILLed engine
            return resp
        await asyncio.sleep(3600)
        return resp

    async def completion(request: web.Request) -> web.Response:
        delay_s = float((await request.json())["delay_s"])
        received.append(request.path)
        try:
            await asyncio.sleep(delay_s)
        except asyncio.CancelledError:
            cancelled.append(request.path)
            raise
        return web.json_response({
            "id": "cmpl-fake", "object": "text_completion", "created": 7, "model": "fake",
            "choices": [{"index": 0, "text": "done", "logprobs": None,
                         "finish_reason": "stop"}]})
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completion)
    srv = ServerThread(app).start()
    srv.received, srv.cancelled, srv.sick = received, cancelled, sick
    return srv

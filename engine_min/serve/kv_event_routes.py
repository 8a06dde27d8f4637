"""``GET /v1/kv_events`` and ``GET /v1/kv_events/snapshot``: the prefix cache's KV events for
routers (``engine_min.kv_events``; wire format in docs/kv-events.md).

``/v1/kv_events?after=SEQ&timeout=SECONDS[&epoch=EPOCH]`` is a long poll: it answers at once
with every retained batch numbered above ``SEQ``, or waits up to ``timeout`` seconds (at most
``MAX_WAIT_S``) for the next one and answers with an empty list when none came::

    200 {"epoch": str, "latest_seq": int, "batches": [{"seq", "ts", "events": [...]}]}
    410 kv_events_gap  SEQ is older than the retained window, ahead of the log, or ``epoch``
                       is not this process's: resync from the snapshot
    400                a malformed query
    404                the engine runs with KV events off

When the server shuts down (SIGTERM, ``ServerThread.stop``) every open long poll answers at
once with what it has (usually an empty list), so shutdown does not wait out the polls: the
app's ``on_shutdown`` runs before aiohttp waits for the handlers still running.

``/v1/kv_events/snapshot`` gives the cached block hashes exactly after batch ``seq``, with the
hash chain's seed and block size a subscriber needs to hash prompts the way the engine does::

    200 {"epoch", "seq", "block_size", "hash_seed": hex, "medium": "GPU", "block_hashes": [hex]}
"""
from __future__ import annotations

import asyncio
import math
from typing import Any

from aiohttp import web

from engine_min.kv_events import MEDIUM, EventGap, KVEventLog
from engine_min.serve.errors import error_response
from engine_min.serve.protocol import ApiError

#: longest long-poll wait a request may ask for (seconds)
MAX_WAIT_S = 30.0


class KVEventRoutes:
    """Handlers over one engine's ``KVEventLog`` (None: events off, both routes answer 404).

    Args:
        log: the engine's ``kv_event_log``.
        block_size: tokens per block of the engine.
        hash_seed: seed of the engine's block-hash chain (bytes).
    """

    def __init__(self, log: KVEventLog | None, block_size: int, hash_seed: bytes):
        self.log, self.block_size, self.hash_seed = log, block_size, hash_seed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._published = asyncio.Event()
        self._closing = False

    async def on_startup(self, _app: web.Application) -> None:
        self._loop = asyncio.get_running_loop()
        self._published, self._closing = asyncio.Event(), False
        if self.log is not None:
            self.log.on_publish = self._on_publish  # called on the engine thread

    async def on_shutdown(self, _app: web.Application) -> None:
        """End every open long poll now (each answers with what it has)."""
        self._closing = True
        self._wake()

    def _on_publish(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # closed between the check and the call
                pass

    def _wake(self) -> None:
        event, self._published = self._published, asyncio.Event()
        event.set()  # wakes every waiter of the old event; new waiters wait on the new one

    def _disabled(self) -> web.Response:
        return error_response(ApiError("KV events are off on this engine", status=404,
                                       type="not_found_error", code="kv_events_disabled"))

    async def events(self, request: web.Request) -> web.Response:
        if self.log is None:
            return self._disabled()
        q = request.query
        try:
            after = int(q.get("after", "0"))
            timeout = float(q.get("timeout", "0"))
        except ValueError:
            return error_response(ApiError("after must be an int and timeout a number of "
                                           "seconds", param="after"))
        if after < 0 or not math.isfinite(timeout) or timeout < 0:
            return error_response(ApiError("after must be >= 0 and timeout a finite number "
                                           ">= 0", param="timeout"))
        epoch = q.get("epoch")
        deadline = asyncio.get_running_loop().time() + min(timeout, MAX_WAIT_S)
        while True:
            published = self._published  # taken before reading, so no batch is missed
            try:
                batches = self.log.since(after, epoch)
            except EventGap as exc:
                return error_response(ApiError(f"{exc}; resync from /v1/kv_events/snapshot",
                                               status=410, type="gone_error",
                                               code="kv_events_gap"))
            remaining = deadline - asyncio.get_running_loop().time()
            if batches or remaining <= 0 or self._closing:
                return web.json_response({"epoch": self.log.epoch,
                                          "latest_seq": self.log.latest_seq,
                                          "batches": [b.to_json() for b in batches]})
            try:
                await asyncio.wait_for(published.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def snapshot(self, request: web.Request) -> web.Response:
        if self.log is None:
            return self._disabled()
        snap = self.log.snapshot()
        return web.json_response({"epoch": snap.epoch, "seq": snap.seq,
                                  "block_size": self.block_size,
                                  "hash_seed": self.hash_seed.hex(), "medium": MEDIUM,
                                  "block_hashes": [h.hex() for h in snap.block_hashes]})


def add_kv_event_routes(app: web.Application, engine: Any) -> KVEventRoutes:
    """Serve ``engine.kv_event_log`` on ``app`` (an engine without one: the routes say 404)."""
    bm = getattr(engine, "block_manager", None)
    routes = KVEventRoutes(getattr(engine, "kv_event_log", None),
                           getattr(bm, "block_size", 0), getattr(bm, "hash_seed", b""))
    app.on_startup.append(routes.on_startup)
    app.on_shutdown.append(routes.on_shutdown)
    app.router.add_get("/v1/kv_events", routes.events)
    app.router.add_get("/v1/kv_events/snapshot", routes.snapshot)
    return routes

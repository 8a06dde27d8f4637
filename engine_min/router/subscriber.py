"""One upstream engine as the router tracks it (``Engine``: health, load, index) and the two
loops that keep it current (``EngineSubscriber``).

Per engine, on the router's event loop::

    health loop (every health_interval_s)     GET /health  -> up / down
                                              GET /metrics -> engine_num_requests_running
                                                              + engine_num_requests_waiting
    events loop (while up)                    GET /v1/kv_events/snapshot       (when not ready)
                                              GET /v1/kv_events?after=SEQ&epoch=E&timeout=T
                                              410 (gap, new epoch) -> drop, reload the snapshot

An engine goes down when its connection is refused or reset (here or on a request the proxy
sends it) or after ``MAX_SOFT_FAILURES`` health checks in a row fail otherwise (timeout, non-200);
going down drops its index (``router_index_blocks`` 0, ``router_engine_healthy`` 0). The next
successful health check puts it back with an empty index that the events loop rebuilds from the
snapshot (empty after a restart). ``generation`` counts the downs, so an answer that was in
flight while the engine went down is thrown away instead of refilling a dropped index.

An engine without the events endpoints (404) is still routed to, by load, with an empty index.

With a shared store (``fetch_store_namespace``), each time an engine comes into service its
``GET /debug/stats`` field ``store_namespace`` (the kvstore namespace its connector saves
chunks under; absent or null without a store) is read once into ``Engine.store_namespace``.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable
from urllib.parse import urlsplit

import aiohttp

from engine_min.router.index import EngineIndex, ResyncNeeded
from engine_min.router.metrics import RouterMetrics
from engine_min.router.reasons import describe_error

logger = logging.getLogger("engine_min.router")

#: health checks failing other than by a refused/reset connection before the engine goes down
MAX_SOFT_FAILURES = 3
_LOAD_SERIES = (b"engine_num_requests_running", b"engine_num_requests_waiting")


class Engine:
    """One upstream engine.

    Attributes:
        url: base URL (``http://host:port``, no trailing slash); its metrics label.
        position: its place in the router's list (round-robin order).
        index: its prefix cache as known from its events.
        healthy: in service.
        inflight: requests the router has sent it and not yet finished.
        reported_load: running + waiting requests from its last ``/metrics`` (0 if unknown).
        generation: incremented each time it goes down.

    Requests in flight to it register a callback (``on_down``) that its next ``mark_down``
    calls with the reason: a request sent to an engine that is taken out (health failed, it
    hangs) ends instead of waiting for it.
    """

    def __init__(self, url: str, position: int, metrics: RouterMetrics):
        self.url, self.position, self.metrics = url, position, metrics
        self.index = EngineIndex()
        self.healthy = False
        self.inflight = 0
        self.reported_load = 0
        self.generation = 0
        self.events_supported = True
        #: its kvstore ``Namespace`` (``fetch_store_namespace``); None: no store, or unknown
        self.store_namespace = None
        self.store_namespace_read = False
        self._up = asyncio.Event()
        self._down_callbacks: set = set()
        metrics.add_engine(url)

    @property
    def load(self) -> int:
        """Requests in flight: the router's own count, or the engine's reported running +
        waiting when larger (other clients, or requests the router counts as finished first)."""
        return max(self.inflight, self.reported_load)

    def mark_down(self, reason: str, log: bool = True) -> None:
        """Take the engine out of service and drop its index (no-op when already down); logs
        one warning unless ``log`` is False (the caller logs it). Each callback registered by
        ``on_down`` is called once with ``reason`` (then forgotten)."""
        if self.healthy and log:
            logger.warning("engine %s taken out: %s", urlsplit(self.url).netloc, reason)
        callbacks, self._down_callbacks = self._down_callbacks, set()
        for callback in callbacks:
            callback(reason)
        self.healthy = False
        self.generation += 1
        self.reported_load = 0
        self.store_namespace, self.store_namespace_read = None, False
        self._up.clear()
        self.index.drop()
        self.metrics.engine_healthy.labels(self.url).set(0)
        self.metrics.index_blocks.labels(self.url).set(0)

    def on_down(self, callback) -> Callable[[], None]:
        """Have ``callback(reason: str)`` called at the engine's next ``mark_down`` (on the
        event loop; it must not block). Returns a function that forgets the callback (call it
        once the request is over)."""
        self._down_callbacks.add(callback)
        return lambda: self._down_callbacks.discard(callback)

    def mark_up(self) -> None:
        """Put the engine (back) in service with an empty index, to be rebuilt from its
        snapshot."""
        if not self.healthy:
            logger.info("engine %s in service", self.url)
            self.index.drop()
            self.healthy = True
            self._up.set()
            self.metrics.engine_healthy.labels(self.url).set(1)

    async def wait_up(self) -> None:
        await self._up.wait()

    def set_index_gauge(self) -> None:
        self.metrics.index_blocks.labels(self.url).set(self.index.num_blocks)


def parse_load(metrics_text: bytes) -> int:
    """``engine_num_requests_running + engine_num_requests_waiting`` from an engine's
    Prometheus text (series missing count 0)."""
    total = 0.0
    for line in metrics_text.splitlines():
        for name in _LOAD_SERIES:
            if line.startswith(name) and line[len(name):len(name) + 1] in (b" ", b"{"):
                try:
                    total += float(line.rsplit(b" ", 1)[1])
                except ValueError:
                    pass
    return int(total)


class EngineSubscriber:
    """Keeps one ``Engine`` current: its health/load loop and its events loop.

    Args:
        engine: the engine to track.
        session: the router's client session.
        health_interval_s: seconds between health checks.
        poll_timeout_s: long-poll wait of ``/v1/kv_events`` (the engine caps it at 30).
    """

    def __init__(self, engine: Engine, session: aiohttp.ClientSession,
                 health_interval_s: float = 1.0, poll_timeout_s: float = 10.0,
                 fetch_store_namespace: bool = False):
        self.engine, self.session = engine, session
        self.health_interval_s, self.poll_timeout_s = health_interval_s, poll_timeout_s
        self.fetch_store_namespace = fetch_store_namespace
        self._soft_failures = 0

    async def run(self) -> None:
        """Both loops until cancelled."""
        await asyncio.gather(self._health_loop(), self._events_loop())

    # ---- health and load -----------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval_s)

    async def check_health(self) -> bool:
        """One health check (and load poll); updates the engine. Returns its health."""
        e, timeout = self.engine, aiohttp.ClientTimeout(total=max(5.0, self.health_interval_s))
        try:
            async with self.session.get(e.url + "/health", timeout=timeout) as r:
                await r.read()
                ok = r.status == 200
            if ok:
                async with self.session.get(e.url + "/metrics", timeout=timeout) as r:
                    text = await r.read()
                    load = parse_load(text) if r.status == 200 else 0
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as exc:
            hard = (isinstance(exc, (aiohttp.ClientConnectionError, ConnectionError))
                    and not isinstance(exc, asyncio.TimeoutError))
            if hard:  # refused or reset: it is not there
                e.mark_down(f"/health: {describe_error(exc)}")
                return False
            ok = False
        if ok:
            self._soft_failures = 0
            e.mark_up()
            e.reported_load = load
            if self.fetch_store_namespace and not e.store_namespace_read:
                await self.read_store_namespace(timeout)
            return True
        self._soft_failures += 1
        if self._soft_failures >= MAX_SOFT_FAILURES:
            e.mark_down(f"/health failed {self._soft_failures} times in a row")
        return False

    async def read_store_namespace(self, timeout: aiohttp.ClientTimeout) -> None:
        """Read the engine's ``store_namespace`` from ``GET /debug/stats`` (once per time in
        service; a failure is logged and retried at the next health check)."""
        from connectors.prompt_keys import parse_namespace
        e, gen = self.engine, self.engine.generation
        try:
            async with self.session.get(e.url + "/debug/stats", timeout=timeout) as r:
                stats = await r.json(content_type=None) if r.status == 200 else None
            d = stats.get("store_namespace") if isinstance(stats, dict) else None
            ns = parse_namespace(d) if d is not None else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError,
                TypeError) as exc:
            logger.warning("engine %s: cannot read its store namespace from /debug/stats: "
                           "%r", e.url, exc)
            return
        if gen != e.generation:
            return
        e.store_namespace, e.store_namespace_read = ns, True
        if ns is None:
            logger.warning("engine %s reports no store namespace (no --kvstore-* flags?): "
                           "scored without the shared store", e.url)
        else:
            logger.info("engine %s saves to store namespace %s", e.url, ns.describe())

    # ---- events --------------------------------------------------------------------------
    async def _events_loop(self) -> None:
        e = self.engine
        while True:
            await e.wait_up()
            try:
                await self.sync_once()
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as exc:
                logger.debug("events of %s: %r", e.url, exc)
                await asyncio.sleep(min(1.0, self.health_interval_s))

    async def sync_once(self) -> None:
        """Load the snapshot if the index is not ready, then apply one long poll's batches.

        Raises:
            aiohttp.ClientError, asyncio.TimeoutError: the engine did not answer.
            ValueError: a malformed snapshot.
        """
        e = self.engine
        gen = e.generation
        if not e.index.ready:
            snap = await self._get_json("/v1/kv_events/snapshot", self.poll_timeout_s + 10)
            if snap is None or gen != e.generation:
                return
            e.index.load_snapshot(snap)
            e.set_index_gauge()
        q = f"?after={e.index.seq}&epoch={e.index.epoch}&timeout={self.poll_timeout_s:g}"
        answer = await self._get_json("/v1/kv_events" + q, self.poll_timeout_s + 10)
        if gen != e.generation or not e.index.ready:
            return
        if answer is None:  # 410: fell behind or the engine restarted
            e.index.drop()
            return
        try:
            e.index.apply(answer)
        except ResyncNeeded as exc:
            logger.info("events of %s: %s; resyncing", e.url, exc)
            e.index.drop()
        e.set_index_gauge()

    async def _get_json(self, path: str, timeout_s: float) -> dict | None:
        """The JSON answer of ``GET path``; None on 410. Raises ValueError on other statuses
        (after a pause on 404: the engine publishes no events)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.get(self.engine.url + path, timeout=timeout) as r:
            body = await r.read()
            if r.status == 410:
                return None
            if r.status == 404 and self.engine.events_supported:
                self.engine.events_supported = False
                logger.warning("engine %s publishes no KV events (404 on %s): routed by load "
                               "only", self.engine.url, path.split("?")[0])
            if r.status != 200:
                if r.status == 404:
                    await asyncio.sleep(30)
                raise ValueError(f"{path.split('?')[0]}: HTTP {r.status}")
            self.engine.events_supported = True
            return json.loads(body)

"""The router's HTTP app: OpenAI routes proxied to the engine the policy picks.

Per ``POST /v1/completions`` / ``POST /v1/chat/completions``::

    read body -> token ids + block hashes (engine_min.router.prompt), on a worker thread
                 unless the body is small and nearly all its text tokenized before
                 (+ the store's chunk keys, with a shared kvstore daemon)
              -> [shared store: POST /v1/lookup, deadline-bounded; engine_min.router.
                  store_lookup: hits beyond the store's]
              -> score healthy engines (index hits x block_size, load) -> policy decision
              -> POST to the engine (router_overhead_seconds ends here)
              -> relay: a stream event by event as it arrives, else the whole answer;
                 status, content type and error bodies unchanged

A body the router cannot parse goes to the least-loaded engine, which answers its own error.
A request whose pooled (keep-alive) connection the engine had closed (disconnected or reset
before any answer came back) is first sent once more to the same engine on a fresh connection
(``router_stale_connection_retries_total``): an engine that closed an idle connection, or
restarted on the same port, is not taken out for it. An engine that fails before the client got
any byte of its answer (connection refused, the fresh connection failing too, the stream cut
before its first event) is taken out and the request is sent to the next best engine (reason
``retry``); a stream's headers go out with its first event, so an engine
dying during prefill costs no failed request. An engine failing after events went to the client
is taken out, logged (one warning: engine, request id, bytes relayed) and counted
(``router_failed_requests_total``); the client's stream ends as an engine's does at its
shutdown: a chunk with ``finish_reason`` ``"abort"``, an error event (code ``engine_failed``)
and ``data: [DONE]`` (``engine_min.router.stream_end``). No healthy engine: 503 with an OpenAI
error object. An engine taken out while requests wait on it (its health checks failed: it
hangs, as after ``kill -STOP``) fails them the same way at once (``Engine.on_down``,
``EngineTakenOut``): retried elsewhere before any byte went to the client, else ended. There is
no read timeout between an engine's bytes: a non-streamed answer sends nothing until it is
done, and a long prefill must not be cut; a hung engine is found by its health checks. A write
to a client that left (its connection closing, as when it stops reading at ``data: [DONE]``)
fails with aiohttp's ``ClientConnectionResetError`` like an engine's connection would; it ends
that request only, the engine stays in service.

At shutdown (the app's ``on_shutdown``) the router logs how many requests and streams are in
flight, lets them run for up to ``shutdown_timeout_s``, then ends the streams still open the same
way (error code ``server_shutting_down``) and answers the other requests 503
(``engine_min.router.shutdown``).

``GET /v1/models`` is the first healthy engine's; ``GET /health`` is 200 while at least one
engine is healthy (503 otherwise); ``GET /metrics`` is ``engine_min.router.metrics``.
"""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from engine_min.router.answers import no_engine, relay_whole, upstream_headers
from engine_min.router.metrics import RouterMetrics
from engine_min.router.policy import RETRY, Candidate, Decision
from engine_min.router.reasons import EngineTakenOut, describe_error
from engine_min.router.prompt import (PreparedPrompt, PromptEncoder, prepare_source,
                                      prompt_source)
from engine_min.router.shutdown import Inflight
from engine_min.router.stream_end import UpstreamFailed, relay_stream
from engine_min.router.store_lookup import StoreLookup, choose_with_store, store_can_change_pick
from engine_min.router.subscriber import Engine, EngineSubscriber
from engine_min.router.upstream import STALE_ERRORS, StaleConnection, unless_lost
from engine_min.serve.errors import openai_error_middleware

logger = logging.getLogger("engine_min.router")

ROUTER_KEY: web.AppKey["Router"] = web.AppKey("router")

#: a request is prepared on the event loop, without the hop to a worker thread (about 0.1 ms,
#: more when the CPUs are busy), when its body is at most this long and at most
#: INLINE_MAX_NEW_CHARS of its prompt text was not tokenized before (about 0.4 ms of BPE)
INLINE_MAX_BODY_BYTES = 64 * 1024
INLINE_MAX_NEW_CHARS = 1024


class Router:
    """Handlers and state of one router app.

    Args:
        urls: the engines' base URLs (``http://host:port``), in round-robin order.
        tokenizer: the served model's ``engine_min.tokenizer.Tokenizer``.
        policy: a ``CacheAwarePolicy`` or ``RoundRobinPolicy``.
        health_interval_s: seconds between an engine's health checks.
        poll_timeout_s: long-poll wait on an engine's ``/v1/kv_events``.
        max_connections: concurrent upstream connections (streams, polls) of the one session.
        store: the shared kvstore daemon's ``StoreLookup`` (None: no shared store); used by
            the cache-aware policy only.
        shutdown_timeout_s: at shutdown, seconds requests in flight may still run before the
            streams still open are ended.
    """

    def __init__(self, urls: list[str], tokenizer, policy, health_interval_s: float = 1.0,
                 poll_timeout_s: float = 10.0, max_connections: int = 4096,
                 store: StoreLookup | None = None, shutdown_timeout_s: float = 5.0):
        self.metrics = RouterMetrics()
        self.store = store if getattr(policy, "name", "") == "cache-aware" else None
        self.engines = [Engine(u.rstrip("/"), i, self.metrics) for i, u in enumerate(urls)]
        self.tokenizer, self.policy = tokenizer, policy
        self.encoder = PromptEncoder(tokenizer)
        self.health_interval_s, self.poll_timeout_s = health_interval_s, poll_timeout_s
        self.max_connections = max_connections
        self.session: aiohttp.ClientSession | None = None
        #: a session without a connection pool, for the one retry after a stale connection
        self.fresh_session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self.inflight = Inflight(self.metrics)
        self.streams = self.inflight.streams   # engine StreamReader -> SseRelayState
        self.shutdown_timeout_s = shutdown_timeout_s

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self, _app: web.Application | None = None) -> None:
        """Open the session; start each engine's subscriber (a first health check runs at
        once) and the shared store's probe (``StoreLookup.watch``)."""
        conn = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                    keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=conn, auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        self.fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        for e in self.engines:
            sub = EngineSubscriber(e, self.session, self.health_interval_s, self.poll_timeout_s,
                                   fetch_store_namespace=self.store is not None)
            self._tasks.append(asyncio.create_task(sub.run(), name=f"subscriber {e.url}"))
        if self.store is not None:   # logs whether the shared store answers, and changes
            self._tasks.append(asyncio.create_task(self.store.watch(self.session),
                                                   name="store probe"))

    async def drain(self, _app: web.Application | None = None) -> None:
        """Let requests in flight run for up to ``shutdown_timeout_s``, then end those still
        in flight (``engine_min.router.shutdown.Inflight.drain``)."""
        await self.inflight.drain(self.shutdown_timeout_s, logger)

    async def stop(self, _app: web.Application | None = None) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for session in (self.session, self.fresh_session):
            if session is not None:
                await session.close()
        if self.store is not None:
            self.store.close()

    # ---- routing -------------------------------------------------------------------------
    def _candidates(self, prompt: PreparedPrompt, exclude: set[int]) -> list[Candidate]:
        out = []
        for e in self.engines:
            if not e.healthy or e.position in exclude:
                continue
            key, hits = e.index.hash_key, 0
            if key is not None and prompt.hashes.get(key):
                hits = e.index.hit_blocks(prompt.hashes[key]) * e.index.block_size
            out.append(Candidate(e.position, hits, e.load))
        return out

    def _decide(self, prompt: PreparedPrompt, exclude: set[int],
                store_hits: dict[bytes, int]) -> Decision | None:
        """The policy's pick among healthy engines not in ``exclude``; with ``store_hits``
        (tokens per store ``ns_id``) on advantages over the store. ``hit_tokens`` of the
        decision is the engine's own (local) hit."""
        cands = self._candidates(prompt, exclude)
        if not cands:
            return None
        if prompt.token_ids is None:
            return self.policy.least_loaded(cands)
        n = len(prompt.token_ids)
        if not store_hits:
            return self.policy.choose(cands, n)
        by_pos = {}
        for c in cands:
            ns = self.engines[c.position].store_namespace
            if ns is not None and ns.ns_id in store_hits:
                by_pos[c.position] = min(store_hits[ns.ns_id], n)
        return choose_with_store(self.policy, cands, by_pos, n)

    def _store_can_matter(self, prompt: PreparedPrompt) -> bool:
        """False when the store's hits cannot change the decision: every healthy engine saves
        to one namespace and ``store_can_change_pick`` says no
        (``engine_min.router.store_lookup``)."""
        cands = self._candidates(prompt, set())
        spaces = {None if (ns := self.engines[c.position].store_namespace) is None else ns.ns_id
                  for c in cands}
        if len(spaces) != 1 or None in spaces or prompt.token_ids is None:
            return True
        ns = self.engines[cands[0].position].store_namespace
        return store_can_change_pick(self.policy, cands, len(prompt.token_ids),
                                     ns.layout.chunk_size)

    def _prepare(self, source, keys: list, namespaces: list
                 ) -> tuple[PreparedPrompt, dict[bytes, bytes] | None]:
        """The prompt of a ``prompt_source`` (``prepare_source``) and, with ``namespaces``,
        its store lookup bodies. CPU-bound."""
        prompt = prepare_source(self.tokenizer, source, keys, self.encoder)
        if not namespaces or prompt.token_ids is None:
            return prompt, None
        return prompt, self.store.lookup_bodies(namespaces, _ids(prompt))

    async def _prepare_request(self, raw: bytes, kind: str, keys: list, namespaces: list
                               ) -> tuple[PreparedPrompt, dict[bytes, bytes] | None]:
        """``_prepare`` on the event loop for a small body whose text is nearly all cached
        (the lookup bodies left to ``_store_hits``, which makes them only for a lookup it
        makes), else on a worker thread (bodies included: a long prompt's keys cost the
        loop up to a millisecond)."""
        loop = asyncio.get_running_loop()
        if len(raw) > INLINE_MAX_BODY_BYTES:
            return await loop.run_in_executor(None, lambda: self._prepare(
                prompt_source(self.tokenizer, raw, kind), keys, namespaces))
        source = prompt_source(self.tokenizer, raw, kind)
        if isinstance(source, str) and \
                self.encoder.num_uncached_chars(source) > INLINE_MAX_NEW_CHARS:
            return await loop.run_in_executor(None, self._prepare, source, keys, namespaces)
        return self._prepare(source, keys, [])

    async def _store_hits(self, prompt: PreparedPrompt, namespaces: list,
                          bodies: dict[bytes, bytes] | None) -> dict[bytes, int]:
        """Store hit tokens per ``ns_id`` (``StoreLookup.hit_tokens``; ``{}`` past its
        deadline or on an error), ``{}`` when no namespace has a full chunk of the prompt.
        When the lookup cannot change the pick it is not made (counted ``skipped``) and every
        namespace scores 0: the pick any answer would give (``choose_with_store``, whose
        least-loaded fallback prefers the engine holding the most). ``bodies`` None: made
        here, only for a lookup made."""
        if not namespaces or prompt.token_ids is None:
            return {}
        askable = self.store.askable(namespaces, len(prompt.token_ids))
        if not askable:
            return {}
        if not self._store_can_matter(prompt):
            self.metrics.store_lookups.labels("skipped").inc()
            return {ns.ns_id: 0 for ns in askable}
        if bodies is None:
            bodies = self.store.lookup_bodies(namespaces, _ids(prompt))
        return await self.store.hit_tokens(self.session, bodies, self.metrics)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` and ``POST /v1/chat/completions`` (ended at shutdown by
        ``Inflight.run``)."""
        return await self.inflight.run(request, self._generate)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        raw = await request.read()
        kind = "chat" if request.path.endswith("/chat/completions") else "completion"
        keys = [e.index.hash_key for e in self.engines if e.healthy and e.index.ready]
        namespaces = [] if self.store is None else [
            e.store_namespace for e in self.engines
            if e.healthy and e.store_namespace is not None]
        prompt, bodies = await self._prepare_request(raw, kind, keys, namespaces)
        store_hits = await self._store_hits(prompt, namespaces, bodies)
        tried: set[int] = set()
        while True:
            decision = self._decide(prompt, tried, store_hits)
            if decision is None:
                self.metrics.failed("no_healthy_engine")
                return no_engine(bool(tried))
            e = self.engines[decision.position]
            reason = RETRY if tried else decision.reason
            self.metrics.requests.labels(e.url, reason).inc()
            self.metrics.predicted_hit_tokens.labels(e.url).inc(decision.hit_tokens)
            if not tried:
                self.metrics.overhead.observe(time.perf_counter() - t0)
                if store_hits and e.store_namespace is not None:
                    self.metrics.store_hit_tokens.inc(
                        store_hits.get(e.store_namespace.ns_id, 0))
            try:
                return await self._send(request, e, raw)
            except UpstreamFailed as exc:
                e.mark_down(f"{request.path}: {exc}")
                tried.add(e.position)

    async def _send(self, request: web.Request, e: Engine, raw: bytes) -> web.StreamResponse:
        """``_forward`` on a pooled connection, then once on a fresh one if the engine closed
        or reset the pooled connection before its answer's headers came back (whether the
        request's write failed or the close came after it went out: ``StaleConnection``, which
        says why a POST may be sent twice). A failure after the headers is not retried here:
        bytes of the answer may be with the client. Raises UpstreamFailed."""
        try:
            return await self._forward(request, e, raw, self.session)
        except StaleConnection as exc:
            logger.debug("%s: %s; retrying on a fresh connection", e.url, exc)
            self.metrics.stale_connection_retries.labels(e.url).inc()
            return await self._forward(request, e, raw, self.fresh_session)

    async def _forward(self, request: web.Request, e: Engine, raw: bytes,
                       session: aiohttp.ClientSession) -> web.StreamResponse:
        """Send ``raw`` to ``e`` over ``session`` and relay its answer. Raises StaleConnection
        (closed or reset before the answer's headers), UpstreamFailed (another failure before
        any byte went to the client); a stream cut later is ended by ``_relay_stream``. A
        client that left (its connection closed as the router wrote to it) is not the
        engine's failure: the relays return (``engine_min.router.stream_end.ClientGone``)."""
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        e.inflight += 1
        lost: asyncio.Future = asyncio.get_running_loop().create_future()
        forget = e.on_down(lambda why: lost.done() or lost.set_result(why))
        up: aiohttp.ClientResponse | None = None
        try:
            try:
                cm = await unless_lost(session.post(e.url + request.path, data=raw,
                                                    headers=headers), lost)
            except aiohttp.ClientConnectorError as exc:  # could not connect: nothing stale
                raise UpstreamFailed(describe_error(exc)) from exc
            except STALE_ERRORS as exc:
                raise StaleConnection(repr(exc)) from exc
            async with cm as up:
                # taken out from now on: its answer (a stream, a whole body) fails as if cut
                lost.add_done_callback(lambda f: f.cancelled() or up.content.set_exception(
                    EngineTakenOut(f.result())))
                if up.headers.get("Content-Type", "").startswith("text/event-stream"):
                    return await self._relay_stream(request, up, e)
                return await relay_whole(request, up, e, self.metrics)
        except (aiohttp.ClientConnectionError, ConnectionRefusedError) as exc:
            raise UpstreamFailed(describe_error(exc)) from exc
        finally:
            forget()
            if lost.done() and up is not None:
                up.close()           # a hung engine's connection is not reused
            elif not lost.done():
                lost.cancel()
            e.inflight -= 1

    async def _relay_stream(self, request: web.Request, up: aiohttp.ClientResponse,
                            e: Engine) -> web.StreamResponse:
        return await relay_stream(request, up, e, upstream_headers(up), self.metrics,
                                  self.streams)

    # ---- the other routes ----------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` of the first healthy engine."""
        for e in self.engines:
            if not e.healthy:
                continue
            try:
                async with self.session.get(e.url + "/v1/models") as up:
                    body = await up.read()
                    return web.Response(body=body, status=up.status, headers=upstream_headers(up))
            except aiohttp.ClientError as exc:
                e.mark_down(f"/v1/models: {describe_error(exc)}")
        return no_engine(False)

    async def health(self, request: web.Request) -> web.Response:
        up = [e.url for e in self.engines if e.healthy]
        if not up:
            return no_engine(False)
        return web.json_response({"status": "ok", "healthy_engines": up})

    async def metrics_route(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        return resp


def _ids(prompt: PreparedPrompt):
    """The prompt's token ids as its uint32 array when it has one, else its list."""
    return prompt.id_array if prompt.id_array is not None else prompt.token_ids


def create_router_app(urls: list[str], tokenizer, policy, health_interval_s: float = 1.0,
                      poll_timeout_s: float = 10.0, store: StoreLookup | None = None,
                      shutdown_timeout_s: float = 5.0) -> web.Application:
    """The router's aiohttp app (its ``Router`` is ``app[ROUTER_KEY]``); subscribers start and
    stop with the app.

    Args:
        urls: engine base URLs (``http://host:port``); at least one.
        tokenizer: the served model's tokenizer (``engine_min.tokenizer.load_tokenizer``).
        policy: ``engine_min.router.policy.make_policy(...)``.
        health_interval_s: seconds between health checks of each engine.
        poll_timeout_s: long-poll wait on each engine's events.
        store: the engines' shared kvstore daemon (None: none); cache-aware scores then
            count only what an engine holds beyond it (``engine_min.router.store_lookup``).
        shutdown_timeout_s: at shutdown, seconds requests in flight may run before the streams
            still open are ended (abort chunk, error event, ``[DONE]``).

    Raises:
        ValueError: no URL.
    """
    if not urls:
        raise ValueError("at least one engine URL is needed")
    router = Router(urls, tokenizer, policy, health_interval_s, poll_timeout_s, store=store,
                    shutdown_timeout_s=shutdown_timeout_s)
    app = web.Application(client_max_size=64 * 1024 * 1024,
                          middlewares=[openai_error_middleware])
    app[ROUTER_KEY] = router
    app.router.add_post("/v1/completions", router.generate)
    app.router.add_post("/v1/chat/completions", router.generate)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_route)
    app.on_startup.append(router.start)
    app.on_shutdown.append(router.drain)
    app.on_cleanup.append(router.stop)
    return app

"""HTTP front of a ``KVStoreBase`` (aiohttp). No store logic: it validates, then calls the store.

Routes (wire format in ``kvstore.daemon.protocol``):

    GET  /healthz        200 while the process serves            (no auth)
    GET  /readyz         200 when ready, 503 while draining      (no auth)
    GET  /metrics        Prometheus text: the store's registry + server metrics (bearer
                         token required when the server has one, like every /v1 route:
                         metrics name namespaces' traffic; give Prometheus the token with
                         ``authorization: {type: Bearer, credentials: T}`` in the scrape job)
    GET  /v1/stats       JSON: store.stats() plus "namespaces" (held, with chunk counts),
                         "unix_socket" (the same-host path's socket or null), "instance"
                         (this daemon start's id), "tier_codecs", "wire_codecs" (as whoami)
                         and a "server" section
    POST /v1/lookup      JSON {namespace, keys}        -> {num_hit_chunks, chunk_size, tiers, ...}
    POST /v1/exists      JSON {namespace, keys}        -> {exists: [bool]}
    POST /v1/get         JSON {namespace, keys}        -> binary message; 404 if no key is found,
                                                        400 if keys is empty
    POST /v1/put         binary message                -> {stored, num_chunks, durable}
                         (get and put: payloads encoded with the lossy codec named by
                         ``X-KVStore-Wire-Codec``, for a namespace that accepts it, else 422;
                         ``kvstore.daemon.wire_codec``)
    POST /v1/remove      JSON {namespace, keys}        -> {removed}
    POST /v1/demote      JSON {namespace, keys}        -> {demoted}: the stored keys become
                                                        first eviction candidates
                                                        (``KVStoreBase.demote``)
    POST /v1/clear       JSON {namespace}, {ns_id: hex} or {all: true} -> {removed}
                         (ns_id: a namespace id as /v1/stats lists it, also one known from
                         disk only; ``kvstore.daemon.state.clear_by_namespace_id``)
    POST /v1/pin         JSON {namespace, keys, lease_s} -> {pinned, lease_s}
    POST /v1/unpin       JSON {namespace, keys}        -> {unpinned}
    GET  /v1/whoami      JSON {tenant, role, cache_salt, unix_socket, instance, tier_codecs,
                         wire_codecs}: the caller's identity, the salt its namespaces must
                         carry (``kvstore.daemon.tenants``), and the daemon's same-host socket
                         (or null), per-start id, lower tiers' value codecs ({"disk": "kivi",
                         "remote": "raw"}: present tiers only; null for a store that is not a
                         ChunkStore) and accepted wire codecs, as /v1/stats gives them

Auth (``kvstore.daemon.tenants``): with a token or tenants configured, every route but /healthz and
/readyz needs ``Authorization: Bearer TOKEN`` of a known tenant (else 401). A tenant may name
only namespaces of its own salt (else 403; readers may only look up, check and get);
``clear {"all": true}``, /v1/stats and /metrics (aggregates over all tenants) need an admin
token (else 403), and so does ``clear {"ns_id": ...}`` of a namespace that no request named
since the daemon started (its tenant is unknown). ``--auth-token`` alone is one admin.

Store calls run on a thread pool so a slow disk tier never blocks the event loop. This module
holds the app, auth/timeout middleware and the JSON routes; the binary get/put routes are in
``kvstore.daemon.payload`` (with a wire codec: ``kvstore.daemon.payload_wire``) and the shared
limits/state/helpers in ``kvstore.daemon.state``. Every answer not streamed carries the
request limits (``X-KVStore-Max-Body-Bytes``, ``X-KVStore-Max-Batch-Keys``): clients split
their batches to fit (``kvstore.daemon.batches``).
"""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvstore.daemon import protocol as P
from kvstore.api import KVStoreBase
# re-exported: kvstore.daemon.server stays the public import path of these
from kvstore.daemon.batches import MAX_BODY_HEADER, MAX_KEYS_HEADER
from kvstore.daemon.budget import BufferPool, ByteBudget  # noqa: F401
from kvstore.daemon.conns import ConnectionGuard
from kvstore.daemon.payload import can_persist, persist  # noqa: F401
from kvstore.daemon.payload_wire import get, put  # noqa: F401
from kvstore.daemon.run import ThreadedServer, serve_until_signal, set_ready  # noqa: F401
from kvstore.daemon.state import (READ_BUFSIZE, STATE_KEY, STORE_KEY, TENANT_KEY,  # noqa: F401
                                  ServerLimits, _json_body, _json_error, _ns_keys, _ok,
                                  _ServerState, authorize, caller, clear_by_namespace_id,
                                  store_tier_codecs)
from kvstore.metrics import tier_codec_info
from kvstore.daemon.tenants import OPEN, WRITE, Forbidden

log = logging.getLogger("kvstore.daemon.server")
UNAUTHENTICATED = frozenset({"/healthz", "/readyz"})


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    """Auth, protocol version, per-request timeout, JSON errors and metrics for every route."""
    state: _ServerState = request.app[STATE_KEY]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource \
        else "unmatched"
    if not state.ready and request.path not in UNAUTHENTICATED:
        resp = _json_error("server is draining (shutting down); retry elsewhere or later", 503)
        resp.force_close()
        return resp
    t0 = time.perf_counter()
    state.in_flight.inc()
    state.active += 1
    conn = state.conns.begin(request)  # the connection is busy: never evicted as idle
    try:
        resp = await _guarded(request, handler, state)
    finally:
        state.conns.end(conn)
        state.in_flight.dec()
        state.active -= 1
    if not resp.prepared:  # every answer names the protocol: clients tell us from other servers
        resp.headers.setdefault(P.VERSION_HEADER, str(P.PROTOCOL_VERSION))
        # and the request limits: clients split their batches to fit (kvstore.daemon.batches)
        resp.headers.setdefault(MAX_BODY_HEADER, str(state.limits.max_body_bytes))
        resp.headers.setdefault(MAX_KEYS_HEADER, str(state.limits.max_batch_keys))
    state.requests.labels(route, str(resp.status)).inc()
    state.latency.labels(route).observe(time.perf_counter() - t0)
    return resp


async def _guarded(request: web.Request, handler, state: _ServerState) -> web.StreamResponse:
    limits = state.limits
    tenant = OPEN
    if state.tenants is not None and request.path not in UNAUTHENTICATED:
        tenant = state.tenants.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            return _json_error("missing or wrong bearer token", 401)
    request[TENANT_KEY] = tenant
    te = request.headers.get("Transfer-Encoding")
    if te is not None and te.strip().lower() != "chunked":  # RFC 9112 6.1: unknown coding
        resp = _json_error(f"Transfer-Encoding {te[:64]!r} is not implemented (only chunked)",
                           501)
        resp.force_close()  # the body's framing is unknown: the connection cannot be reused
        return resp
    try:
        P.check_version(request.headers.get(P.VERSION_HEADER))
        async with asyncio.timeout(limits.request_timeout_s):
            return await handler(request)
    except P.ProtocolError as e:
        return _json_error(str(e), e.status)
    except Forbidden as e:
        return _json_error(str(e), 403)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _json_error(e.reason if e.text is None else e.text, e.status)
    except TimeoutError:
        return _json_error(f"request exceeded {limits.request_timeout_s} s", 504)
    except (ConnectionResetError, asyncio.IncompleteReadError) as e:
        state.conns.client_errors.labels("disconnect").inc()
        log.debug("client went away mid-request on %s: %r", request.path, e)
        return _json_error(f"client went away: {e!r}", 400)
    except web.RequestPayloadError as e:  # a body aiohttp cannot decode (bad gzip/deflate);
        # counted (reason body) when aiohttp's read of the rest of the body logs it again
        log.debug("undecodable request body on %s: %s", request.path, e)
        resp = _json_error(f"cannot decode the request body: {str(e).splitlines()[-1].strip()}",
                           400)
        resp.force_close()  # the rest of the body cannot be read: the connection cannot be reused
        return resp
    except Exception as e:  # noqa: BLE001 - the server stays up; the error goes to the client
        log.exception("internal error on %s", request.path)
        return _json_error(f"internal error: {type(e).__name__}: {e}", 500)


async def healthz(request: web.Request) -> web.Response:
    return _ok({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state: _ServerState = request.app[STATE_KEY]
    if not state.ready:
        return _json_error("draining", 503)
    return _ok({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    caller(request).require_admin("/metrics")
    state: _ServerState = request.app[STATE_KEY]
    text = generate_latest(state.registry)
    if state.store_registry is not None:
        text = generate_latest(state.store_registry) + text
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def stats(request: web.Request) -> web.Response:
    caller(request).require_admin("/v1/stats")
    state: _ServerState = request.app[STATE_KEY]
    out = await state.stats_body(request.app[STORE_KEY])
    return _ok(out)


async def lookup(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request)
    store = request.app[STORE_KEY]
    # An index read under a short lock: inline on the loop when the lock is free (saves the
    # thread-pool hop, ~0.1 ms), on the pool when a put or eviction holds it.
    res = store.try_lookup_keys(ns, keys) if store.capabilities.nonblocking_lookup else None
    if res is None:
        res = await request.app[STATE_KEY].call(store.lookup_keys, ns, keys)
    return _ok({"num_hit_chunks": res.num_hit_chunks, "chunk_size": res.chunk_size,
                "tiers": list(res.tiers), "num_requested_chunks": res.num_requested_chunks})


async def exists(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request)
    found = await request.app[STATE_KEY].call(request.app[STORE_KEY].exists, ns, keys)
    return _ok({"exists": [bool(x) for x in found]})


async def whoami(request: web.Request) -> web.Response:
    """The caller's identity, plus the daemon's ``unix_socket`` (None without a same-host
    path), ``instance``, ``tier_codecs`` and ``wire_codecs`` as /v1/stats gives them (which
    tenant tokens may not read): a client finds the same-host path of this very daemon from
    either, and an engine whether the daemon's tiers use its lossy codec
    (``connectors.codec_check``)."""
    state = request.app[STATE_KEY]
    return _ok({**caller(request).whoami(), "unix_socket": state.unix_socket,
                "instance": state.instance, **state.codec_fields()})


async def remove(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request, WRITE)
    n = await request.app[STATE_KEY].call(request.app[STORE_KEY].remove, ns, keys)
    return _ok({"removed": int(n)})


async def demote(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request, WRITE)
    n = await request.app[STATE_KEY].call(request.app[STORE_KEY].demote, ns, keys)
    return _ok({"demoted": int(n)})


async def clear(request: web.Request) -> web.Response:
    body = await _json_body(request)
    named = [k for k in ("all", "namespace", "ns_id") if k in body]
    if len(named) > 1:  # which one was meant cannot be told: clear nothing
        raise P.ProtocolError(f"clear takes one of namespace, ns_id or all; got {named}")
    if "all" in body and body["all"] is not True:  # "yes", 1, false: not a namespace error
        raise P.ProtocolError(f"'all' must be true (the JSON boolean) to clear every "
                              f"namespace, got {str(body['all'])[:40]!r}")
    if body.get("all") is True:
        caller(request).require_admin('clear {"all": true}')
        ns = None
    elif "ns_id" in body:
        return _ok({"removed": int(await clear_by_namespace_id(request, body["ns_id"]))})
    else:
        if not isinstance(body.get("namespace"), dict):
            raise P.ProtocolError("clear takes one of 'namespace' (an object: the namespace's "
                                  "fields), 'ns_id' (32 hex digits, as /v1/stats lists it) or "
                                  "'all' (true, admin token); got "
                                  f"{sorted(body)[:5] if body else 'an empty object'}")
        ns = P.parse_namespace(body.get("namespace"))
        authorize(request, ns, WRITE)
    n = await request.app[STATE_KEY].call(request.app[STORE_KEY].clear, ns)
    return _ok({"removed": int(n)})


async def pin(request: web.Request) -> web.Response:
    body, ns, keys = await _ns_keys(request, WRITE)
    state: _ServerState = request.app[STATE_KEY]
    lease = body.get("lease_s")
    # ``not > 0`` also refuses NaN (a NaN lease would never expire); infinity is capped below
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))
                              or not lease > 0):
        raise P.ProtocolError(f"lease_s must be a positive number, got {lease!r}")
    lease = float(min(lease or state.limits.max_lease_s, state.limits.max_lease_s))
    n = await state.call(request.app[STORE_KEY].pin, ns, keys, lease)
    return _ok({"pinned": int(n), "lease_s": lease})


async def unpin(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request, WRITE)
    n = await request.app[STATE_KEY].call(request.app[STORE_KEY].unpin, ns, keys)
    return _ok({"unpinned": int(n)})


def create_app(store: KVStoreBase, limits: ServerLimits | None = None,
               store_registry: CollectorRegistry | None = None) -> web.Application:
    """aiohttp application serving ``store``.

    Args:
        store: any ``KVStoreBase`` (thread-safe); the app never closes it (the caller owns it).
        limits: see ``ServerLimits``.
        store_registry: Prometheus registry of the store, exposed on /metrics next to the
            server's own metrics (default: ``store.metrics_registry()``).
    """
    limits = limits or ServerLimits()
    if store_registry is None:
        store_registry = store.metrics_registry()
    app = web.Application(middlewares=[_middleware],
                          client_max_size=min(limits.max_body_bytes, 64 << 20),
                          handler_args={"read_bufsize": READ_BUFSIZE})
    app[STORE_KEY] = store
    state = _ServerState(limits, store_registry)
    caps = store.capabilities
    state.reuse_put_buffers = caps.copies_on_put
    state.get_into_buffers = caps.get_into_buffers
    state.direct = caps.reservations and caps.borrowed_reads
    state.tier_codecs = store_tier_codecs(store)
    tier_codec_info(state.registry, state.tier_codecs or {})
    app[STATE_KEY] = state
    #: connection cap, idle timeout and client-error counters (set up by the runner)
    state.conns = ConnectionGuard(state.registry)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/whoami", whoami)
    for name, fn in (("lookup", lookup), ("exists", exists), ("get", get), ("put", put),
                     ("remove", remove), ("demote", demote), ("clear", clear), ("pin", pin),
                     ("unpin", unpin)):
        app.router.add_post(f"/v1/{name}", fn)

    async def _shutdown_pool(app: web.Application) -> None:
        state.pool.shutdown(wait=True)
    app.on_cleanup.append(_shutdown_pool)
    return app

"""HTTP front of a ``KVStoreBase`` (aiohttp). No store logic: it validates, then calls the store.

Routes (wire format in ``kvstore.protocol``):

    GET  /healthz        200 while the process serves            (no auth)
    GET  /readyz         200 when ready, 503 while draining      (no auth)
    GET  /metrics        Prometheus text: the store's registry + server metrics (bearer
                         token required when the server has one, like every /v1 route:
                         metrics name namespaces' traffic; give Prometheus the token with
                         ``authorization: {type: Bearer, credentials: T}`` in the scrape job)
    GET  /v1/stats       JSON: store.stats() plus a "server" section
    POST /v1/lookup      JSON {namespace, keys}        -> {num_hit_chunks, chunk_size, tiers, ...}
    POST /v1/exists      JSON {namespace, keys}        -> {exists: [bool]}
    POST /v1/get         JSON {namespace, keys}        -> binary message; 404 if no key is found,
                                                        400 if keys is empty
    POST /v1/put         binary message                -> {stored, num_chunks, durable}
    POST /v1/remove      JSON {namespace, keys}        -> {removed}
    POST /v1/clear       JSON {namespace} or {all: true} -> {removed}
    POST /v1/pin         JSON {namespace, keys, lease_s} -> {pinned, lease_s}
    POST /v1/unpin       JSON {namespace, keys}        -> {unpinned}

Store calls run on a thread pool so a slow disk tier never blocks the event loop.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import xxhash
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvstore import protocol as P
from kvstore.api import KVStoreBase
from kvstore.direct import Reservation
# re-exported: kvstore.server stays the public import path of these
from kvstore.server_budget import BufferPool, ByteBudget  # noqa: F401
from kvstore.server_run import ThreadedServer, serve_until_signal, set_ready  # noqa: F401

log = logging.getLogger("kvstore.server")

STORE_KEY = web.AppKey("store", KVStoreBase)
STATE_KEY = web.AppKey("state", object)
UNAUTHENTICATED = frozenset({"/healthz", "/readyz"})
#: Socket read buffer per connection: aiohttp's 64 KiB default pauses the transport every
#: 128 KiB, which halves put throughput with 5.9 MB chunks. It is also memory outside the
#: in-flight byte budget: a put waiting for budget has up to 2x this read ahead per connection.
READ_BUFSIZE = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    """Per-server limits and security settings.

    Attributes:
        auth_token: bearer token required on every route except /healthz and /readyz,
            /metrics included (None: no auth, loopback only unless the CLI was told
            ``--insecure``).
        max_body_bytes: largest request body (bytes); larger -> 413.
        max_batch_keys: most keys/chunks in one request; more -> 413.
        request_timeout_s: wall-clock limit of one request (seconds); beyond -> 504.
        max_lease_s: pins without a lease, or with a longer one, get this lease (seconds), so a
            pin whose client vanished always expires.
        store_threads: threads running store calls.
        max_inflight_bytes: budget of chunk payload bytes held by requests at once (put
            bodies being read and stored, get results being sent); a request that would
            exceed it waits for others to finish, up to ``request_timeout_s`` (then 503). A
            single request larger than the budget runs alone. 0 = no budget.
    """

    auth_token: str | None = None
    max_body_bytes: int = 1 << 30
    max_batch_keys: int = 1024
    request_timeout_s: float = 60.0
    max_lease_s: float = 300.0
    store_threads: int = 4
    max_inflight_bytes: int = 256 << 20


def _shaped(buf: torch.Tensor, layout) -> torch.Tensor:
    return buf.view(layout.torch_dtype).view(layout.shape())  # [L, 2, T, H, D]


class _ServerState:
    """Mutable per-app state: readiness, thread pool, server metrics."""

    def __init__(self, limits: ServerLimits, store_registry: CollectorRegistry | None):
        self.limits = limits
        self.ready = True
        self.active = 0  # requests being served (drain waits for 0)
        self.pool = ThreadPoolExecutor(limits.store_threads, thread_name_prefix="kvstore-io")
        self.budget = ByteBudget(limits.max_inflight_bytes)
        self.buffers = BufferPool(limits.max_inflight_bytes or 256 << 20)
        #: set by create_app: whether the store copies put tensors (so buffers can be reused)
        #: and whether its get_chunks takes ``out`` buffers.
        self.reuse_put_buffers = False
        self.get_into_buffers = False
        #: whether the store does direct I/O (``kvstore.direct``): puts read into reserved
        #: CPU-tier pages, gets send from pinned pages; no staging buffers for those chunks
        self.direct = False
        self.registry = CollectorRegistry()
        self.store_registry = store_registry
        r = self.registry
        self.requests = Counter("kvstore_server_requests_total", "HTTP requests by route and "
                                "status", ["route", "status"], registry=r)
        self.latency = Histogram("kvstore_server_request_duration_seconds", "Request latency",
                                 ["route"], registry=r, buckets=(.0005, .001, .0025, .005, .01,
                                                                 .025, .05, .1, .25, .5, 1, 2.5,
                                                                 5, 10))
        self.in_flight = Gauge("kvstore_server_requests_in_flight", "Requests being served",
                               registry=r)
        self.bytes_in = Counter("kvstore_server_received_bytes_total", "Payload bytes accepted "
                                "by put", registry=r)
        self.bytes_out = Counter("kvstore_server_sent_bytes_total", "Payload bytes sent by get",
                                 registry=r)
        self.rejected = Counter("kvstore_server_rejected_chunks_total", "Chunks refused by "
                                "validation (checksum, layout)", ["reason"], registry=r)
        self.inflight_bytes = Gauge("kvstore_server_inflight_payload_bytes", "Payload bytes "
                                    "held by requests (budget: max_inflight_bytes)", registry=r)
        self.inflight_bytes.set_function(lambda: self.budget.held)

    def budget_wait_s(self) -> float:
        """How long a request may wait for payload budget: 90% of the request timeout, so the
        wait ends in a 503 (busy) before the request's own 504."""
        return 0.9 * self.limits.request_timeout_s

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is being served (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.active == 0

    async def call(self, fn: Callable, *args: Any) -> Any:
        """Run a blocking store call on the store thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


def _json_error(message: str, status: int) -> web.Response:
    return web.json_response(P.error_body(message, status), status=status,
                             headers={P.VERSION_HEADER: str(P.PROTOCOL_VERSION)})


def _token_ok(request: web.Request, token: str) -> bool:
    got = request.headers.get("Authorization", "")
    scheme, _, value = got.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


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
    try:
        resp = await _guarded(request, handler, state)
    finally:
        state.in_flight.dec()
        state.active -= 1
    state.requests.labels(route, str(resp.status)).inc()
    state.latency.labels(route).observe(time.perf_counter() - t0)
    return resp


async def _guarded(request: web.Request, handler, state: _ServerState) -> web.StreamResponse:
    limits = state.limits
    if limits.auth_token and request.path not in UNAUTHENTICATED \
            and not _token_ok(request, limits.auth_token):
        return _json_error("missing or wrong bearer token", 401)
    try:
        P.check_version(request.headers.get(P.VERSION_HEADER))
        async with asyncio.timeout(limits.request_timeout_s):
            return await handler(request)
    except P.ProtocolError as e:
        return _json_error(str(e), e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _json_error(e.reason if e.text is None else e.text, e.status)
    except TimeoutError:
        return _json_error(f"request exceeded {limits.request_timeout_s} s", 504)
    except (ConnectionResetError, asyncio.IncompleteReadError) as e:
        log.info("client went away mid-request on %s: %r", request.path, e)
        return _json_error(f"client went away: {e!r}", 400)
    except Exception as e:  # noqa: BLE001 - the server stays up; the error goes to the client
        log.exception("internal error on %s", request.path)
        return _json_error(f"internal error: {type(e).__name__}: {e}", 500)


async def _json_body(request: web.Request) -> dict:
    if not request.body_exists:
        raise P.ProtocolError("empty request body; expected a JSON object")
    return P.parse_json(await request.read(), "request body")


def _check_fits(store: KVStoreBase, ns) -> None:
    """Refuse (400) a namespace whose chunk does not fit the store's tiers (``register``)."""
    register = getattr(store, "register", None)
    if register is not None:
        try:
            register(ns)
        except ValueError as e:
            raise P.ProtocolError(str(e)) from None


async def _ns_keys(request: web.Request):
    body = await _json_body(request)
    state: _ServerState = request.app[STATE_KEY]
    ns = P.parse_namespace(body.get("namespace"))
    _check_fits(request.app[STORE_KEY], ns)
    keys = P.parse_keys(ns, body.get("keys"), state.limits.max_batch_keys)
    return body, ns, keys


def _ok(obj: dict) -> web.Response:
    return web.json_response(obj, headers={P.VERSION_HEADER: str(P.PROTOCOL_VERSION)})


async def healthz(request: web.Request) -> web.Response:
    return _ok({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state: _ServerState = request.app[STATE_KEY]
    if not state.ready:
        return _json_error("draining", 503)
    return _ok({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    state: _ServerState = request.app[STATE_KEY]
    text = generate_latest(state.registry)
    if state.store_registry is not None:
        text = generate_latest(state.store_registry) + text
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def stats(request: web.Request) -> web.Response:
    state: _ServerState = request.app[STATE_KEY]
    out = dict(await state.call(request.app[STORE_KEY].stats))
    out["server"] = {"protocol_version": P.PROTOCOL_VERSION, "ready": state.ready,
                     "in_flight": int(state.in_flight._value.get()),
                     "max_body_bytes": state.limits.max_body_bytes,
                     "max_batch_keys": state.limits.max_batch_keys,
                     "max_inflight_bytes": state.limits.max_inflight_bytes,
                     "inflight_bytes": state.budget.held,
                     "inflight_bytes_peak": state.budget.peak}
    return _ok(out)


async def lookup(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request)
    store = request.app[STORE_KEY]
    # An index read under a short lock: inline on the loop when the lock is free (saves the
    # thread-pool hop, ~0.1 ms), on the pool when a put or eviction holds it.
    try_inline = getattr(store, "try_lookup_keys", None)
    res = try_inline(ns, keys) if try_inline is not None else None
    if res is None:
        res = await request.app[STATE_KEY].call(store.lookup_keys, ns, keys)
    return _ok({"num_hit_chunks": res.num_hit_chunks, "chunk_size": res.chunk_size,
                "tiers": list(res.tiers), "num_requested_chunks": res.num_requested_chunks})


async def exists(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request)
    found = await request.app[STATE_KEY].call(request.app[STORE_KEY].exists, ns, keys)
    return _ok({"exists": [bool(x) for x in found]})


async def remove(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request)
    n = await request.app[STATE_KEY].call(request.app[STORE_KEY].remove, ns, keys)
    return _ok({"removed": int(n)})


async def clear(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if body.get("all") is True:
        ns = None
    else:
        ns = P.parse_namespace(body.get("namespace"))
    n = await request.app[STATE_KEY].call(request.app[STORE_KEY].clear, ns)
    return _ok({"removed": int(n)})


async def pin(request: web.Request) -> web.Response:
    body, ns, keys = await _ns_keys(request)
    state: _ServerState = request.app[STATE_KEY]
    lease = body.get("lease_s")
    # ``not > 0`` also refuses NaN (a NaN lease would never expire); infinity is capped below
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))
                              or not lease > 0):
        raise P.ProtocolError(f"lease_s must be a positive number, got {lease!r}")
    lease = min(float(lease or state.limits.max_lease_s), state.limits.max_lease_s)
    n = await state.call(request.app[STORE_KEY].pin, ns, keys, lease)
    return _ok({"pinned": int(n), "lease_s": lease})


async def unpin(request: web.Request) -> web.Response:
    _, ns, keys = await _ns_keys(request)
    n = await request.app[STATE_KEY].call(request.app[STORE_KEY].unpin, ns, keys)
    return _ok({"unpinned": int(n)})


#: Get payloads go to the transport in slices of this many bytes: asyncio copies what the
#: socket does not take at once into its write buffer, so smaller slices bound that copy.
WRITE_SLICE = 1 << 20


async def get(request: web.Request) -> web.StreamResponse:
    _, ns, keys = await _ns_keys(request)
    if not keys:  # else "none of the 0 keys is stored" (404), as if keys were missing
        raise P.ProtocolError("'keys' must be a non-empty list")
    state: _ServerState = request.app[STATE_KEY]
    if state.direct:
        return await _get_direct(request, state, ns, keys)
    budget = len(keys) * ns.layout.chunk_bytes
    await state.budget.acquire(budget, state.budget_wait_s())
    bufs = []
    try:
        if state.get_into_buffers:
            bufs = [state.buffers.take(ns.layout.chunk_bytes) for _ in keys]
            out = [_shaped(b, ns.layout) for b in bufs]
            chunks = await state.call(request.app[STORE_KEY].get_chunks, ns, keys, out)
            del out
        else:
            chunks = await state.call(request.app[STORE_KEY].get_chunks, ns, keys)
        if all(c is None for c in chunks):
            raise P.ProtocolError(f"none of the {len(keys)} keys is stored", 404)
        entries, views = await state.call(_describe, keys, chunks)
        del chunks
        head = P.get_response_header(entries)
        resp = web.StreamResponse(headers={"Content-Type": P.BINARY_CONTENT_TYPE,
                                           P.VERSION_HEADER: str(P.PROTOCOL_VERSION)})
        total = sum(v.nbytes for v in views)
        resp.content_length = len(head) + total
        await resp.prepare(request)
        await resp.write(head)
        while views:
            v = views.pop(0)  # drop each chunk as soon as it is sent
            for off in range(0, v.nbytes, WRITE_SLICE):
                await resp.write(v[off:off + WRITE_SLICE])
            del v
        await resp.write_eof()
    finally:
        state.buffers.give(bufs)  # asyncio has copied whatever the socket did not take
        state.budget.release(budget)
    state.bytes_out.inc(total)
    return resp


async def _get_direct(request: web.Request, state: "_ServerState", ns, keys) -> web.StreamResponse:
    """Get without staging copies (``ChunkStore.borrow_chunks``): chunks in the CPU tier are
    sent from the arena pages themselves while reader-pinned; only chunks read from a lower
    tier take payload budget."""
    store = request.app[STORE_KEY]
    borrowed = await state.call(store.borrow_chunks, ns, keys)
    budget, total = 0, 0
    try:
        if borrowed.lower:
            budget = len(borrowed.lower) * ns.layout.chunk_bytes
            await state.budget.acquire(budget, state.budget_wait_s())
            await state.call(borrowed.read_lower)
        if all(p is None for p in borrowed.parts):
            raise P.ProtocolError(f"none of the {len(keys)} keys is stored", 404)
        entries = await state.call(_describe_parts, keys, borrowed.parts, ns.layout)
        head = P.get_response_header(entries)
        resp = web.StreamResponse(headers={"Content-Type": P.BINARY_CONTENT_TYPE,
                                           P.VERSION_HEADER: str(P.PROTOCOL_VERSION)})
        total = sum(e.nbytes for e in entries if e.found)
        resp.content_length = len(head) + total
        await resp.prepare(request)
        await resp.write(head)
        for parts in borrowed.parts:
            for v in parts or ():
                mv = memoryview(v.numpy())
                for off in range(0, mv.nbytes, WRITE_SLICE):
                    await resp.write(mv[off:off + WRITE_SLICE])
        await resp.write_eof()
        await _flushed(request, state.limits.request_timeout_s)
    finally:
        _drop_unsent(request)
        await state.call(borrowed.release)
        state.budget.release(budget)
    state.bytes_out.inc(total)
    return resp


async def _flushed(request: web.Request, timeout_s: float) -> None:
    """Wait until the transport has handed every queued byte to the kernel: asyncio may keep
    references to the memory it was given to write (3.12+), which is about to be unpinned."""
    transport = request.transport
    deadline = time.monotonic() + timeout_s
    while transport is not None and not transport.is_closing() \
            and transport.get_write_buffer_size() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


def _drop_unsent(request: web.Request) -> None:
    """Abort the connection if bytes of pinned pages may still be queued (the request failed
    or timed out mid-send): never send memory that is about to be reused."""
    transport = request.transport
    if transport is not None and not transport.is_closing() and transport.get_write_buffer_size():
        transport.abort()


def _describe_parts(keys, parts, layout):
    entries = []
    for k, p in zip(keys, parts):
        if p is None:
            entries.append(P.ChunkEntry(k, found=False))
            continue
        h = xxhash.xxh3_64()
        for v in p:
            h.update(memoryview(v.numpy()))
        entries.append(P.ChunkEntry(k, sum(v.numel() for v in p), P.dtype_name(layout.torch_dtype),
                                    tuple(layout.shape()), h.hexdigest()))
    return entries


def _describe(keys, chunks):
    entries, views = [], []
    for k, c in zip(keys, chunks):
        if c is None:
            entries.append(P.ChunkEntry(k, found=False))
            continue
        e, v = P.entry_for(k, c)
        entries.append(e)
        views.append(v)
    return entries, views


async def put(request: web.Request) -> web.Response:
    state: _ServerState = request.app[STATE_KEY]
    store = request.app[STORE_KEY]
    budget, bufs, items, handed = [0], [], [], False
    try:
        ns, entries, durable = await _read_put(request, state, store, budget, bufs, items)
        keys = [e.key for e in entries]
        handed = True
        if state.direct:
            stored = await state.call(store.commit_chunks, ns, keys, items)
        else:
            stored = await state.call(store.put_chunks, ns, keys, items)
        if durable:
            await state.call(persist, store, ns, keys, items)
        del items
    finally:
        if not handed and state.direct:
            store.release_reservations(items)  # nothing read is visible: the pages go back
        if state.reuse_put_buffers or not handed:
            state.buffers.give(bufs)  # the store copied them, or never saw them
        state.budget.release(budget[0])
    state.bytes_in.inc(sum(e.nbytes for e in entries))
    return _ok({"stored": int(stored), "num_chunks": len(entries), "durable": durable})


def can_persist(store: KVStoreBase) -> bool:
    """Whether ``store`` can make a put durable: ``store.has_disk_tier`` when the store says,
    else whether it has a ``persist`` method."""
    has_disk = getattr(store, "has_disk_tier", None)
    if has_disk is not None:
        return bool(has_disk)
    return callable(getattr(store, "persist", None))


def persist(store: KVStoreBase, ns, keys, tensors) -> None:
    """Make just-put chunks durable with ``store.persist`` (write through to the disk tier and
    wait for the commit). Blocking; call on the store pool.

    Raises:
        P.ProtocolError(507): some chunk is not committed on disk (no room: everything pinned
            or the tier too small; or the write was dropped).
    """
    n = store.persist(ns, keys, tensors)
    if n is not None and n < len(keys):
        raise P.ProtocolError(f"disk tier has no room for a durable put: {n} of {len(keys)} "
                              "chunks committed", 507)


async def _read_put(request: web.Request, state: _ServerState, store: KVStoreBase,
                    budget: list[int], bufs: list, items: list):
    """Read and validate a put body: header first, then each payload against its checksum.

    Payloads land straight in pages reserved in the store's CPU tier when it has one
    (``ChunkStore.reserve_chunks``; not for durable puts, which go through buffers to the disk
    tier). A chunk for which the CPU tier has no room (every chunk pinned) is read and
    dropped (None in ``items``; the store counts it rejected) unless the store has a lower
    tier to take it. Other payloads land in buffers of the server's pool (appended to ``bufs`` for the caller to give
    back) once their bytes fit in the server's byte budget (``budget[0]`` is set to what was
    taken, for the caller to release). ``items`` receives one ``Reservation`` or tensor per
    chunk (the caller releases reservations on failure).

    Nothing is handed to the store until every payload has arrived and checked out.
    """
    limits = state.limits
    declared = request.content_length
    if declared is not None and declared > limits.max_body_bytes:
        raise P.ProtocolError(f"body of {declared} bytes exceeds {limits.max_body_bytes}", 413)
    if declared == 0 or not request.body_exists:
        raise P.ProtocolError("empty put body")
    reader = request.content
    hdr_len = P.decode_preamble(await _read_exact(reader, P.PREAMBLE_BYTES))
    header = P.parse_json(await _read_exact(reader, hdr_len), "put header")
    ns, entries, durable = P.parse_put_header(header, limits.max_batch_keys)
    _check_fits(store, ns)
    if durable and not can_persist(store):
        raise P.ProtocolError("durable put needs a disk tier (serve with --disk-path and "
                              "--disk-bytes)")
    expected = P.PREAMBLE_BYTES + hdr_len + P.payload_total(entries)
    if expected > limits.max_body_bytes:
        raise P.ProtocolError(f"body of {expected} bytes exceeds {limits.max_body_bytes}", 413)
    if declared is not None and declared != expected:
        raise P.ProtocolError(f"body is {declared} bytes but its header declares {expected}")
    layout = ns.layout
    staged = [True] * len(entries)
    if state.direct and not durable:
        items.extend(await state.call(store.reserve_chunks, ns, [e.key for e in entries]))
        # no room in the CPU tier (all pinned): stage for a lower tier, or read and drop
        lower = bool(getattr(store, "has_lower_tiers", True))
        staged = [it is None and lower for it in items]
    else:
        items.extend([None] * len(entries))
    payload = sum(e.nbytes for e, st in zip(entries, staged) if st)
    if payload:
        await state.budget.acquire(payload, state.budget_wait_s())
        budget[0] = payload
    scratch, carry = None, [None]
    for i, e in enumerate(entries):
        if isinstance(items[i], Reservation):
            views = items[i].memoryviews()
        elif not staged[i]:  # stored already, or no room anywhere: read through scratch
            scratch = scratch or memoryview(bytearray(DROP_SCRATCH))
            views = [scratch[:min(DROP_SCRATCH, e.nbytes - o)]
                     for o in range(0, e.nbytes, DROP_SCRATCH)]
        else:
            buf = state.buffers.take(layout.chunk_bytes)
            bufs.append(buf)
            items[i] = _shaped(buf, layout)  # [L, 2, T, H, D]
            views = [memoryview(buf.numpy())]
        h = xxhash.xxh3_64()
        for view in views:
            await _read_into(reader, view, h, carry)
        if h.hexdigest() != e.xxh3:
            state.rejected.labels("checksum").inc()
            raise P.ProtocolError(f"checksum mismatch for key {e.key.hex()[:16]}...; "
                                  "nothing stored")
    if carry[0] is not None or (declared is None and await reader.read(1)):
        raise P.ProtocolError("trailing bytes after the last declared payload")
    return ns, entries, durable


#: Bytes of the scratch buffer that the payload of a dropped chunk is read through.
DROP_SCRATCH = 256 << 10


async def _read_exact(reader, n: int) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise P.ProtocolError(f"truncated body: got {len(e.partial)} of {n} bytes") from None


async def _read_into(reader, view: memoryview, hasher, carry: list) -> None:
    """Fill ``view`` from ``reader``, feeding each piece to ``hasher`` while it is in cache.

    Reads whole received pieces (``readany``: no joining copy inside the reader); the part of
    a piece beyond ``view`` is left in ``carry[0]`` (a memoryview) for the next call.

    Raises:
        P.ProtocolError: the body ended first.
    """
    pos, n = 0, view.nbytes
    while pos < n:
        data, carry[0] = carry[0], None
        if data is None:
            got = await reader.readany()
            if not got:
                raise P.ProtocolError(f"truncated payload: got {pos} of {n} bytes")
            data = memoryview(got)
        take = min(n - pos, data.nbytes)
        if take < data.nbytes:
            carry[0] = data[take:]
            data = data[:take]
        view[pos:pos + take] = data
        hasher.update(data)
        pos += take


def create_app(store: KVStoreBase, limits: ServerLimits | None = None,
               store_registry: CollectorRegistry | None = None) -> web.Application:
    """aiohttp application serving ``store``.

    Args:
        store: any ``KVStoreBase`` (thread-safe); the app never closes it (the caller owns it).
        limits: see ``ServerLimits``.
        store_registry: Prometheus registry of the store, exposed on /metrics next to the
            server's own metrics (defaults to ``store.registry`` or ``store.metrics.registry``
            when the store has one).
    """
    limits = limits or ServerLimits()
    if store_registry is None:
        store_registry = _find_registry(store)
    app = web.Application(middlewares=[_middleware],
                          client_max_size=min(limits.max_body_bytes, 64 << 20),
                          handler_args={"read_bufsize": READ_BUFSIZE})
    app[STORE_KEY] = store
    state = _ServerState(limits, store_registry)
    state.reuse_put_buffers = bool(getattr(store, "copies_on_put", False))
    try:
        state.get_into_buffers = "out" in inspect.signature(store.get_chunks).parameters
    except (TypeError, ValueError):
        state.get_into_buffers = False
    state.direct = all(callable(getattr(store, m, None)) for m in
                       ("reserve_chunks", "commit_chunks", "release_reservations", "borrow_chunks"))
    app[STATE_KEY] = state
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/stats", stats)
    for name, fn in (("lookup", lookup), ("exists", exists), ("get", get), ("put", put),
                     ("remove", remove), ("clear", clear), ("pin", pin), ("unpin", unpin)):
        app.router.add_post(f"/v1/{name}", fn)

    async def _shutdown_pool(app: web.Application) -> None:
        state.pool.shutdown(wait=True)
    app.on_cleanup.append(_shutdown_pool)
    return app


def _find_registry(store: Any) -> CollectorRegistry | None:
    for path in (("registry",), ("metrics", "registry")):
        obj = store
        for attr in path:
            obj = getattr(obj, attr, None)
        if isinstance(obj, CollectorRegistry):
            return obj
    return None

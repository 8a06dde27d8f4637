"""Shared state of the kvstore server's routes: limits, per-app state (thread pool, byte
budget, buffer pool, server metrics), app keys and small request/response helpers."""
from __future__ import annotations

import asyncio
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
from aiohttp import helpers as _aiohttp_helpers
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.daemon import protocol as P
from kvstore.api import KVStoreBase
from kvstore.daemon.budget import BufferPool, ByteBudget
from kvstore.daemon.tenants import OPEN, READ, WRITE, Forbidden, Tenant, TenantTable
from kvstore.daemon.wire_codec import WIRE_CODECS

STORE_KEY = web.AppKey("store", KVStoreBase)
STATE_KEY = web.AppKey("state", object)
#: request key of the authenticated caller (``kvstore.daemon.tenants.Tenant``)
TENANT_KEY = (web.RequestKey("tenant", Tenant) if hasattr(web, "RequestKey")  # aiohttp >= 3.12
              else "kvstore.tenant")
UNAUTHENTICATED = frozenset({"/healthz", "/readyz"})
#: Socket read buffer per connection: aiohttp's 64 KiB default pauses the transport every
#: 128 KiB, which halves put throughput with 5.9 MB chunks. It is also memory outside the
#: in-flight byte budget: a put waiting for budget has up to 2x this read ahead per connection.
READ_BUFSIZE = 1 << 20
#: namespaces whose fields /v1/stats can show (the latest named by requests)
MAX_NOTED_NAMESPACES = 1024


@dataclass(frozen=True)
class ServerLimits:
    """Per-server limits and security settings.

    Attributes:
        auth_token: bearer token required on every route except /healthz and /readyz,
            /metrics included (None: no auth, loopback only unless the CLI was told
            ``--insecure``). It is an admin tenant named ``admin`` (``kvstore.daemon.tenants``).
        tenants: tenants with their own tokens, roles and salts (``kvstore.daemon.tenants``); with
            ``auth_token`` too, that token is one more admin.
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
    tenants: TenantTable | None = None
    max_body_bytes: int = 1 << 30
    max_batch_keys: int = 1024
    request_timeout_s: float = 60.0
    max_lease_s: float = 300.0
    store_threads: int = 4
    max_inflight_bytes: int = 256 << 20


def tenant_table(limits: ServerLimits) -> TenantTable | None:
    """The credentials of ``limits``: its tenants, plus ``auth_token`` as an admin named
    ``admin``; None when neither is set.

    Raises:
        ValueError: the auth token is also a tenant's token.
    """
    tenants = list(limits.tenants.tenants) if limits.tenants is not None else []
    if limits.auth_token:
        tenants += TenantTable.single(limits.auth_token).tenants
    return TenantTable(tenants) if tenants else None


def store_tier_codecs(store: KVStoreBase) -> dict[str, str] | None:
    """The value codec of each lower tier of ``store`` (``StoreConfig.tier_codecs``:
    ``{"disk": "kivi", "remote": "raw"}``, present tiers only, ``{}`` for memory tiers alone),
    or None for a store without a ``StoreConfig`` (its tiers' codecs are not known here)."""
    from kvstore.config import StoreConfig
    cfg = getattr(store, "config", None)
    return cfg.tier_codecs() if isinstance(cfg, StoreConfig) else None


def codec_text(tier_codecs: dict[str, str] | None) -> str:
    """One line naming the lower tiers' codecs and the wire codecs (the daemon's start log):
    ``tier codecs: disk kivi, remote raw; wire codecs accepted: raw, kivi, int8, fp8``."""
    if tier_codecs is None:
        tiers = "unknown (not a ChunkStore)"
    else:
        tiers = ", ".join(f"{t} {c}" for t, c in tier_codecs.items()) \
            or "none (memory tiers only: exact bytes)"
    return f"tier codecs: {tiers}; wire codecs accepted: {', '.join(WIRE_CODECS)}"


def caller(request: web.Request) -> Tenant:
    """The authenticated tenant of ``request`` (set by the auth middleware)."""
    return request.get(TENANT_KEY, OPEN)


def authorize(request: web.Request, ns, access: str = READ) -> None:
    """Refuse (403, ``kvstore.daemon.tenants.Forbidden``) a namespace the caller may not use this way."""
    caller(request).check(ns.cache_salt, access)


def _shaped(buf: torch.Tensor, layout) -> torch.Tensor:
    return buf.view(layout.torch_dtype).view(layout.shape())  # [L, 2, T, H, D]


class _ServerState:
    """Mutable per-app state: readiness, thread pool, server metrics."""

    def __init__(self, limits: ServerLimits, store_registry: CollectorRegistry | None):
        self.limits = limits
        #: who may call (None: no auth, every caller is ``kvstore.daemon.tenants.OPEN``)
        self.tenants = tenant_table(limits)
        self.ready = True
        #: this daemon start's id (``/v1/stats`` and the same-host path's ``hello``): a client
        #: that found the Unix socket in an HTTP daemon's stats can tell it reached that daemon
        self.instance = secrets.token_hex(8)
        #: path of the same-host path's Unix socket while it listens (``shm_server``), else None
        self.unix_socket: str | None = None
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
        self.rejected.labels("checksum")  # (at 0 from the start)
        self.inflight_bytes = Gauge("kvstore_server_inflight_payload_bytes", "Payload bytes "
                                    "held by requests (budget: max_inflight_bytes)", registry=r)
        self.inflight_bytes.set_function(lambda: self.budget.held)
        #: namespaces named by requests since start, by ns_id (for /v1/stats), oldest first
        self.namespaces: dict[bytes, Any] = {}
        #: the store's lower tiers' codecs (``store_tier_codecs``; set by create_app)
        self.tier_codecs: dict[str, str] | None = None

    def codec_fields(self) -> dict:
        """``{"tier_codecs": {tier: codec} or None, "wire_codecs": [names]}``: the value codec
        of each lower tier of the store (disk, remote; a lossy one applies only to namespaces
        whose ``lossy_codec`` names it) and the wire codecs requests may name
        (``kvstore.daemon.wire_codec``); in ``/v1/whoami`` and ``/v1/stats``."""
        return {"tier_codecs": None if self.tier_codecs is None else dict(self.tier_codecs),
                "wire_codecs": list(WIRE_CODECS)}

    def note_namespace(self, ns) -> None:
        """Remember ``ns`` (a request named it) for ``namespace_stats``; keeps the latest
        ``MAX_NOTED_NAMESPACES``."""
        if ns.ns_id not in self.namespaces:
            if len(self.namespaces) >= MAX_NOTED_NAMESPACES:
                self.namespaces.pop(next(iter(self.namespaces)))
            self.namespaces[ns.ns_id] = ns

    def namespace_stats(self, store: KVStoreBase) -> list[dict]:
        """The namespaces ``store`` holds chunks of, most chunks first: ``{"ns_id": hex,
        "num_chunks": chunks over all tiers (a chunk in two tiers counted once), "namespace":
        its ``to_dict()`` or None when no request named it since start (chunks on disk from
        before a restart: ``kvstore stats`` shows "fields unknown"; an admin clears it
        by its id, ``clear_by_namespace_id``)}``. Reads the store's key snapshot
        (``KVStoreBase.stored_keys``)."""
        keys = store.stored_keys()
        counts: dict[bytes, int] = {}
        for k in keys:
            counts[k.ns_id] = counts.get(k.ns_id, 0) + 1
        out = []
        for ns_id, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            ns = self.namespaces.get(ns_id)
            out.append({"ns_id": ns_id.hex(), "num_chunks": n,
                        "namespace": None if ns is None else ns.to_dict()})
        return out

    async def stats_body(self, store: KVStoreBase) -> dict:
        """The ``/v1/stats`` answer: ``store.stats()``, ``namespaces`` (``namespace_stats``),
        ``unix_socket`` (the same-host path's socket, or None), ``instance``, ``tier_codecs``
        and ``wire_codecs`` (``codec_fields``) and a ``server`` section. Store calls run on
        the pool."""
        out = dict(await self.call(store.stats))
        out["namespaces"] = await self.call(self.namespace_stats, store)
        out["unix_socket"] = self.unix_socket
        out["instance"] = self.instance
        out.update(self.codec_fields())
        out["server"] = {"protocol_version": P.PROTOCOL_VERSION, "ready": self.ready,
                         "in_flight": int(self.in_flight._value.get()),
                         "max_body_bytes": self.limits.max_body_bytes,
                         "max_batch_keys": self.limits.max_batch_keys,
                         "max_inflight_bytes": self.limits.max_inflight_bytes,
                         "inflight_bytes": self.budget.held,
                         "inflight_bytes_peak": self.budget.peak,
                         "http_parser": "python" if _aiohttp_helpers.NO_EXTENSIONS else "c"}
        return out

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

    async def call_shielded(self, fn: Callable, *args: Any) -> Any:
        """``call`` that runs to its end even when the awaiting request is cancelled (its
        timeout fired): a commit or release must not be dropped from the pool's queue, and
        the caller must not reuse what ``fn`` still reads (see ``call_owned``)."""
        return await asyncio.shield(self.call(fn, *args))

    async def call_owned(self, fn: Callable, undo: Callable[[Any], Any], *args: Any) -> Any:
        """``call`` of a store call whose result holds resources (page reservations, reader
        pins). If the request is cancelled while ``fn`` is queued or running, ``undo(result)``
        runs on the pool once ``fn`` returns, so nothing is leaked; then CancelledError."""
        fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: self._undo(f, undo))
            raise

    def _undo(self, fut: asyncio.Future, undo: Callable[[Any], Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        try:
            self.pool.submit(undo, fut.result())
        except RuntimeError:  # pool shut down (server stopping): undo inline
            undo(fut.result())


def _json_error(message: str, status: int) -> web.Response:
    return web.json_response(P.error_body(message, status), status=status,
                             headers={P.VERSION_HEADER: str(P.PROTOCOL_VERSION)})


async def _json_body(request: web.Request) -> dict:
    if not request.body_exists:
        raise P.ProtocolError("empty request body; expected a JSON object")
    return P.parse_json(await request.read(), "request body")


def _check_fits(store: KVStoreBase, ns, state: "_ServerState | None" = None) -> None:
    """Refuse (400) a namespace whose chunk does not fit the store's tiers (``register``);
    note an accepted one in ``state`` (``/v1/stats`` lists it)."""
    try:
        store.register(ns)
    except ValueError as e:
        raise P.ProtocolError(str(e)) from None
    if state is not None:
        state.note_namespace(ns)


async def _ns_keys(request: web.Request, access: str = READ):
    """``(body, namespace, keys)`` of a JSON request, once the caller may use the namespace
    for ``access`` (403 otherwise) and it fits the store (400 otherwise)."""
    body = await _json_body(request)
    state: _ServerState = request.app[STATE_KEY]
    ns = P.parse_namespace(body.get("namespace"))
    authorize(request, ns, access)
    _check_fits(request.app[STORE_KEY], ns, state)
    keys = P.parse_keys(ns, body.get("keys"), state.limits.max_batch_keys)
    return body, ns, keys


_NS_ID_HEX = re.compile(r"[0-9a-fA-F]{32}")


def parse_ns_id(value: Any) -> bytes:
    """The 16-byte namespace id of a request's ``"ns_id"`` (32 hex digits, as ``/v1/stats``
    lists it).

    Raises:
        ProtocolError: anything else (400).
    """
    if not isinstance(value, str) or not _NS_ID_HEX.fullmatch(value):
        raise P.ProtocolError(f'"ns_id" must be a namespace id of 32 hex digits (as /v1/stats '
                              f'lists it), got {str(value)[:80]!r}')
    return bytes.fromhex(value)


async def clear_by_namespace_id(request: web.Request, value: Any) -> int:
    """``/v1/clear {"ns_id": HEX}``: remove every chunk of the namespace with that id; the
    number removed.

    A namespace a request named since the daemon started has known fields: the caller needs
    write access to it (a tenant: its own salt), and ``store.clear`` removes it. One known by
    its id alone (chunks on disk from before a restart) cannot be attributed to a tenant: only
    an admin may clear it, through the store's ``clear_namespace_id``. A tenant gets the same
    403 for a namespace of another salt as for an unattributed one.

    Raises:
        ProtocolError: a malformed id (400); a store without ``clear_namespace_id`` for an
            unattributed id (501).
        Forbidden: the caller may not clear it (403).
    """
    ns_id = parse_ns_id(value)
    state: _ServerState = request.app[STATE_KEY]
    store = request.app[STORE_KEY]
    ns = state.namespaces.get(ns_id)
    who = caller(request)
    if not who.is_admin and (ns is None or not who.owns(ns.cache_salt)):
        raise Forbidden(f"tenant {who.name!r} may clear by id only a namespace of its own salt "
                        f"that a request named since the daemon started; one known from disk "
                        f"only needs an admin token (or clear it by its fields: "
                        f'{{"namespace": ...}})')
    if ns is not None:
        authorize(request, ns, WRITE)  # a reader of its own salt: read-only (403)
        return await state.call(store.clear, ns)
    clear_id = getattr(store, "clear_namespace_id", None)
    if clear_id is None:
        raise P.ProtocolError(f"this daemon's store ({type(store).__name__}) cannot clear a "
                              f"namespace by its id alone; name the namespace", 501)
    return await state.call(clear_id, ns_id)


#: Why a put's chunk was not stored (``put_answer``'s ``first_refused.reason``).
PUT_REFUSALS = ("parent_missing", "no_room")


async def put_answer(state: _ServerState, store, ns, keys, parents, stored: int,
                     durable: bool) -> dict:
    """A put's answer: ``{stored, num_chunks, durable, already_stored, refused,
    first_refused}``. ``stored`` chunks were newly stored, ``already_stored`` were stored
    before (kept, not rewritten, except to disk for a durable put), ``refused`` were not
    stored; ``first_refused`` is None or ``{index, key, reason}`` for the first refused chunk
    of the batch, ``reason`` one of ``PUT_REFUSALS``: ``parent_missing`` (its ``parent`` is
    stored nowhere, so no lookup could reach it) or ``no_room`` (no tier could take it: every
    chunk pinned, or room only by evicting its own prefix). When not every chunk was newly
    stored, one ``exists`` call (plus one for the parent) tells the cases apart, as the store
    is just after the put (a chunk evicted by a concurrent put meanwhile reads as refused)."""
    n = len(keys)
    out = {"stored": int(stored), "num_chunks": n, "durable": durable, "already_stored": 0,
           "refused": 0, "first_refused": None}
    if stored >= n:
        return out
    present = await state.call(store.exists, ns, keys)
    held = sum(map(bool, present))
    out["already_stored"], out["refused"] = max(0, held - int(stored)), n - held
    first = next((i for i, p in enumerate(present) if not p), None)
    if first is not None:
        parent = parents[first]
        orphan = parent is not None and not (await state.call(store.exists, ns, [parent]))[0]
        out["first_refused"] = {"index": first, "key": keys[first].hex(),
                                "reason": "parent_missing" if orphan else "no_room"}
    return out


def _ok(obj: dict) -> web.Response:
    return web.json_response(obj, headers={P.VERSION_HEADER: str(P.PROTOCOL_VERSION)})



"""Same-host client of the kvstore daemon: ``ShmKVStoreClient``, a thread-safe synchronous
``KVStoreBase`` over the daemon's Unix socket (``kvstore serve --unix-socket PATH``), with the
daemon's CPU arena mapped read-only (``kvstore.daemon.shm_protocol``).

A get moves no chunk bytes through the socket when the chunks are in the daemon's CPU tier:
the daemon pins them and answers with their page runs in the arena; the client copies the
runs straight into the destination (a new tensor, or the caller's ``out`` buffers), then
releases them (the ``release`` rides on the connection's next request, or goes within a few
milliseconds: ``kvstore.daemon.shm_release``); ``get_borrowed`` instead hands out read-only views of the runs, pinned until
the caller releases them (``kvstore.daemon.shm_borrow``). Chunks of lower tiers come inline in
the reply. A put of CPU tensors is read by the daemon straight from the tensors' memory into
reserved arena pages (``process_vm_readv``; protocol version 3, when ``hello`` showed that the
kernel lets the daemon read this process: ``kvstore.daemon.shm_vm``); otherwise the client
copies the chunks into the connection's staging area (a memfd of the client's that the daemon
maps read-only), pipelined over requests, and the daemon copies them into reserved arena pages
(protocol version 2: unhashed; version 1: checking each xxh3) before committing
(``kvstore.daemon.shm_put``).

Deadlines and errors as ``kvstore.daemon.client.KVStoreClient``: every call ends within its
deadline (``timeout_s``) with a result, ``StoreUnavailable`` (daemon gone, refused, hung;
``kvstore.daemon.shm_errors.SocketGone`` when the socket is absent or refuses, saying whether
the call was sent), ``RemoteError`` (an error reply, with the HTTP status the same failure
gets over HTTP) or
``ValueError`` (bad arguments, checked before sending). Idempotent calls are retried on a
fresh connection when a pooled one turns out dead (a restarted daemon); pin/unpin are
retried once sent only when the daemon cannot have read them (``kvstore.daemon.shm_pool``).
A connection that failed mid-call is closed, which releases its pins.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

import torch

from kvstore.api import KVStoreBase, LookupResult, StoreCapabilities
from kvstore.daemon import batches as B
from kvstore.daemon import protocol as P
from kvstore.daemon.batches import DaemonLimits
from kvstore.daemon.call_checks import check_out, check_put  # noqa: F401 (re-exported)
from kvstore.daemon.shm_borrow import ArenaBorrow, CopiedBorrow, borrow_on, copy_on
from kvstore.daemon.shm_conn import Conn, key_frame, unix_path
from kvstore.daemon.shm_pool import BROKEN, ShmConnPool
from kvstore.daemon.shm_protocol import SHM_VERSION, hashes_frame
from kvstore.daemon.put_result import PutResult
from kvstore.daemon.shm_put import STAGING_BYTES, put_on
from kvstore.daemon.shm_release import client_flusher
from kvstore.daemon.shm_results import ResultBuffers
from kvstore.daemon.transport import check_timeout
from kvstore.errors import RemoteError
from kvstore.keys import ChunkKey, Namespace

__all__ = ["ShmKVStoreClient", "check_out", "unix_path"]

log = logging.getLogger("kvstore.daemon.shm_client")

#: What a client of the daemon offers, over either path (``KVStoreClient`` declares the same).
CAPABILITIES = StoreCapabilities(remote=True, pins=True, get_into_buffers=True,
                                 tiers=("remote",))


class ShmKVStoreClient(ShmConnPool, KVStoreBase):
    """Synchronous, thread-safe ``KVStoreBase`` over the daemon's Unix socket.

    Connections are pooled (one per concurrent call, ``hello`` once each); the arena is
    mapped once per daemon start. Nothing is opened until the first call.

    Args:
        path: the socket path, or ``unix:///PATH``.
        auth_token: the daemon's token (as HTTP's bearer token), if it has one.
        timeout_s: default per-call deadline in seconds (retries included).
        durable: default of ``put_chunks(durable=...)``.
        pool_size: most idle connections kept.
        retry_backoff_s: first retry delay of an idempotent call (doubles, capped at 0.5 s).
        refused_tries: attempts while the socket is absent or refuses before a call raises
            ``StoreUnavailable`` (None: until the deadline).
        refused_backoff_s: wait between refused attempts (seconds).
        staging_bytes: bytes of each connection's put staging area (a sealed memfd the
            daemon copies chunks out of; ``kvstore.daemon.shm_put``); 0: puts send their bytes
            over the socket.
        vm_put: let the daemon read puts straight from the tensors' memory when the kernel
            allows it (one copy instead of two; under Yama ``ptrace_scope`` 1 this process
            then names the daemon its ptracer: ``kvstore.daemon.shm_vm``); False: always
            through the staging area.

    Raises:
        ValueError: a malformed path or ``refused_tries``.
    """

    capabilities = CAPABILITIES

    def __init__(self, path: str, *, auth_token: str | None = None, timeout_s: float = 10.0,
                 durable: bool = False, pool_size: int = 32, retry_backoff_s: float = 0.02,
                 refused_tries: int | None = 2, refused_backoff_s: float = 0.05,
                 staging_bytes: int = STAGING_BYTES, vm_put: bool = True):
        if refused_tries is not None and (type(refused_tries) is not int or refused_tries < 1):
            raise ValueError(f"refused_tries must be a positive int or None, got "
                             f"{refused_tries!r}")
        self.path = unix_path(path)
        self.url = "unix://" + self.path
        self.timeout_s = check_timeout(timeout_s)
        self.durable, self.pool_size = durable, pool_size
        self.retry_backoff_s = retry_backoff_s
        if type(staging_bytes) is not int or staging_bytes < 0:
            raise ValueError(f"staging_bytes must be an int >= 0, got {staging_bytes!r}")
        self.staging_bytes, self.vm_put = staging_bytes, bool(vm_put)
        self.refused_tries, self.refused_backoff_s = refused_tries, refused_backoff_s
        self._token = auth_token or None
        self._lock = threading.Lock()
        self._idle: list[Conn] = []
        self._version = SHM_VERSION  # lower once an older daemon refused it (``_connect``)
        self._arenas: dict = {}  # "current": the Arena of the last daemon start greeted
        #: destinations of gets without ``out``, recycled (``kvstore.daemon.shm_results``)
        self.results = ResultBuffers()
        #: sends gets' releases that no request carried (``kvstore.daemon.shm_release``)
        self._releases = client_flusher(self, self.timeout_s)
        self._closed = False
        #: the daemon's request limits from the latest hello (``kvstore.daemon.batches``)
        self.limits: DaemonLimits | None = None

    def _keys_op(self, op: str, ns: Namespace, keys: Sequence[ChunkKey], *, idempotent: bool,
                 timeout_s: float | None, **extra: Any) -> dict:
        """``op``'s answer for ``keys``, asked in batches within the daemon's
        ``max_batch_keys`` (answers merged: ``kvstore.daemon.batches.merge_answers``)."""
        def one(b: range) -> dict:
            part = keys[b.start:b.stop]
            frame = (key_frame(op, P.key_request(ns, part, **extra)) if extra
                     else _key_request_frame(op, ns, part))
            return self._call(op, lambda c, d: c.request(frame, d), idempotent=idempotent,
                              timeout_s=timeout_s)
        self._learn_limits(len(keys) > 1, timeout_s)
        if self.limits is not None and len(keys) <= self.limits.max_batch_keys or not keys:
            try:
                return one(range(len(keys)))  # (one request: the common case, no merge)
            except RemoteError as e:  # a 413 naming a lower limit (the daemon restarted)
                learned = B.limits_from_413(e, self.limits)
                if learned is None or len(keys) <= learned.max_batch_keys:
                    raise
                self.limits = learned  # (refused whole: nothing was done; split below)
        return B.merge_answers(B.run_batches(self, len(keys), one, stop=(
            B.lookup_done if op == "lookup" else None)), len(keys))

    def _learn_limits(self, needed: bool, timeout_s: float | None) -> None:
        """When ``needed`` (a call of several keys, or a put) and the daemon's limits are not
        known yet: greet it (``hello``) so that the call is split before its first request
        is sent. The connection goes back to the pool, so the call that follows uses it: no
        exchange more than the call's own connect. An older daemon's hello names no limits;
        ``limits`` stays None then (a 413 naming them still splits: ``batches``).

        Raises:
            as ``hello`` (nothing of the call was sent).
        """
        if needed and self.limits is None:
            self.hello(timeout_s=timeout_s)

    def hello(self, *, timeout_s: float | None = None) -> dict:
        """Open (or reuse) a connection: ``{"instance", "tenant", "arena_bytes",
        "page_bytes", "tier_codecs", "wire_codecs"}`` of the daemon's ``hello`` (no codecs from an
        older daemon). Raises as any call."""
        def fn(c: Conn, _d: float) -> dict:
            h = c.hello
            return {"instance": h.instance, "tenant": h.tenant, "arena_bytes": h.arena.nbytes,
                    "page_bytes": h.page_bytes, **h.codecs}
        return self._call("hello", fn, idempotent=True, timeout_s=timeout_s)

    # ---- KVStoreBase ----------------------------------------------------------------------
    def lookup_keys(self, ns, keys, *, timeout_s=None) -> LookupResult:
        r = self._keys_op("lookup", ns, keys, idempotent=True, timeout_s=timeout_s)
        return LookupResult(r["num_hit_chunks"], r["chunk_size"], tuple(r["tiers"]),
                            r["num_requested_chunks"])

    def exists(self, ns, keys, *, timeout_s=None) -> list[bool]:
        return list(self._keys_op("exists", ns, keys, idempotent=True,
                                  timeout_s=timeout_s)["exists"])

    def remove(self, ns, keys, *, timeout_s=None) -> int:
        return self._keys_op("remove", ns, keys, idempotent=True, timeout_s=timeout_s)["removed"]

    def demote(self, ns, keys, *, timeout_s=None) -> int:
        return self._keys_op("demote", ns, keys, idempotent=True, timeout_s=timeout_s)["demoted"]

    def pin(self, ns, keys, lease_s=None, *, timeout_s=None) -> int:
        return self._keys_op("pin", ns, keys, idempotent=False, timeout_s=timeout_s,
                             lease_s=lease_s)["pinned"]

    def unpin(self, ns, keys, *, timeout_s=None) -> int:
        return self._keys_op("unpin", ns, keys, idempotent=False,
                             timeout_s=timeout_s)["unpinned"]

    def clear(self, ns=None, *, timeout_s=None) -> int:
        head = {"op": "clear", "namespace": None if ns is None else ns.to_dict()}
        return self._call("clear", lambda c, d: c.request(head, d), idempotent=True,
                          timeout_s=timeout_s)["removed"]

    def stats(self, *, timeout_s=None) -> dict:
        """As ``GET /v1/stats`` (an admin token's)."""
        r = self._call("stats", lambda c, d: c.request({"op": "stats"}, d), idempotent=True,
                       timeout_s=timeout_s)
        return {k: v for k, v in r.items() if k not in ("ok", "payload_bytes")}

    def whoami(self, *, timeout_s=None) -> dict:
        """``{"tenant", "role", "cache_salt", "instance", "unix_socket", "tier_codecs",
        "wire_codecs"}`` of this client's token and daemon, as ``GET /v1/whoami`` (from
        ``hello``; the codecs None from a daemon whose hello names none)."""
        h = self.hello(timeout_s=timeout_s)
        t = h["tenant"]
        return {"tenant": t.get("name"), "role": t.get("role"), "cache_salt": t.get("salt"),
                "instance": h["instance"], "unix_socket": self.path,
                "tier_codecs": h.get("tier_codecs"), "wire_codecs": h.get("wire_codecs")}

    def healthy(self, *, timeout_s: float = 1.0) -> bool:
        """True when the daemon answers a ``hello`` on a new connection within ``timeout_s``."""
        try:
            Conn(self.path, self._token, time.monotonic() + timeout_s, self._arenas,
                 self._version).close()
            return True
        except (TimeoutError, RemoteError, *BROKEN):
            return False

    def get_chunks(self, ns, keys, out=None, *, timeout_s=None) -> list[torch.Tensor | None]:
        """Chunks ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` or None per key.
        ``out`` (optional): one contiguous CPU tensor per key of ``ns.layout``'s shape and
        dtype; found chunks are read into them and returned as ``out[i]``.

        Raises:
            ValueError: ``len(out) != len(keys)`` or an ``out`` tensor that does not fit.
        """
        if out is not None:
            check_out(ns, keys, out)
        if not keys:
            return []
        take = self.results.take
        self._learn_limits(len(keys) > 1, timeout_s)

        def one(b: range) -> list:
            part, buf = keys[b.start:b.stop], None if out is None else out[b.start:b.stop]
            frame = _key_request_frame("get", ns, part)
            return self._call("get", lambda c, d: copy_on(c, d, frame, ns, part, buf, take),
                              idempotent=True, timeout_s=timeout_s)
        return [t for got in B.run_batches(self, len(keys), one) for t in got]

    def get_borrowed(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                     timeout_s: float | None = None) -> ArenaBorrow | CopiedBorrow:
        """The chunks of ``keys`` as read-only views of the daemon's arena, reader-pinned until
        the result's ``release`` (``kvstore.daemon.shm_borrow``: no copy for chunks in the
        daemon's CPU tier; those of its lower tiers come inline into recycled tensors).
        ``parts[i]``: the chunk's bytes as 1-D uint8 tensors, or None when absent. Call
        ``release`` (or use it as a context manager) on every path; the borrow holds one
        connection of the pool until then. More keys than the daemon's ``max_batch_keys``
        (learned before the first request; or named by its 413, after a restart with a lower
        limit): the chunks ``get_chunks`` copied out in batches (a ``CopiedBorrow``).

        Raises:
            as ``get_chunks`` (nothing stays pinned then).
        """
        frame = _key_request_frame("get", ns, keys) if keys else None
        if frame is None:
            return ArenaBorrow([], [], None, None, self._give)
        self._learn_limits(len(keys) > 1, timeout_s)
        if self.limits is not None and len(keys) > self.limits.max_batch_keys:
            return CopiedBorrow(keys, self.get_chunks(ns, keys, timeout_s=timeout_s))
        take = self.results.take
        try:
            return self._call("get", lambda c, d: borrow_on(c, d, frame, ns, keys, take,
                                                            self._give),
                              idempotent=True, timeout_s=timeout_s, hold=True)
        except RemoteError as e:  # a 413 naming a lower key limit (the daemon restarted)
            learned = B.limits_from_413(e, self.limits)
            if learned is None or len(keys) <= learned.max_batch_keys:
                raise
            self.limits = learned
            return CopiedBorrow(keys, self.get_chunks(ns, keys, timeout_s=timeout_s))

    def put_chunks(self, ns, keys, kvs, parents=None, *, durable=None, timeout_s=None) -> int:
        """Store chunks, through the connection's staging area or from the tensors' memory
        over the socket (``kvstore.daemon.shm_put``). ``parents`` as
        ``KVStoreBase.put_chunks``; ``durable`` waits for the disk tier's commit. Returns the
        number newly stored, a ``PutResult`` (``kvstore.daemon.put_result``) that also says
        ``already_stored``, ``refused`` and ``first_refused`` (indexed from ``keys[0]``).

        Raises:
            ValueError: ``len(keys) != len(kvs)``, a bad ``parents`` count, or a tensor not
                matching ``ns.layout`` (nothing is sent then).
        """
        check_put(ns, keys, kvs, parents)
        if not keys:
            return 0
        durable = self.durable if durable is None else bool(durable)
        self._learn_limits(True, timeout_s)  # (a put past the limits closes the socket)

        def one(b: range) -> PutResult:
            par = B.batch_parents(keys, parents, b) if b.start or parents is not None else None
            return self._call("put", lambda c, d: put_on(
                c, d, ns, keys[b.start:b.stop], kvs[b.start:b.stop], par, durable,
                self.staging_bytes), idempotent=True, timeout_s=timeout_s).shifted(b.start)
        return PutResult.combine(B.run_batches(self, len(keys), one,
                                               sizes=[P.tensor_bytes(kv).nbytes for kv in kvs]))

    def close(self) -> None:
        """Close every connection (the daemon drops their pins). Idempotent."""
        self._releases.close()
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for c in idle:
            c.close()


def _key_request_frame(op: str, ns: Namespace, keys: Sequence[ChunkKey]) -> bytes:
    """A key request's frame: the compact ``hashes`` form, or the per-key form when a key is
    not of ``ns`` (the daemon then refuses it with 400, as it does over HTTP: both paths of
    ``KVStoreClient`` answer a foreign key alike)."""
    try:
        return hashes_frame(op, ns, keys)
    except ValueError:
        return key_frame(op, P.key_request(ns, keys))

"""Client of the kvstore daemon: ``AsyncKVStoreClient`` (aiohttp) and ``KVStoreClient``, a
thread-safe synchronous ``KVStoreBase`` with the same surface as the in-process store.

Deadlines: every call has a deadline (``timeout_s``, per client or per call). A dead, hung or
restarting server yields ``StoreUnavailable`` (a ``TimeoutError``) within that deadline, never a
hang. Retries (exponential backoff, inside the deadline) happen for idempotent calls (lookup,
exists, get, put of content-addressed chunks, remove, clear, stats) on connection errors and
503; pin/unpin are retried only when the connection could not be opened (nothing was sent).
A refused connection (nothing listens on the port: the daemon is down) fails fast: after
``refused_tries`` attempts ``refused_backoff_s`` apart, not at the deadline. Deadlines and
retries are ``kvstore.daemon.transport``'s; this module is the typed calls.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from typing import Any, AsyncIterator, Sequence

import aiohttp
import torch

from kvstore.api import KVStoreBase, LookupResult
from kvstore.daemon import protocol as P
from kvstore.daemon.shm_client import CAPABILITIES as SHM_CAPABILITIES
from kvstore.daemon.shm_client import ShmKVStoreClient, check_out
from kvstore.daemon.shm_discovery import discover_socket
from kvstore.daemon.transport import Transport, check_url
from kvstore.errors import RemoteError, StoreUnavailable
from kvstore.keys import ChunkKey, Namespace

__all__ = ["AsyncKVStoreClient", "KVStoreClient", "RemoteError", "StoreUnavailable", "check_url"]

log = logging.getLogger("kvstore.daemon.client")


#: Put payloads go to the transport in slices of this many bytes: a slice the socket takes at
#: once is sent from the tensor's memory; asyncio copies only what it does not take.
SEND_SLICE = 1 << 20


class AsyncKVStoreClient:
    """Async client. Coroutines mirror ``KVStoreBase`` methods (``await c.get_chunks(ns, keys)``).

    Args:
        url: server base URL, e.g. ``"http://127.0.0.1:8500"``.
        auth_token: bearer token, if the server requires one.
        timeout_s: default per-call deadline in seconds (retries included).
        pool_size: most pooled connections (aiohttp connector limit).
        durable: default for ``put_chunks(durable=...)`` (wait for the disk flush).
        retry_backoff_s: first retry delay (doubles, capped at 0.5 s).
        refused_tries: attempts of a call whose connections are refused before it raises
            ``StoreUnavailable`` (default 2, so about ``refused_backoff_s`` instead of the whole
            deadline); None retries until the deadline (to ride out a daemon restart).
        refused_backoff_s: wait between refused attempts (seconds).

    Raises:
        ValueError: ``url`` is not ``http[s]://HOST:PORT`` (``check_url``).
    """

    def __init__(self, url: str, *, auth_token: str | None = None, timeout_s: float = 10.0,
                 pool_size: int = 32, durable: bool = False, retry_backoff_s: float = 0.02,
                 refused_tries: int | None = 2, refused_backoff_s: float = 0.05):
        self._http = Transport(url, auth_token=auth_token, timeout_s=timeout_s,
                               pool_size=pool_size, retry_backoff_s=retry_backoff_s,
                               refused_tries=refused_tries, refused_backoff_s=refused_backoff_s)
        self.durable = durable

    @property
    def url(self) -> str:
        """The server base URL (no trailing slash)."""
        return self._http.url

    @property
    def timeout_s(self) -> float:
        """Default per-call deadline (seconds)."""
        return self._http.timeout_s

    async def close(self) -> None:
        """Close pooled connections. Idempotent."""
        await self._http.close()

    async def lookup_keys(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                          timeout_s: float | None = None) -> LookupResult:
        """Leading keys present, per tier (see ``KVStoreBase.lookup_keys``)."""
        r = await self._http.post_json("/v1/lookup", P.key_request(ns, keys), idempotent=True,
                                       timeout_s=timeout_s)
        return LookupResult(r["num_hit_chunks"], r["chunk_size"], tuple(r["tiers"]),
                            r["num_requested_chunks"])

    async def exists(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                     timeout_s: float | None = None) -> list[bool]:
        r = await self._http.post_json("/v1/exists", P.key_request(ns, keys), idempotent=True,
                                       timeout_s=timeout_s)
        return list(r["exists"])

    async def remove(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                     timeout_s: float | None = None) -> int:
        r = await self._http.post_json("/v1/remove", P.key_request(ns, keys), idempotent=True,
                                       timeout_s=timeout_s)
        return r["removed"]

    async def demote(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                     timeout_s: float | None = None) -> int:
        """Make stored chunks first eviction candidates (``KVStoreBase.demote``); returns
        how many the daemon holds."""
        r = await self._http.post_json("/v1/demote", P.key_request(ns, keys), idempotent=True,
                                       timeout_s=timeout_s)
        return r["demoted"]

    async def clear(self, ns: Namespace | None = None, *, timeout_s: float | None = None) -> int:
        """Delete every chunk of ``ns`` (all namespaces if None)."""
        body = {"all": True} if ns is None else {"namespace": ns.to_dict()}
        r = await self._http.post_json("/v1/clear", json.dumps(body).encode(), idempotent=True,
                                       timeout_s=timeout_s)
        return r["removed"]

    async def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None,
                  *, timeout_s: float | None = None) -> int:
        """Pin with a lease (the server caps it at its ``max_lease_s``)."""
        r = await self._http.post_json("/v1/pin", P.key_request(ns, keys, lease_s=lease_s),
                                       idempotent=False, timeout_s=timeout_s)
        return r["pinned"]

    async def unpin(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                    timeout_s: float | None = None) -> int:
        r = await self._http.post_json("/v1/unpin", P.key_request(ns, keys), idempotent=False,
                                       timeout_s=timeout_s)
        return r["unpinned"]

    async def stats(self, *, timeout_s: float | None = None) -> dict:
        async def handle(resp):
            return await resp.json()
        return await self._http.call("GET", "/v1/stats", handle, idempotent=True,
                                     timeout_s=timeout_s)

    async def whoami(self, *, timeout_s: float | None = None) -> dict:
        """``{"tenant", "role", "cache_salt"}`` of this client's token (``kvstore.daemon.tenants``):
        namespaces must carry ``cache_salt`` (or ``cache_salt + "/..."``) unless it is None."""
        async def handle(resp):
            return await resp.json()
        return await self._http.call("GET", "/v1/whoami", handle, idempotent=True,
                                     timeout_s=timeout_s)

    async def metrics_text(self, *, timeout_s: float | None = None) -> str:
        """The server's Prometheus exposition text."""
        async def handle(resp):
            return await resp.text()
        return await self._http.call("GET", "/metrics", handle, idempotent=True,
                                     timeout_s=timeout_s)

    async def get_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                         out: Sequence[torch.Tensor] | None = None, *,
                         timeout_s: float | None = None) -> list[torch.Tensor | None]:
        """Chunks ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` or None per key.
        A payload failing its checksum is returned as None (and logged). ``out`` (optional):
        one contiguous CPU tensor per key of the layout, read into and returned as ``out[i]``.

        Raises:
            ValueError: a bad ``out`` (count, shape, dtype, device, not contiguous).
        """
        if out is not None:
            check_out(ns, keys, out)
        if not keys:
            return []

        async def handle(resp):
            if resp.status == 404:
                return [None] * len(keys)
            return await _read_get_body(resp.content, ns, keys, out)
        return await self._http.call("POST", "/v1/get", handle, idempotent=True,
                                     timeout_s=timeout_s, body=P.key_request(ns, keys),
                                     headers={"Content-Type": "application/json"})

    async def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                         kvs: Sequence[torch.Tensor],
                         parents: Sequence[ChunkKey | None] | None = None, *,
                         durable: bool | None = None, timeout_s: float | None = None) -> int:
        """Store chunks (streamed, no copy of the tensors). With ``durable`` the server answers
        only after the disk tier has flushed them. ``parents`` as ``KVStoreBase.put_chunks``
        (sent as each entry's ``"parent"`` where it is not the previous key; the first
        entry's always). Returns the number newly stored.

        Raises:
            ValueError: ``len(keys) != len(kvs)``, a bad ``parents`` count, or a tensor not
                matching ``ns.layout`` (checked here before sending; the server checks again).
        """
        if len(keys) != len(kvs):
            raise ValueError(f"{len(keys)} keys but {len(kvs)} tensors")
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
        if not keys:
            return 0
        for kv in kvs:
            ns.layout.validate(kv)
        entries = [P.entry_for(k, kv) for k, kv in zip(keys, kvs)]
        if parents is not None:
            entries = [(dataclasses.replace(e, parent=p, parent_given=True)
                        if i == 0 or p != keys[i - 1] else e, v)
                       for i, ((e, v), p) in enumerate(zip(entries, parents))]
        parts = entries
        head = P.put_header(ns, [e for e, _ in parts],
                            self.durable if durable is None else durable)
        length = len(head) + sum(v.nbytes for _, v in parts)

        async def stream() -> AsyncIterator[bytes | memoryview]:
            yield head
            for _, v in parts:
                for off in range(0, v.nbytes, SEND_SLICE):
                    yield v[off:off + SEND_SLICE]

        async def handle(resp):
            return (await resp.json())["stored"]
        return await self._http.call("POST", "/v1/put", handle, idempotent=True,
                                     timeout_s=timeout_s,
                                     body=stream,
                                     headers={"Content-Type": P.BINARY_CONTENT_TYPE,
                                              "Content-Length": str(length)})

    async def healthy(self, *, timeout_s: float = 1.0) -> bool:
        """True when /readyz answers 200 within ``timeout_s``."""
        async def handle(resp):
            return resp.status == 200
        try:
            return await self._http.call("GET", "/readyz", handle, idempotent=True,
                                         timeout_s=timeout_s)
        except (StoreUnavailable, RemoteError):
            return False


async def _read_get_body(reader: aiohttp.StreamReader, ns: Namespace,
                         keys: Sequence[ChunkKey], bufs: Sequence[torch.Tensor] | None = None
                         ) -> list[torch.Tensor | None]:
    hdr_len = P.decode_preamble(await reader.readexactly(P.PREAMBLE_BYTES))
    header = P.parse_json(await reader.readexactly(hdr_len), "get response header")
    entries = P.parse_get_response_header(header, ns, keys)
    layout = ns.layout
    out: list[torch.Tensor | None] = []
    for i, e in enumerate(entries):
        if not e.found:
            out.append(None)
            continue
        kv = bufs[i] if bufs is not None else \
            torch.empty(layout.shape(), dtype=layout.torch_dtype)  # [L, 2, T, H, D]
        view = memoryview(kv.view(torch.uint8).reshape(-1).numpy())
        pos = 0
        while pos < e.nbytes:
            data = await reader.read(e.nbytes - pos)
            if not data:
                raise asyncio.IncompleteReadError(b"", e.nbytes - pos)
            view[pos:pos + len(data)] = data
            pos += len(data)
        if P.checksum(view) != e.xxh3:
            log.warning("checksum mismatch on get of %s; treated as a miss", e.key)
            out.append(None)
        else:
            out.append(kv)
    return out


class KVStoreClient(KVStoreBase):
    """Synchronous, thread-safe ``KVStoreBase`` over the daemon (same surface as ``ChunkStore``).

    Two paths behind one surface:

    * ``unix:///PATH``: the daemon's Unix socket, its CPU arena mapped read-only
      (``kvstore.daemon.shm_client.ShmKVStoreClient``; gets copy straight out of the arena).
    * ``http://HOST:PORT``: HTTP on one private event loop thread. With ``same_host=True``
      (the default) the first call asks the daemon (``/v1/stats``, else ``/v1/whoami``) for
      its ``unix_socket``; when that socket exists on this host and its ``hello`` answers the
      same ``instance``, every later call goes over it. HTTP stays otherwise (no socket,
      another host, a refused hello); ``same_host=False`` forces HTTP.

    Every method blocks at most its deadline (``timeout_s``) and raises ``StoreUnavailable``
    when the daemon does not answer in time, ``RemoteError`` for error answers, ``ValueError``
    for bad tensors. Other arguments as in ``AsyncKVStoreClient`` (both paths take them).
    ``/metrics`` (``metrics_text``) is served over HTTP only.
    """

    def __init__(self, url: str, *, same_host: bool = True, **kwargs: Any):
        self._shm: ShmKVStoreClient | None = None
        self._async: AsyncKVStoreClient | None = None
        self._closed = False
        self._discovering = False
        if isinstance(url, str) and url.startswith("unix://"):
            self._shm = ShmKVStoreClient(url, **kwargs)
            self.url = self._shm.url
            return
        self._async = AsyncKVStoreClient(url, **kwargs)
        self.url = self._async.url
        self._shm_kwargs = kwargs
        self._discovering = same_host
        self._discover_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client",
                                        daemon=True)
        self._thread.start()

    #: Every call crosses to the daemon (blocks up to its deadline); the daemon pins; its
    #: tiers are one ``"remote"`` tier here; ``get_chunks`` takes ``out=`` on both paths.
    capabilities = SHM_CAPABILITIES

    @property
    def transport(self) -> str:
        """``"unix"`` or ``"http"``: the path calls take now (``"http"`` until a first call
        has discovered the daemon's socket)."""
        return "unix" if self._shm is not None else "http"

    def _path(self, timeout_s: float | None) -> ShmKVStoreClient | None:
        """The Unix-socket client calls go to, or None for HTTP (discovering it first).

        Raises:
            StoreUnavailable: the daemon did not answer the discovery (nothing decided: the
                next call asks again).
        """
        if self._discovering:
            with self._discover_lock:
                if self._discovering:
                    self._shm = discover_socket(
                        lambda route: self._run(getattr(self._async, route)(
                            timeout_s=timeout_s), timeout_s), self._shm_kwargs, timeout_s)
                    self._discovering = False
        return self._shm

    def _call(self, name: str, timeout_s: float | None, *args: Any, **kw: Any) -> Any:
        shm = self._path(timeout_s)
        if shm is not None:
            return getattr(shm, name)(*args, timeout_s=timeout_s, **kw)
        return self._run(getattr(self._async, name)(*args, timeout_s=timeout_s, **kw),
                         timeout_s)

    def _run(self, coro, timeout_s: float | None) -> Any:
        if self._closed or self._async is None:
            coro.close()
            raise RuntimeError("KVStoreClient is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        wait = (self._async.timeout_s if timeout_s is None else timeout_s) + 5.0
        try:
            return fut.result(wait)
        except TimeoutError:
            if fut.done():  # the call's own StoreUnavailable (a TimeoutError)
                raise
            fut.cancel()
            raise StoreUnavailable(f"{self.url}: no answer within {wait} s") from None

    def lookup_keys(self, ns, keys, *, timeout_s=None) -> LookupResult:
        return self._call("lookup_keys", timeout_s, ns, keys)

    def get_chunks(self, ns, keys, out=None, *, timeout_s=None) -> list[torch.Tensor | None]:
        """As ``AsyncKVStoreClient.get_chunks`` (``out``: buffers to read into)."""
        return self._call("get_chunks", timeout_s, ns, keys, out)

    def put_chunks(self, ns, keys, kvs, parents=None, *, durable=None, timeout_s=None) -> int:
        return self._call("put_chunks", timeout_s, ns, keys, kvs, parents, durable=durable)

    def exists(self, ns, keys, *, timeout_s=None) -> list[bool]:
        return self._call("exists", timeout_s, ns, keys)

    def remove(self, ns, keys, *, timeout_s=None) -> int:
        return self._call("remove", timeout_s, ns, keys)

    def demote(self, ns, keys, *, timeout_s=None) -> int:
        return self._call("demote", timeout_s, ns, keys)

    def clear(self, ns=None, *, timeout_s=None) -> int:
        return self._call("clear", timeout_s, ns)

    def pin(self, ns, keys, lease_s=None, *, timeout_s=None) -> int:
        return self._call("pin", timeout_s, ns, keys, lease_s)

    def unpin(self, ns, keys, *, timeout_s=None) -> int:
        return self._call("unpin", timeout_s, ns, keys)

    def stats(self, *, timeout_s=None) -> dict:
        return self._call("stats", timeout_s)

    def whoami(self, *, timeout_s=None) -> dict:
        return self._call("whoami", timeout_s)

    def metrics_text(self, *, timeout_s=None) -> str:
        """The daemon's Prometheus text (HTTP only).

        Raises:
            RemoteError(404): a ``unix://`` client (``/metrics`` is an HTTP route).
        """
        if self._async is None:
            raise RemoteError(404, "/metrics is served over HTTP only; ask the daemon's "
                                   "http:// URL")
        return self._run(self._async.metrics_text(timeout_s=timeout_s), timeout_s)

    def healthy(self, *, timeout_s: float = 1.0) -> bool:
        if self._async is None:
            return self._shm.healthy(timeout_s=timeout_s)
        return self._run(self._async.healthy(timeout_s=timeout_s), timeout_s)

    def close(self) -> None:
        """Close connections (the daemon drops a Unix connection's pins) and stop the loop
        thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._shm is not None:
            self._shm.close()
        if self._async is not None:
            asyncio.run_coroutine_threadsafe(self._async.close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()

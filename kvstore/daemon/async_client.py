"""The daemon's async HTTP client, ``AsyncKVStoreClient`` (aiohttp): the typed calls over
``kvstore.daemon.transport`` (deadlines, retries). ``kvstore.daemon.client.KVStoreClient`` is
the synchronous ``KVStoreBase`` over it (and over the same-host path); the deadline and retry
rules are described there.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import AsyncIterator, Sequence

import aiohttp
import torch

from kvstore.api import LookupResult
from kvstore.daemon import batches as B
from kvstore.daemon import protocol as P
from kvstore.daemon import wire_codec as W
from kvstore.daemon.put_result import PutResult
from kvstore.daemon.shm_client import check_out, check_put
from kvstore.daemon.transport import Transport
from kvstore.errors import RemoteError, StoreUnavailable
from kvstore.keys import ChunkKey, Namespace

log = logging.getLogger("kvstore.daemon.client")


#: Put payloads go to the transport in slices of this many bytes: a slice the socket takes at
#: once is sent from the tensor's memory; asyncio copies only what it does not take.
SEND_SLICE = 1 << 20
#: Most seconds a first put of several chunks waits to learn the daemon's limits
LIMITS_ASK_S = 2.0


class AsyncKVStoreClient:
    """Async client. Coroutines mirror ``KVStoreBase`` methods (``await c.get_chunks(ns, keys)``).
    Calls with more keys (or put bytes) than the daemon takes in one request are sent as
    several, in order (``kvstore.daemon.batches``; the daemon's answers carry its limits).

    Args:
        url: server base URL, e.g. ``"http://127.0.0.1:8500"``.
        auth_token: bearer token, if the server requires one.
        timeout_s: default per-call deadline in seconds (retries included).
        pool_size: most pooled connections (aiohttp connector limit).
        durable: default for ``put_chunks(durable=...)`` (wait for the disk flush).
        retry_backoff_s: first retry delay (doubles, capped at 0.5 s).
        refused_tries: attempts of a call whose connections are refused, or whose host name
            does not resolve, before it raises ``StoreUnavailable`` (default 2, so about
            ``refused_backoff_s`` instead of the whole deadline); None retries until the
            deadline (to ride out a daemon restart).
        refused_backoff_s: wait between such attempts (seconds).
        wire_codec: ``"raw"`` (default: bit-exact payloads) or a lossy codec (``"kivi"``,
            ``"int8"``, ``"fp8"``) to send puts and ask gets encoded with, for namespaces
            whose ``lossy_codec`` names it (others travel raw; ``kvstore.daemon.wire_codec``).
            Gets then return the decoded values; the daemon stores a put's decoded values.

    Raises:
        ValueError: ``url`` is not ``http[s]://HOST:PORT`` (``check_url``), or an unknown
            ``wire_codec``.
    """

    def __init__(self, url: str, *, auth_token: str | None = None, timeout_s: float = 10.0,
                 pool_size: int = 32, durable: bool = False, retry_backoff_s: float = 0.02,
                 refused_tries: int | None = 2, refused_backoff_s: float = 0.05,
                 wire_codec: str = "raw"):
        if wire_codec not in W.WIRE_CODECS:
            raise ValueError(f"unknown wire_codec {wire_codec!r}; choose one of "
                             f"{list(W.WIRE_CODECS)}")
        self.wire_codec = wire_codec
        self._http = Transport(url, auth_token=auth_token, timeout_s=timeout_s,
                               pool_size=pool_size, retry_backoff_s=retry_backoff_s,
                               refused_tries=refused_tries, refused_backoff_s=refused_backoff_s)
        self.durable = durable
        self._asked_limits = False  # whether a put asked the daemon's limits (_ask_limits)

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
        async def one(b: range) -> LookupResult:
            r = await self._http.post_json("/v1/lookup", P.key_request(ns, keys[b.start:b.stop]),
                                           idempotent=True, timeout_s=timeout_s)
            return LookupResult(r["num_hit_chunks"], r["chunk_size"], tuple(r["tiers"]),
                                r["num_requested_chunks"])
        if not keys:
            return await one(range(0))
        return B.merge_lookups(await B.run_batches_async(self._http, len(keys), one,
                                                         stop=B.lookup_done,
                                                         **_key_sizes(ns, keys)),
                               len(keys), LookupResult)

    async def exists(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                     timeout_s: float | None = None) -> list[bool]:
        r = await self._keys_call("/v1/exists", ns, keys, True, timeout_s)
        return [x for a in r for x in a["exists"]]

    async def remove(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                     timeout_s: float | None = None) -> int:
        r = await self._keys_call("/v1/remove", ns, keys, True, timeout_s)
        return sum(a["removed"] for a in r)

    async def demote(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                     timeout_s: float | None = None) -> int:
        """Make stored chunks first eviction candidates (``KVStoreBase.demote``); returns
        how many the daemon holds."""
        r = await self._keys_call("/v1/demote", ns, keys, True, timeout_s)
        return sum(a["demoted"] for a in r)

    async def clear(self, ns: Namespace | None = None, *, timeout_s: float | None = None) -> int:
        """Delete every chunk of ``ns`` (all namespaces if None)."""
        body = {"all": True} if ns is None else {"namespace": ns.to_dict()}
        r = await self._http.post_json("/v1/clear", json.dumps(body).encode(), idempotent=True,
                                       timeout_s=timeout_s)
        return r["removed"]

    async def pin(self, ns: Namespace, keys: Sequence[ChunkKey], lease_s: float | None = None,
                  *, timeout_s: float | None = None) -> int:
        """Pin with a lease (the server caps it at its ``max_lease_s``)."""
        r = await self._keys_call("/v1/pin", ns, keys, False, timeout_s, lease_s=lease_s)
        return sum(a["pinned"] for a in r)

    async def unpin(self, ns: Namespace, keys: Sequence[ChunkKey], *,
                    timeout_s: float | None = None) -> int:
        r = await self._keys_call("/v1/unpin", ns, keys, False, timeout_s)
        return sum(a["unpinned"] for a in r)

    async def _keys_call(self, path: str, ns: Namespace, keys: Sequence[ChunkKey],
                         idempotent: bool, timeout_s: float | None, **extra) -> list[dict]:
        """The JSON answers of ``path`` for ``keys`` in batches within the daemon's
        ``max_batch_keys`` (``kvstore.daemon.batches``; one request when it fits)."""
        async def one(b: range) -> dict:
            return await self._http.post_json(path, P.key_request(ns, keys[b.start:b.stop],
                                                                  **extra),
                                              idempotent=idempotent, timeout_s=timeout_s)
        if not keys:
            return [await one(range(0))]
        return await B.run_batches_async(self._http, len(keys), one, **_key_sizes(ns, keys))

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
        With a ``wire_codec`` the namespace accepts, chunks arrive encoded and are decoded.

        Raises:
            ValueError: a bad ``out`` (count, shape, dtype, device, not contiguous).
        """
        if out is not None:
            check_out(ns, keys, out)
        if not keys:
            return []

        codec = W.codec_for(ns, self.wire_codec)
        headers = {"Content-Type": "application/json"}
        if codec != "raw":
            headers[W.WIRE_CODEC_HEADER] = codec

        async def one(b: range) -> list[torch.Tensor | None]:
            part = keys[b.start:b.stop]

            async def handle(resp):
                if resp.status == 404:
                    return [None] * len(part)
                return await _read_get_body(resp.content, ns, part,
                                            None if out is None else out[b.start:b.stop], codec)
            return await self._http.call("POST", "/v1/get", handle, idempotent=True,
                                         timeout_s=timeout_s, body=P.key_request(ns, part),
                                         headers=headers)
        got = await B.run_batches_async(self._http, len(keys), one, **_key_sizes(ns, keys))
        return [t for part in got for t in part]

    async def put_chunks(self, ns: Namespace, keys: Sequence[ChunkKey],
                         kvs: Sequence[torch.Tensor],
                         parents: Sequence[ChunkKey | None] | None = None, *,
                         durable: bool | None = None, timeout_s: float | None = None
                         ) -> PutResult:
        """Store chunks (streamed, no copy of the tensors; with a ``wire_codec`` the namespace
        accepts, encoded first, off the event loop). With ``durable`` the server answers
        only after the disk tier has flushed them. ``parents`` as ``KVStoreBase.put_chunks``
        (sent as each entry's ``"parent"`` where it is not the previous key; the first
        entry's always). Returns the number newly stored, a ``PutResult``
        (``kvstore.daemon.put_result``) that also says ``already_stored``, ``refused`` and
        ``first_refused`` (indexed from ``keys[0]``). A put past the daemon's
        ``max_body_bytes``/``max_batch_keys`` goes as several requests in chunk order
        (``kvstore.daemon.batches``); a failed one leaves the earlier ones' chunks stored.

        Raises:
            ValueError: ``len(keys) != len(kvs)``, a bad ``parents`` count, or a tensor not
                matching ``ns.layout`` (checked here before sending; the server checks again).
            ChunkTooLarge: (a ``RemoteError`` 413) one chunk needs a request larger than the
                daemon's ``max_body_bytes`` (the message names both sizes); nothing sent.
        """
        check_put(ns, keys, kvs, parents)
        if not keys:
            return PutResult(0)
        codec = W.codec_for(ns, self.wire_codec)
        headers = {"Content-Type": P.BINARY_CONTENT_TYPE}
        if codec == "raw":
            entries = [P.entry_for(k, kv) for k, kv in zip(keys, kvs)]
        else:
            headers[W.WIRE_CODEC_HEADER] = codec
            entries = await asyncio.to_thread(_encoded_entries, keys, kvs, codec)
        if parents is not None:
            entries = [(dataclasses.replace(e, parent=p, parent_given=True)
                        if i == 0 or p != keys[i - 1] else e, v)
                       for i, ((e, v), p) in enumerate(zip(entries, parents))]
        durable = self.durable if durable is None else durable
        if len(keys) > 1 and self._http.limits is None and not self._asked_limits:
            await self._ask_limits(timeout_s)
        sizes = [v.nbytes + len(json.dumps(e.to_dict())) + 2 for e, v in entries]
        fixed = len(P.put_header(ns, [], durable)) + 128  # (+ a batch's first "parent")

        async def one(b: range) -> PutResult:
            part = entries[b.start:b.stop]
            if b.start > 0 and not part[0][0].parent_given:  # the batch names its first parent
                first = B.batch_parents(keys, parents, range(b.start, b.start + 1))[0]
                part[0] = (dataclasses.replace(part[0][0], parent=first, parent_given=True),
                           part[0][1])
            return (await self._put_batch(ns, part, durable, headers, timeout_s)
                    ).shifted(b.start)
        return PutResult.combine(await B.run_batches_async(self._http, len(keys), one,
                                                           sizes=sizes, fixed=fixed))

    async def _ask_limits(self, timeout_s: float | None) -> None:
        """Learn the daemon's limits before a first put of several chunks (``GET /healthz``
        answers them in its headers; a 413 to a large streamed body may reach the client as a
        reset connection). Asked once; an older daemon (no limits) or no answer within
        ``LIMITS_ASK_S`` leaves them unknown (the put then goes whole; a 413 naming them
        splits it)."""
        self._asked_limits = True

        async def handle(resp):
            return None
        try:
            await self._http.call("GET", "/healthz", handle, idempotent=True,
                                  timeout_s=min(LIMITS_ASK_S, timeout_s or self.timeout_s))
        except (StoreUnavailable, RemoteError):
            pass  # any later answer teaches them too (Transport.limits)

    async def _put_batch(self, ns: Namespace, parts: list, durable: bool, headers: dict,
                         timeout_s: float | None) -> PutResult:
        """One ``/v1/put`` of ``parts`` (entries and their payloads): its answer."""
        head = P.put_header(ns, [e for e, _ in parts], durable)
        length = len(head) + sum(v.nbytes for _, v in parts)

        async def stream() -> AsyncIterator[bytes | memoryview]:
            yield head
            for _, v in parts:
                for off in range(0, v.nbytes, SEND_SLICE):
                    yield v[off:off + SEND_SLICE]

        async def handle(resp):
            return PutResult.from_answer(await resp.json())
        return await self._http.call("POST", "/v1/put", handle, idempotent=True,
                                     timeout_s=timeout_s,
                                     body=stream,
                                     headers={**headers, "Content-Length": str(length)})

    async def healthy(self, *, timeout_s: float = 1.0) -> bool:
        """True when /readyz answers 200 within ``timeout_s``."""
        async def handle(resp):
            return resp.status == 200
        try:
            return await self._http.call("GET", "/readyz", handle, idempotent=True,
                                         timeout_s=timeout_s)
        except (StoreUnavailable, RemoteError):
            return False


def _key_sizes(ns: Namespace, keys: Sequence[ChunkKey]) -> dict:
    """``sizes`` and ``fixed`` of a JSON key request's batches (``batches.plan``): each key's
    bytes in the body (at most: the widest key's), and the body without keys (+ slack)."""
    fixed = len(P.key_request(ns, [], lease_s=0.0))
    per = max(len(P.key_request(ns, [k])) for k in keys[:1]) - len(P.key_request(ns, [])) + 8
    return {"sizes": [per] * len(keys), "fixed": fixed + 64}


def _encoded_entries(keys: Sequence[ChunkKey], kvs: Sequence[torch.Tensor], codec: str
                     ) -> list[tuple[P.ChunkEntry, memoryview]]:
    """Header entries and wire payloads of a put's chunks under ``codec``
    (``wire_codec.encode_chunk``: raw for a chunk it cannot encode)."""
    out = []
    for k, kv in zip(keys, kvs):
        used, view = W.encode_chunk(kv, codec)
        out.append((P.ChunkEntry(k, view.nbytes, P.dtype_name(kv.dtype), tuple(kv.shape),
                                 P.checksum(view), codec=used), view))
    return out


async def _read_into(reader: aiohttp.StreamReader, view: memoryview) -> None:
    pos = 0
    while pos < view.nbytes:
        data = await reader.read(view.nbytes - pos)
        if not data:
            raise asyncio.IncompleteReadError(b"", view.nbytes - pos)
        view[pos:pos + len(data)] = data
        pos += len(data)


async def _read_get_body(reader: aiohttp.StreamReader, ns: Namespace,
                         keys: Sequence[ChunkKey], bufs: Sequence[torch.Tensor] | None = None,
                         codec: str = "raw") -> list[torch.Tensor | None]:
    """The chunks of a get answer (None: not found, or a payload failing its checksum);
    payloads of a lossy ``codec`` are decoded (into ``bufs[i]`` when given)."""
    hdr_len = P.decode_preamble(await reader.readexactly(P.PREAMBLE_BYTES))
    header = P.parse_json(await reader.readexactly(hdr_len), "get response header")
    entries = P.parse_get_response_header(header, ns, keys, codec)
    layout = ns.layout
    out: list[torch.Tensor | None] = []
    for i, e in enumerate(entries):
        if not e.found:
            out.append(None)
            continue
        if e.codec != "raw":
            payload = bytearray(e.nbytes)
            await _read_into(reader, memoryview(payload))
            if P.checksum(payload) != e.xxh3:
                log.warning("checksum mismatch on get of %s; treated as a miss", e.key)
                out.append(None)
                continue
            try:
                out.append(await asyncio.to_thread(W.decode_chunk, payload, e.codec, layout,
                                                   bufs[i] if bufs is not None else None))
            except P.ProtocolError as err:
                log.warning("get of %s: %s; treated as a miss", e.key, err)
                out.append(None)
            continue
        kv = bufs[i] if bufs is not None else \
            torch.empty(layout.shape(), dtype=layout.torch_dtype)  # [L, 2, T, H, D]
        view = memoryview(kv.view(torch.uint8).reshape(-1).numpy())
        await _read_into(reader, view)
        if P.checksum(view) != e.xxh3:
            log.warning("checksum mismatch on get of %s; treated as a miss", e.key)
            out.append(None)
        else:
            out.append(kv)
    return out

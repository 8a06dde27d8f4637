"""The binary payload routes with a wire codec: ``POST /v1/get`` and ``POST /v1/put`` whose
request names a lossy codec in ``X-KVStore-Wire-Codec`` (``kvstore.daemon.wire_codec``: the
format and the rule). Requests without it (or naming ``raw``) go to
``kvstore.daemon.payload`` unchanged.

Encoded gets read the chunks from the store (copies), encode them on the store pool and send
the payloads; encoded puts read every payload into a buffer, check its checksum, decode it on
the store pool into the namespace's dtype and store the decoded chunks (``put_chunks``; with
``durable``, ``persist`` as a raw durable put). Both hold the in-flight byte budget for the
decoded chunks plus their payloads.
"""
from __future__ import annotations

import xxhash
from aiohttp import web

from kvstore.daemon import payload as raw_routes
from kvstore.daemon import protocol as P
from kvstore.daemon import wire_codec as W
from kvstore.daemon.state import STATE_KEY, STORE_KEY, _ns_keys, _ok, _ServerState, put_answer


def _wire_codec(request: web.Request) -> str:
    """The request's wire codec (400 for an unknown name)."""
    return W.parse_wire_codec(request.headers.get(W.WIRE_CODEC_HEADER))


async def get(request: web.Request) -> web.StreamResponse:
    """``POST /v1/get``: raw (``kvstore.daemon.payload.get``) unless the request names a
    lossy wire codec, which the namespace must accept (422)."""
    codec = _wire_codec(request)
    if codec == "raw":
        return await raw_routes.get(request)
    _, ns, keys = await _ns_keys(request)
    W.check_accepted(ns, codec)
    if not keys:
        raise P.ProtocolError("'keys' must be a non-empty list")
    state: _ServerState = request.app[STATE_KEY]
    layout = ns.layout
    budget = len(keys) * (layout.chunk_bytes + W.max_nbytes(codec, layout))
    await state.budget.acquire(budget, state.budget_wait_s())
    try:
        chunks = await state.call(request.app[STORE_KEY].get_chunks, ns, keys)
        if all(c is None for c in chunks):
            raise P.ProtocolError(f"none of the {len(keys)} keys is stored", 404)
        entries, views = await state.call(_encode_all, keys, chunks, codec)
        del chunks
        total = sum(v.nbytes for v in views)
        resp = await raw_routes._send(request, entries, total, [[v] for v in views],
                                      headers={W.WIRE_CODEC_HEADER: codec})
    finally:
        state.budget.release(budget)
    state.bytes_out.inc(total)
    return resp


def _encode_all(keys, chunks, codec: str):
    """Header entries and payloads of a get's chunks (None: not found) under ``codec``."""
    entries, views = [], []
    for k, c in zip(keys, chunks):
        if c is None:
            entries.append(P.ChunkEntry(k, found=False))
            continue
        used, view = W.encode_chunk(c, codec)
        entries.append(P.ChunkEntry(k, view.nbytes, P.dtype_name(c.dtype), tuple(c.shape),
                                    P.checksum(view), codec=used))
        views.append(view)
    return entries, views


async def put(request: web.Request) -> web.Response:
    """``POST /v1/put``: raw (``kvstore.daemon.payload.put``) unless the request names a
    lossy wire codec, which the namespace must accept (422, before any payload is read)."""
    codec = _wire_codec(request)
    if codec == "raw":
        return await raw_routes.put(request)
    state: _ServerState = request.app[STATE_KEY]
    store = request.app[STORE_KEY]
    budget = [0]
    entries = []
    try:
        ns, entries, durable, payloads = await _read_encoded(request, state, store, codec,
                                                            budget)
        tensors = await state.call(_decode_all, entries, payloads, ns.layout)
        del payloads
        keys, parents = [e.key for e in entries], P.put_parents(entries)
        stored = await state.call_shielded(store.put_chunks, ns, keys, tensors, parents)
        if durable:
            await state.call_shielded(raw_routes.persist, store, ns, keys, tensors, parents)
    finally:
        state.budget.release(budget[0])
    state.bytes_in.inc(sum(e.nbytes for e in entries))
    return _ok(await put_answer(state, store, ns, keys, parents, stored, durable))


async def _read_encoded(request: web.Request, state: _ServerState, store, codec: str,
                        budget: list[int]):
    """Read and check an encoded put body: ``(namespace, entries, durable, payloads)``, one
    bytearray per entry, each matching its checksum. Nothing is stored on any error.

    Raises:
        P.ProtocolError: as a raw put's checks, 422 for a namespace that does not accept
            ``codec``, 503 past the budget wait.
    """
    limits = state.limits
    ns, entries, durable, head_bytes = await raw_routes.read_put_header(request, state, store,
                                                                         codec)
    reader, declared = request.content, request.content_length
    total = P.payload_total(entries)
    expected = head_bytes + total
    if expected > limits.max_body_bytes:
        raise P.ProtocolError(f"body of {expected} bytes exceeds {limits.max_body_bytes}", 413)
    if declared is not None and declared != expected:
        raise P.ProtocolError(f"body is {declared} bytes but its header declares {expected}")
    await raw_routes._take_budget(state, budget, total + len(entries) * ns.layout.chunk_bytes)
    payloads, carry = [], [None]
    for e in entries:
        buf = bytearray(e.nbytes)
        h = xxhash.xxh3_64()
        await raw_routes._read_into(reader, memoryview(buf), h, carry)
        if h.hexdigest() != e.xxh3:
            state.rejected.labels("checksum").inc()
            raise P.ProtocolError(f"checksum mismatch for key {e.key.hex()[:16]}...; "
                                  "nothing stored")
        payloads.append(buf)
    if carry[0] is not None or (declared is None and await reader.read(1)):
        raise P.ProtocolError("trailing bytes after the last declared payload")
    return ns, entries, durable, payloads


def _decode_all(entries, payloads, layout):
    """The chunks ``[L, 2, T, H, D]`` (layout's dtype) of a put's payloads. Raises
    P.ProtocolError(400) naming the first payload that does not decode."""
    out = []
    for e, buf in zip(entries, payloads):
        try:
            out.append(W.decode_chunk(buf, e.codec, layout))
        except P.ProtocolError as err:
            raise P.ProtocolError(f"chunk {e.key.hex()[:16]}...: {err}; nothing stored") \
                from None
    return out

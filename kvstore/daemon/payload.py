"""The binary payload routes of the kvstore server: ``POST /v1/get`` and ``POST /v1/put``.

Wire format in ``kvstore.daemon.protocol``. With a store doing direct I/O (``kvstore.direct``) puts
are read straight into reserved CPU-tier pages and gets are sent from reader-pinned pages;
otherwise (or for durable puts and lower-tier reads) payloads are staged in pooled buffers
under the server's in-flight byte budget.
"""
from __future__ import annotations

import asyncio
import time

import xxhash
from aiohttp import web

from kvstore.daemon import protocol as P
from kvstore.daemon.batches import MAX_BODY_HEADER, MAX_KEYS_HEADER
from kvstore.api import KVStoreBase
from kvstore.direct import BorrowedChunks, Reservation
from kvstore.daemon.state import STATE_KEY, STORE_KEY, _check_fits, _ns_keys, _ok, _ServerState, _shaped
from kvstore.daemon.state import authorize, put_answer
from kvstore.daemon.tenants import WRITE
from kvstore.daemon.wire_codec import check_accepted


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
    bufs, filled = [], True
    try:
        if state.get_into_buffers:
            bufs = [state.buffers.take(ns.layout.chunk_bytes) for _ in keys]
            out = [_shaped(b, ns.layout) for b in bufs]
            filled = False  # until get_chunks returns it may write into bufs
            chunks = await state.call_shielded(request.app[STORE_KEY].get_chunks, ns, keys, out)
            filled = True
            del out
        else:
            chunks = await state.call(request.app[STORE_KEY].get_chunks, ns, keys)
        if all(c is None for c in chunks):
            raise P.ProtocolError(f"none of the {len(keys)} keys is stored", 404)
        entries, views = await state.call(_describe, keys, chunks)
        total = sum(v.nbytes for v in views)
        pieces = [[v] for v in views]
        del chunks, views  # each chunk is freed as soon as _send has sent it
        resp = await _send(request, entries, total, pieces)
    finally:
        if filled:  # (else a cancelled get_chunks may still write into them: not pooled)
            state.buffers.give(bufs)  # asyncio has copied whatever the socket did not take
        state.budget.release(budget)
    state.bytes_out.inc(total)
    return resp


async def _send(request: web.Request, entries, total: int, chunks,
                headers: dict | None = None) -> web.StreamResponse:
    """Stream a get answer: the header of ``entries``, then each found chunk's byte pieces
    (``chunks``: per found chunk, a list of memoryviews; ``total`` bytes in all) in slices of
    ``WRITE_SLICE``. Each chunk's list is dropped as soon as it is sent. ``headers``: more
    HTTP headers of the answer."""
    head = P.get_response_header(entries)
    limits = request.app[STATE_KEY].limits  # named as on every other answer
    resp = web.StreamResponse(headers={"Content-Type": P.BINARY_CONTENT_TYPE,
                                       P.VERSION_HEADER: str(P.PROTOCOL_VERSION),
                                       MAX_BODY_HEADER: str(limits.max_body_bytes),
                                       MAX_KEYS_HEADER: str(limits.max_batch_keys),
                                       **(headers or {})})
    resp.content_length = len(head) + total
    await resp.prepare(request)
    await resp.write(head)
    while chunks:
        for mv in chunks.pop(0):
            for off in range(0, mv.nbytes, WRITE_SLICE):
                await resp.write(mv[off:off + WRITE_SLICE])
    await resp.write_eof()
    return resp


async def _get_direct(request: web.Request, state: "_ServerState", ns, keys) -> web.StreamResponse:
    """Get without staging copies (``ChunkStore.borrow_chunks``): chunks in the CPU tier are
    sent from the arena pages themselves while reader-pinned; only chunks read from a lower
    tier take payload budget."""
    store = request.app[STORE_KEY]
    # a timeout landing during a store call must neither leak the pins nor drop them while
    # read_lower still reads (and promotes) under them
    borrowed = await state.call_owned(store.borrow_chunks, BorrowedChunks.release, ns, keys)
    budget, total, lower = 0, 0, None
    try:
        if borrowed.lower:
            need = len(borrowed.lower) * ns.layout.chunk_bytes
            await state.budget.acquire(need, state.budget_wait_s())
            budget = need  # (taken: given back below; a refused acquire took nothing)
            lower = asyncio.ensure_future(state.call(borrowed.read_lower))
            await asyncio.shield(lower)
        if all(p is None for p in borrowed.parts):
            raise P.ProtocolError(f"none of the {len(keys)} keys is stored", 404)
        entries = await state.call(_describe_parts, keys, borrowed.parts, ns.layout)
        total = sum(e.nbytes for e in entries if e.found)
        resp = await _send(request, entries, total,
                           [[memoryview(v.numpy()) for v in parts] for parts in borrowed.parts
                            if parts is not None])
        await _flushed(request, state.limits.request_timeout_s)
    finally:
        _drop_unsent(request)
        state.budget.release(budget)
        await asyncio.shield(_release_after(state, lower, borrowed))
    state.bytes_out.inc(total)
    return resp


async def _release_after(state: "_ServerState", lower, borrowed) -> None:
    """Drop a get's reader pins once its read of lower tiers (if any) has finished."""
    if lower is not None:
        await asyncio.wait([lower])
    await state.call(borrowed.release)


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
    budget, bufs, items, handed, busy = [0], [], [], False, False
    try:
        ns, entries, durable = await _read_put(request, state, store, budget, bufs, items)
        keys = [e.key for e in entries]
        parents = P.put_parents(entries)
        handed = busy = True  # the store owns the reservations; it may read bufs until done
        # shielded: a timeout landing now must not drop the commit from the pool's queue
        # (its reservations would leak) nor pool bufs the store is still copying from
        try:
            if state.direct:
                stored = await state.call_shielded(store.commit_chunks, ns, keys, items, parents)
            else:
                stored = await state.call_shielded(store.put_chunks, ns, keys, items, parents)
            if durable:
                await state.call_shielded(persist, store, ns, keys, items, parents)
        except asyncio.CancelledError:
            raise  # the shielded call may still read bufs: they are not pooled
        except BaseException:
            busy = False
            raise
        busy = False
        items = []  # drop the tensors (the store copied or committed them)
    finally:
        if not handed and state.direct:
            store.release_reservations(items)  # nothing read is visible: the pages go back
        if (state.reuse_put_buffers and not busy) or not handed:
            state.buffers.give(bufs)  # the store copied them, or never saw them
        state.budget.release(budget[0])
    state.bytes_in.inc(sum(e.nbytes for e in entries))
    return _ok(await put_answer(state, store, ns, keys, parents, stored, durable))


def can_persist(store: KVStoreBase) -> bool:
    """Whether ``store`` can make a put durable (``capabilities.durable_puts``: ``persist``
    writes through to a disk tier)."""
    return store.capabilities.durable_puts


def persist(store: KVStoreBase, ns, keys, tensors, parents=None) -> None:
    """Make just-put chunks durable with ``store.persist`` (write through to the disk tier and
    wait for the commit). Blocking; call on the store pool.

    Raises:
        P.ProtocolError(507): some chunk is not committed on disk (no room: everything pinned
            or the tier too small; or the write was dropped).
    """
    n = store.persist(ns, keys, tensors, parents=parents)
    if n is not None and n < len(keys):
        raise P.ProtocolError(f"disk tier has no room for a durable put: {n} of {len(keys)} "
                              "chunks committed", 507)


async def read_put_header(request: web.Request, state: _ServerState, store: KVStoreBase,
                          wire_codec: str = "raw"):
    """Read and check a put body's preamble and header, before any payload byte:
    ``(namespace, entries, durable, head_bytes)``, ``head_bytes`` the preamble's and header's
    bytes; the body's reader is left at the first payload.

    Raises:
        P.ProtocolError: 413 for a declared body past ``max_body_bytes``, 400 for an empty
            body or a bad header (``P.parse_put_header``; entries may name ``wire_codec``),
            403 for a namespace the token may not write, 422 for a lossy ``wire_codec`` the
            namespace does not accept (``wire_codec.check_accepted``), the store's refusal of
            the namespace (``_check_fits``), 400 for a durable put without a disk tier.
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
    ns, entries, durable = P.parse_put_header(header, limits.max_batch_keys, wire_codec)
    authorize(request, ns, WRITE)  # 403 before any payload byte is read
    check_accepted(ns, wire_codec)  # 422 likewise
    _check_fits(store, ns, state)
    if durable and not can_persist(store):
        raise P.ProtocolError("durable put needs a disk tier (serve with --disk-path and "
                              "--disk-bytes)")
    return ns, entries, durable, P.PREAMBLE_BYTES + hdr_len


async def _read_put(request: web.Request, state: _ServerState, store: KVStoreBase,
                    budget: list[int], bufs: list, items: list):
    """Read and validate a put body: header first, then each payload against its checksum.

    Payloads land straight in pages reserved in the store's CPU tier when it has one
    (``ChunkStore.reserve_chunks``, chunk by chunk just before each payload is read; not for
    durable puts, which go through buffers to the disk tier). A chunk for which the CPU tier
    has no room (every chunk pinned), and every chunk after it, is read and dropped (None in
    ``items``; the store counts it rejected) unless the store has a lower tier to take it.
    Other payloads land in buffers of the server's pool (appended to ``bufs`` for the caller
    to give back) once their bytes fit in the server's byte budget (``budget[0]`` is set to
    what was taken, for the caller to release). ``items`` receives one ``Reservation`` or tensor per
    chunk (the caller releases reservations on failure).

    Nothing is handed to the store until every payload has arrived and checked out.
    """
    limits = state.limits
    ns, entries, durable, head_bytes = await read_put_header(request, state, store)
    reader, declared = request.content, request.content_length
    expected = head_bytes + P.payload_total(entries)
    if expected > limits.max_body_bytes:
        raise P.ProtocolError(f"body of {expected} bytes exceeds {limits.max_body_bytes}", 413)
    if declared is not None and declared != expected:
        raise P.ProtocolError(f"body is {declared} bytes but its header declares {expected}")
    layout = ns.layout
    direct = state.direct and not durable
    lower = store.capabilities.has_lower_tiers
    items.extend([None] * len(entries))
    if not direct:
        await _take_budget(state, budget, P.payload_total(entries))
    scratch, carry, room = None, [None], True
    parents = P.put_parents(entries)
    for i, e in enumerate(entries):
        staged = not direct
        if direct and room:
            # reserved as its payload is about to arrive, not all at once: the pages set aside
            # (and the chunks evicted for them) never run ahead of the bytes received by more
            # than one chunk, so a stalled or vanished uploader evicts at most one chunk
            (items[i],) = await state.call_owned(store.reserve_chunks,
                                                 store.release_reservations, ns, [e.key],
                                                 [parents[i]])
            room = items[i] is not None  # (no room: nor for the chunks chained after it)
        if direct:
            # no room in the CPU tier (all pinned): stage for a lower tier, or read and drop
            staged = items[i] is None and lower
            if staged and not budget[0]:  # one budget wait per request (no hold-and-wait)
                await _take_budget(state, budget, P.payload_total(entries[i:]))
        if isinstance(items[i], Reservation):
            views = items[i].memoryviews()
        elif not staged:  # stored already, or no room anywhere: read through scratch
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


async def _take_budget(state: _ServerState, budget: list[int], nbytes: int) -> None:
    """Take ``nbytes`` of the in-flight byte budget for a put (``budget[0]``: what it holds,
    for the caller to release). Raises P.ProtocolError(503) after the budget wait."""
    if nbytes:
        await state.budget.acquire(nbytes, state.budget_wait_s())
        budget[0] = nbytes


#: Bytes of the scratch buffer that the payload of a dropped chunk is read through.
DROP_SCRATCH = 256 << 10


async def _read_exact(reader, n: int) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise P.ProtocolError(f"truncated body: got {len(e.partial)} of {n} bytes") from None


async def _read_into(reader, view: memoryview, hasher, carry: list) -> None:
    """Fill ``view`` from ``reader``, feeding each piece to ``hasher`` while it is in cache.

    Reads one received piece at a time (``readchunk``; ``readany`` joins every piece buffered
    so far into a new bytes object, a copy); the part of a piece beyond ``view`` is left in
    ``carry[0]`` (a memoryview) for the next call.

    Raises:
        P.ProtocolError: the body ended first.
    """
    pos, n = 0, view.nbytes
    while pos < n:
        data, carry[0] = carry[0], None
        if data is None:
            got, boundary = await reader.readchunk()
            while not got and boundary:  # an empty read at an HTTP chunk boundary: go on
                got, boundary = await reader.readchunk()
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



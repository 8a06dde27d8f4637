"""The ops of the daemon's same-host path (``kvstore.daemon.shm_protocol``'s table), each the
twin of its HTTP route: same checks (tenant salt and role, namespace fit, batch limit), same
store calls on the store thread pool, same answers.

A handler takes the connection (``kvstore.daemon.shm_server.Connection``) and the request
header; it returns the reply's fields, or None when it sent its reply itself (a get with
inline bytes), and raises ``ProtocolError`` / ``Forbidden`` for an error reply. A put reads
its payload from the connection; a payload a handler leaves unread is an error. ``INLINE``
ops may be answered on the event loop at once (``lookup_now``; ``get_now`` in
``kvstore.daemon.shm_get``, where ``get`` lives)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import TYPE_CHECKING, Awaitable, Callable

import numpy as np
import xxhash

from kvstore.daemon import protocol as P
from kvstore.daemon import shm_vm as V
from kvstore.daemon.payload import DROP_SCRATCH, can_persist, persist
from kvstore.daemon.shm_args import ns_keys as _ns_keys
from kvstore.daemon.shm_args import ok as _ok
from kvstore.daemon.shm_get import get, get_now
from kvstore.daemon.shm_staging import copy_entries, map_client_staging, put_staged_direct
from kvstore.daemon.state import _check_fits, _shaped, put_answer
from kvstore.daemon.tenants import WRITE
from kvstore.direct import Reservation

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.daemon.shm_server import Connection

#: A put's bytes are received and hashed in slices of this many bytes (hashed while in cache).
RECV_SLICE = 512 << 10


def lookup_now(c: "Connection", h: dict) -> dict | None:
    """``lookup`` answered on the event loop when the store lock is free (no thread hop),
    else None (``lookup`` then runs it on the store pool)."""
    if not c.server.nonblocking_lookup:
        return None
    ns, keys = _ns_keys(c, h)
    res = c.store.try_lookup_keys(ns, keys)
    return None if res is None else _lookup_reply(res)


async def lookup(c: "Connection", h: dict) -> dict:
    ns, keys = _ns_keys(c, h)
    return _lookup_reply(await c.state.call(c.store.lookup_keys, ns, keys))


def _lookup_reply(res) -> dict:
    return _ok(num_hit_chunks=res.num_hit_chunks, chunk_size=res.chunk_size,
               tiers=list(res.tiers), num_requested_chunks=res.num_requested_chunks)


async def exists(c: "Connection", h: dict) -> dict:
    ns, keys = _ns_keys(c, h)
    found = await c.state.call(c.store.exists, ns, keys)
    return _ok(exists=[bool(x) for x in found])


async def put(c: "Connection", h: dict) -> dict:
    """Read each chunk straight into pages reserved for it (``ChunkStore.reserve_chunks``),
    checked against its xxh3, then commit the whole batch (``commit_chunks``): as
    ``POST /v1/put`` (``kvstore.daemon.payload``), nothing is visible before every chunk
    arrived and checked out."""
    state, store = c.state, c.store
    ns, entries, durable = _parse_put(c, h)
    c.tenant.check(ns.cache_salt, WRITE)
    _check_fits(store, ns, state)
    if durable and not can_persist(store):
        raise P.ProtocolError("durable put needs a disk tier (serve with --disk-path and "
                              "--disk-bytes)")
    vm, held = h.get("vm") is not None, 0  # vm: read from the client's memory (``shm_vm``)
    staged = None if vm else _staged_source(c, h, entries)
    if vm:
        ranges = V.put_ranges(c.peer, h, entries, c.payload_left, state.limits.max_body_bytes)
        if state.direct and not durable:  # reserve, read, commit in one store-pool call
            done = await state.call_shielded(V.put_vm_direct, store, ns, entries, c.peer, ranges)
            if done is not None:
                return await _stored(c, ns, entries, done[0], False)
        held = sum(n for _, n in ranges)  # read_all's one array: in the payload budget
        await state.budget.acquire(held, state.budget_wait_s())
        try:
            staged = await state.call_shielded(V.read_all, c.peer, ranges)
        except BaseException:
            state.budget.release(held)
            raise
    elif staged is None and c.payload_left != P.payload_total(entries):
        raise P.ProtocolError(f"payload is {c.payload_left} bytes but the chunks declare "
                              f"{P.payload_total(entries)}")
    if staged is not None and not vm and state.direct and not durable:
        # the common case in one store-pool call (reserve, copy + hash, commit): no hops
        done = await state.call_shielded(put_staged_direct, store, ns, entries, staged)
        if done is not None:
            stored, _, bad = done
            if bad is not None:
                state.rejected.labels("checksum").inc()
                raise P.ProtocolError(f"checksum mismatch for key {bad.key.hex()[:16]}...; "
                                      "nothing stored")
            return await _stored(c, ns, entries, stored, False)
    budget, bufs, items, handed, copying = [0], [], [None] * len(entries), False, []
    try:
        if staged is None:
            await _read_chunks(c, ns, entries, durable, budget, bufs, items)
        else:
            await _copy_staged(c, ns, entries, durable, budget, bufs, items, staged, copying)
        keys, parents = [e.key for e in entries], P.put_parents(entries)
        handed = True  # the store owns the reservations now
        if state.direct and not durable:
            stored = await state.call_shielded(store.commit_chunks, ns, keys, items, parents)
        else:
            stored = await state.call_shielded(store.put_chunks, ns, keys, items, parents)
        if durable:
            await state.call_shielded(persist, store, ns, keys, items, parents)
        items = []
    finally:
        if copying and not copying[0].done():  # cancelled mid-copy: the pages are still written
            await asyncio.shield(asyncio.wait(copying))
        if not handed:
            store.release_reservations(items)
        if not handed or state.reuse_put_buffers:
            state.buffers.give(bufs)
        state.budget.release(budget[0] + held)
    return await _stored(c, ns, entries, stored, durable)


async def _stored(c: "Connection", ns, entries, stored: int, durable: bool) -> dict:
    """A put's reply, as ``POST /v1/put``'s (``kvstore.daemon.state.put_answer``:
    ``stored``, ``num_chunks``, ``durable``, ``already_stored``, ``refused``,
    ``first_refused``); its bytes counted in."""
    c.state.bytes_in.inc(P.payload_total(entries))
    keys, parents = [e.key for e in entries], P.put_parents(entries)
    return _ok(**await put_answer(c.state, c.store, ns, keys, parents, stored, durable))


def _parse_put(c: "Connection", h: dict):
    """``parse_put_header``'s ``(namespace, entries, durable)``; on a version 2 connection the
    entries of a put from staging may leave out ``xxh3`` (they get ``xxh3=""``: copied
    unhashed, ``kvstore.daemon.shm_protocol``)."""
    chunks, unhashed = h.get("chunks"), set()
    if (c.version >= 2 and (h.get("staging_offset") is not None or h.get("vm") is not None)
            and isinstance(chunks, list)):
        unhashed = {i for i, ch in enumerate(chunks) if isinstance(ch, dict) and "xxh3" not in ch}
        if unhashed:
            h = {**h, "chunks": [{**ch, "xxh3": "0" * 16} if i in unhashed else ch
                                 for i, ch in enumerate(chunks)]}
    ns, entries, durable = P.parse_put_header(h, c.state.limits.max_batch_keys)
    return ns, [dataclasses.replace(e, xxh3="") if i in unhashed else e
                for i, e in enumerate(entries)], durable


async def _read_chunks(c: "Connection", ns, entries, durable: bool, budget: list[int],
                       bufs: list, items: list) -> None:
    """Fill ``items`` (one ``Reservation``, tensor, ``ALREADY_STORED`` or None per entry)
    from the payload, as ``kvstore.daemon.payload._read_put`` does: reserve a chunk's pages
    just before its bytes arrive; no room (every chunk pinned): stage it for a lower tier,
    or read and drop it and every later one. Raises ProtocolError on a checksum mismatch."""
    state, store = c.state, c.store
    direct = state.direct and not durable
    lower = store.capabilities.has_lower_tiers
    if not direct:
        await _take_budget(state, budget, P.payload_total(entries))
    parents = P.put_parents(entries)
    scratch, room = None, True
    for i, e in enumerate(entries):
        if direct and room:
            (items[i],) = await state.call_owned(store.reserve_chunks, store.release_reservations,
                                                 ns, [e.key], [parents[i]])
            room = items[i] is not None
        staged = not direct or (items[i] is None and lower)
        if direct and staged and not budget[0]:
            await _take_budget(state, budget, P.payload_total(entries[i:]))
        if isinstance(items[i], Reservation):
            views = items[i].memoryviews()
        elif staged:
            buf = state.buffers.take(ns.layout.chunk_bytes)
            bufs.append(buf)
            items[i] = _shaped(buf, ns.layout)  # [L, 2, T, H, D]
            views = [memoryview(buf.numpy())]
        else:  # stored already, or no room anywhere: read through scratch
            scratch = scratch or memoryview(bytearray(DROP_SCRATCH))
            views = [scratch[:min(DROP_SCRATCH, e.nbytes - o)]
                     for o in range(0, e.nbytes, DROP_SCRATCH)]
        hasher = xxhash.xxh3_64()
        for view in views:
            await _recv_hashed(c, view, hasher)
        if hasher.hexdigest() != e.xxh3:
            state.rejected.labels("checksum").inc()
            raise P.ProtocolError(f"checksum mismatch for key {e.key.hex()[:16]}...; "
                                  "nothing stored")


def _staged_source(c: "Connection", h: dict, entries) -> np.ndarray | None:
    """The staging bytes of a put from the connection's staging area (``staging_offset`` in
    the header), or None for a put whose bytes follow on the socket.

    Raises:
        ProtocolError: no staging area, a bad offset, chunks past its end, or a payload too.
    """
    off = h.get("staging_offset")
    if off is None:
        return None
    total = P.payload_total(entries)
    if c.staging is None:
        raise P.ProtocolError("put from staging before any stage request")
    if type(off) is not int or off < 0 or off + total > c.staging.size:
        raise P.ProtocolError(f"staging_offset {off!r} with {total} chunk bytes does not fit "
                              f"the staging area of {c.staging.size} bytes")
    if c.payload_left:
        raise P.ProtocolError("a put from staging carries no payload")
    return c.staging[off:off + total]


async def _copy_staged(c: "Connection", ns, entries, durable: bool, budget: list[int],
                       bufs: list, items: list, src: np.ndarray, copying: list) -> None:
    """Fill ``items`` as ``_read_chunks`` does, from the client's staging bytes ``src``:
    reserve the whole batch at once, stage into buffers what must go to a lower tier, then
    copy and hash every chunk on the store pool (``copying`` holds that future, so that a
    cancelled request waits for it before its pages are given back). Chunks stored already or
    with no room anywhere are not read. Raises ProtocolError on a checksum mismatch."""
    state, store = c.state, c.store
    direct = state.direct and not durable
    lower = store.capabilities.has_lower_tiers
    keys, parents = [e.key for e in entries], P.put_parents(entries)
    if direct:
        items[:] = await state.call_owned(store.reserve_chunks, store.release_reservations,
                                          ns, keys, parents)
    need = [i for i, it in enumerate(items) if not direct or (it is None and lower)]
    if need:
        await _take_budget(state, budget, len(need) * ns.layout.chunk_bytes)
    for i in need:
        buf = state.buffers.take(ns.layout.chunk_bytes)
        bufs.append(buf)
        items[i] = _shaped(buf, ns.layout)  # [L, 2, T, H, D]
    copying.append(asyncio.ensure_future(state.call(copy_entries, src, entries, list(items))))
    bad = await asyncio.shield(copying[0])
    if bad is not None:
        state.rejected.labels("checksum").inc()
        raise P.ProtocolError(f"checksum mismatch for key {bad.key.hex()[:16]}...; nothing "
                              "stored")


async def stage(c: "Connection", h: dict) -> dict:
    """Map the client's staging memfd (passed on the request's one payload byte) read-only
    (``kvstore.daemon.shm_staging``); a later ``stage`` replaces it."""
    if c.payload_left != 1:
        raise P.ProtocolError("stage carries its memfd on a payload of exactly 1 byte")
    fds = await c.recv_fds()
    try:
        if len(fds) != 1:
            raise P.ProtocolError(f"stage must pass exactly one descriptor, got {len(fds)}")
        c.staging = map_client_staging(fds[0], h.get("nbytes"), c.state.limits.max_body_bytes)
    finally:
        for fd in fds:
            os.close(fd)
    return _ok(staging_bytes=int(c.staging.size))


async def _recv_hashed(c: "Connection", view: memoryview, hasher) -> None:
    """Fill ``view`` from the connection in ``RECV_SLICE`` pieces, hashing each as it lands."""
    pos, n = 0, view.nbytes
    while pos < n:
        got = await c.recv_payload(view[pos:min(n, pos + RECV_SLICE)])
        hasher.update(view[pos:pos + got])
        pos += got


async def _take_budget(state, budget: list[int], nbytes: int) -> None:
    if nbytes:
        await state.budget.acquire(nbytes, state.budget_wait_s())
        budget[0] = nbytes


async def remove(c: "Connection", h: dict) -> dict:
    ns, keys = _ns_keys(c, h, WRITE)
    return _ok(removed=int(await c.state.call(c.store.remove, ns, keys)))


async def demote(c: "Connection", h: dict) -> dict:
    ns, keys = _ns_keys(c, h, WRITE)
    return _ok(demoted=int(await c.state.call(c.store.demote, ns, keys)))


async def clear(c: "Connection", h: dict) -> dict:
    if h.get("namespace") is None:
        c.tenant.require_admin("clear of every namespace")
        ns = None
    else:
        ns = P.parse_namespace(h.get("namespace"))
        c.tenant.check(ns.cache_salt, WRITE)
    return _ok(removed=int(await c.state.call(c.store.clear, ns)))


async def pin(c: "Connection", h: dict) -> dict:
    ns, keys = _ns_keys(c, h, WRITE)
    max_lease = c.state.limits.max_lease_s
    lease = h.get("lease_s")
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))
                              or not lease > 0):
        raise P.ProtocolError(f"lease_s must be a positive number, got {lease!r}")
    lease = float(min(lease or max_lease, max_lease))  # (an int past a float's range: capped)
    n = await c.state.call(c.store.pin, ns, keys, lease)
    return _ok(pinned=int(n), lease_s=lease)


async def unpin(c: "Connection", h: dict) -> dict:
    ns, keys = _ns_keys(c, h, WRITE)
    return _ok(unpinned=int(await c.state.call(c.store.unpin, ns, keys)))


async def stats(c: "Connection", h: dict) -> dict:
    c.tenant.require_admin("stats")
    return _ok(**await c.state.stats_body(c.store))


#: op name -> its answer on the event loop at once, or None when it must wait (its handler)
INLINE: dict[str, Callable[["Connection", dict], dict | None]] = {"lookup": lookup_now,
                                                                   "get": get_now}

#: op name -> handler (``release`` and ``hello`` are the connection's own)
HANDLERS: dict[str, Callable[["Connection", dict], Awaitable[dict | None]]] = {
    "lookup": lookup, "exists": exists, "get": get, "put": put, "remove": remove,
    "demote": demote, "clear": clear, "pin": pin, "unpin": unpin, "stats": stats, "stage": stage}

__all__ = ["HANDLERS", "INLINE", "RECV_SLICE"]

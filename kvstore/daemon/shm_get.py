"""The daemon's same-host ``get`` (``kvstore.daemon.shm_protocol``): the chunks are reader-pinned
and answered as page runs of the shared arena (the borrow stays with the connection until the
client's ``release``), or as bytes inline for chunks of lower tiers.

``get_now`` answers on the event loop itself, with no task switch and no timeout to arm, when
the store lock is free and every chunk is in the shared arena or stored nowhere: the common
hit of an engine on the same host. ``get`` does the rest (lower tiers on the store's thread
pool, under the payload budget)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvstore.daemon import protocol as P
from kvstore.daemon.shm_args import ns_keys as _ns_keys
from kvstore.daemon.shm_args import ok as _ok
from kvstore.direct import BorrowedChunks, is_direct, is_shared

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.daemon.shm_server import Connection


def get_now(c: "Connection", h: dict) -> dict | None:
    """``get``'s reply fields when it can be answered at once (module docstring), with the
    borrow registered on ``c``; None, with nothing pinned or counted, when ``get`` must
    answer (the store lock is busy, a chunk is in a lower tier, a remote tier could hold a
    missing one, or the store has a host memory tier outside the shared arena).

    Raises:
        as ``get``; ProtocolError 429: the connection holds ``MAX_BORROWS`` borrows
            (``kvstore.daemon.shm_session``).
    """
    store = c.store
    if not _all_memory_shared(store):
        return None
    ns, keys = _ns_keys(c, h)
    if not keys:
        raise P.ProtocolError("'keys' must be a non-empty list")
    c.check_borrow_room()
    b = store.try_borrow_chunks(ns, keys, views=False)  # the client reads the runs
    if b is None:
        return None
    chunks, _ = _describe(b)  # (no inline bytes: every found chunk has runs)
    if any(r is not None for r in b.runs):
        return _ok(borrow=c.add_borrow(b), chunks=chunks, payload_bytes=0)
    if not b.try_release():  # nothing found: nothing is pinned, but close it as get does
        c.release_soon(b)
    return _ok(borrow=None, chunks=chunks, payload_bytes=0)


def _all_memory_shared(store) -> bool:
    """Whether every host memory tier of ``store`` is the shared arena, so that a chunk
    ``try_borrow_chunks`` holds has page runs to answer (a GPU tier on a CPU-only host is
    host memory outside it)."""
    tiers = getattr(store, "tiers", None)
    return (tiers is not None and hasattr(store, "try_borrow_chunks")
            and all(is_shared(t) or not is_direct(t) for t in tiers))


async def get(c: "Connection", h: dict) -> None:
    """Pin the chunks; answer arena runs for those in the shared arena (the borrow stays with
    the connection until ``release``) and the bytes of the others inline (read from lower
    tiers under the payload budget; their pins dropped once sent)."""
    ns, keys = _ns_keys(c, h)
    if not keys:
        raise P.ProtocolError("'keys' must be a non-empty list")
    c.check_borrow_room()
    state = c.state
    # a timeout landing during a store call must neither leak the pins nor drop them while
    # read_lower still reads (and promotes) under them
    store = c.store
    # inline when the store lock is free and every chunk is in host memory (no thread hop)
    b = (store.try_borrow_chunks(ns, keys, views=False) if hasattr(store, "try_borrow_chunks")
         else None)
    if b is None:
        b = await state.call_owned(store.borrow_chunks, BorrowedChunks.release, ns, keys)
    budget, lower, kept = 0, None, False
    try:
        if b.lower:
            need = len(b.lower) * ns.layout.chunk_bytes
            await state.budget.acquire(need, state.budget_wait_s())
            budget = need  # (taken: given back below; a refused acquire took nothing)
            lower = asyncio.ensure_future(state.call(b.read_lower))
            await asyncio.shield(lower)
        chunks, inline = _describe(b)
        kept = any(r is not None for r in b.runs)
        borrow = c.add_borrow(b) if kept else None
        total = sum(v.nbytes for v in inline)
        await c.reply(_ok(borrow=borrow, chunks=chunks, payload_bytes=total), inline)
        state.bytes_out.inc(total)
    finally:
        state.budget.release(budget)
        if not kept:
            await asyncio.shield(_release_after(state, lower, b))


def _describe(b: BorrowedChunks) -> tuple[list, list[memoryview]]:
    """Per key ``{"runs": ...}``, ``{"inline": nbytes}`` or None, and the inline bytes."""
    chunks: list = []
    inline: list[memoryview] = []
    for runs, parts in zip(b.runs, b.parts):
        if runs is not None:
            chunks.append({"runs": [[off, n] for off, n in runs]})
        elif parts is not None:
            chunks.append({"inline": sum(v.numel() for v in parts)})
            inline += [memoryview(v.numpy()) for v in parts]
        else:
            chunks.append(None)
    return chunks, inline


async def _release_after(state, lower, b: BorrowedChunks) -> None:
    """Drop a get's pins once its read of lower tiers (if any) has finished (inline when
    ``try_release`` can, else on the store pool)."""
    if lower is not None:
        await asyncio.wait([lower])
    if not b.try_release():
        await state.call(b.release)


__all__ = ["get", "get_now"]

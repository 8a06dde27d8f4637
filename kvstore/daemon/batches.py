"""Requests that fit the daemon's limits: a client splits a put or a key request into batches
of at most ``max_batch_keys`` keys and (puts) ``max_body_bytes`` bytes, sent in order.

The daemon answers 413 to a request past ``kvstore serve --max-body-bytes`` or
``--max-batch-keys``. Both clients (HTTP: ``kvstore.daemon.async_client``; same host:
``kvstore.daemon.shm_client``) learn the limits (every HTTP answer carries them in
``LIMIT_HEADERS``; the same-host ``hello`` answers them too) and split by this module's
``plan``. A put's batches go in the order of its chunks, each naming its first chunk's
parent, so what was stored when a later batch fails is a stored prefix. Lookups merge their
batches' answers (``merge_lookups``: a batch after the first miss is not asked).

Imports neither torch nor aiohttp.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

from kvstore.errors import RemoteError

#: HTTP answer headers of the daemon's limits (every answer carries them)
MAX_BODY_HEADER = "X-KVStore-Max-Body-Bytes"
MAX_KEYS_HEADER = "X-KVStore-Max-Batch-Keys"
LIMIT_HEADERS = (MAX_BODY_HEADER, MAX_KEYS_HEADER)


@dataclass(frozen=True)
class DaemonLimits:
    """A daemon's request limits.

    Attributes:
        max_body_bytes: largest request body in bytes (HTTP: header and payloads; same host:
            the payloads).
        max_batch_keys: most keys or chunks in one request.
    """

    max_body_bytes: int
    max_batch_keys: int


class ChunkTooLarge(RemoteError):
    """A single chunk that no request within the daemon's ``max_body_bytes`` can carry
    (status 413, as the daemon would answer). Nothing of the put was sent."""

    def __init__(self, index: int, nbytes: int, max_body_bytes: int):
        super().__init__(413, f"chunk {index} of the put needs a request of {nbytes} bytes, "
                              f"more than the daemon's max_body_bytes of {max_body_bytes} "
                              f"(kvstore serve --max-body-bytes): it cannot be stored; raise "
                              f"the limit or store smaller chunks")
        self.index, self.nbytes, self.max_body_bytes = index, nbytes, max_body_bytes


def _positive(value: Any) -> int | None:
    """``value`` as a positive int (an int, or a string of digits), else None."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return value if type(value) is int and value > 0 else None


def limits_from(mapping: Mapping | None) -> DaemonLimits | None:
    """The limits in ``mapping`` (HTTP answer headers by ``LIMIT_HEADERS``, or a dict with
    ``max_body_bytes`` and ``max_batch_keys``: a ``hello`` reply or ``/v1/stats``'s
    ``server``), or None when either is missing or not a positive integer (an older daemon)."""
    if mapping is None:
        return None
    body = mapping.get(MAX_BODY_HEADER, mapping.get("max_body_bytes"))
    keys = mapping.get(MAX_KEYS_HEADER, mapping.get("max_batch_keys"))
    body, keys = _positive(body), _positive(keys)
    if body is None or keys is None:
        return None
    return DaemonLimits(body, keys)


_BODY_413 = re.compile(r"exceeds (\d+)")
_KEYS_413 = re.compile(r"limit of (\d+) per batch")


def limits_from_413(error: RemoteError, known: DaemonLimits | None) -> DaemonLimits | None:
    """The limits a 413 answer's message names (``"body of N bytes exceeds M"``, ``"N keys
    exceed the limit of M per batch"``) merged into ``known``, or None when ``error`` is not
    such a 413 (the caller then raises it)."""
    if getattr(error, "status", None) != 413:
        return None
    body = keys = None
    m = _KEYS_413.search(error.message)
    if m:
        keys = int(m.group(1))
    else:
        m = _BODY_413.search(error.message)
        if m:
            body = int(m.group(1))
    if not (body or keys):
        return None
    big = 1 << 62
    return DaemonLimits(body or (known.max_body_bytes if known else big),
                        keys or (known.max_batch_keys if known else big))


def plan(count: int, limits: DaemonLimits | None, sizes: Sequence[int] | None = None,
         fixed: int = 0) -> list[range]:
    """Batches of ``range(count)``, in order, each of at most ``limits.max_batch_keys``
    items and (with ``sizes``: each item's bytes in the request, its share of the header
    included) at most ``limits.max_body_bytes`` bytes counting ``fixed`` (the request's own
    bytes: its header without entries). ``limits`` None: one batch.

    Raises:
        ChunkTooLarge: an item that alone exceeds ``max_body_bytes`` (with ``fixed``).
    """
    if count <= 0:
        return []
    if limits is None:
        return [range(count)]
    out: list[range] = []
    start, used = 0, fixed
    for i in range(count):
        size = sizes[i] if sizes is not None else 0
        if sizes is not None and fixed + size > limits.max_body_bytes:
            raise ChunkTooLarge(i, fixed + size, limits.max_body_bytes)
        if i > start and (i - start >= limits.max_batch_keys
                          or (sizes is not None and used + size > limits.max_body_bytes)):
            out.append(range(start, i))
            start, used = i, fixed
        used += size
    out.append(range(start, count))
    return out


def batch_parents(keys: Sequence, parents: Sequence | None, batch: range) -> list:
    """The parents of ``batch``'s keys, the first one's always explicit (``parents`` None:
    a chain from ``keys[0]``, whose parent is None), so each batch names its first chunk's
    parent as a put of the whole list would have implied it."""
    if parents is not None:
        return [parents[i] for i in batch]
    return [None if i == 0 else keys[i - 1] for i in batch]


def merge_lookups(results: Sequence, num_requested: int, result_type: type):
    """One ``LookupResult`` (of ``result_type``) from the answers of consecutive batches:
    hits add up while each batch hit all its keys (``num_hit_chunks`` is the leading run)."""
    hits, tiers, chunk_size = 0, [], 0
    for r in results:
        chunk_size = r.chunk_size or chunk_size
        hits += r.num_hit_chunks
        tiers.extend(r.tiers)
        if r.num_hit_chunks < r.num_requested_chunks:
            break
    return result_type(hits, chunk_size, tuple(tiers), num_requested)


def _relearned(error: RemoteError, used: DaemonLimits | None, holder: Any
               ) -> DaemonLimits | None:
    """After ``error``, the limits to plan the rest with (stored on ``holder.limits``), or
    None when ``error`` is not a 413 that names limits other than ``used``."""
    if isinstance(error, ChunkTooLarge) or getattr(error, "status", None) != 413:
        return None
    new = holder.limits if holder.limits != used else limits_from_413(error, used)
    if new is None or new == used:
        return None
    holder.limits = new
    return new


def _batches_from(done: int, count: int, limits: DaemonLimits | None,
                  sizes: Sequence[int] | None, fixed: int) -> list[range]:
    return [range(done + b.start, done + b.stop)
            for b in plan(count - done, limits, None if sizes is None else sizes[done:], fixed)]


def run_batches(holder: Any, count: int, call: Callable[[range], Any], *,
                sizes: Sequence[int] | None = None, fixed: int = 0,
                stop: Callable[[Any], bool] | None = None) -> list:
    """``call(batch)`` for each batch of ``range(count)`` (``plan`` with ``holder.limits``),
    in order; the answers, up to the first one ``stop`` accepts. A 413 that teaches other
    limits (the answer's headers, or its message) re-plans the batches not yet answered
    (once per call).

    Raises:
        ChunkTooLarge: as ``plan`` (nothing sent).
        RemoteError, and whatever ``call`` raises: the first batch that failed (the batches
            before it were answered).
    """
    out: list = []
    done, retried = 0, False
    while True:
        used = holder.limits
        try:
            for b in _batches_from(done, count, used, sizes, fixed):
                out.append(call(b))
                done = b.stop
                if stop is not None and stop(out[-1]):
                    return out
            return out
        except RemoteError as e:
            if retried or _relearned(e, used, holder) is None:
                raise
            retried = True


async def run_batches_async(holder: Any, count: int,
                            call: Callable[[range], Awaitable[Any]], *,
                            sizes: Sequence[int] | None = None, fixed: int = 0,
                            stop: Callable[[Any], bool] | None = None) -> list:
    """``run_batches`` with an async ``call``."""
    out: list = []
    done, retried = 0, False
    while True:
        used = holder.limits
        try:
            for b in _batches_from(done, count, used, sizes, fixed):
                out.append(await call(b))
                done = b.stop
                if stop is not None and stop(out[-1]):
                    return out
            return out
        except RemoteError as e:
            if retried or _relearned(e, used, holder) is None:
                raise
            retried = True


def lookup_done(r: Any) -> bool:
    """``stop`` of a lookup's batches (a ``LookupResult`` or its JSON answer): this batch
    missed a key (later ones are not asked)."""
    if isinstance(r, dict):
        return r.get("num_hit_chunks", 0) < r.get("num_requested_chunks", 0)
    return r.num_hit_chunks < r.num_requested_chunks


#: answer fields that add up over a key request's batches
_COUNTS = ("removed", "demoted", "pinned", "unpinned", "num_hit_chunks")


def merge_answers(answers: Sequence[dict], num_keys: int) -> dict:
    """One JSON answer of a key request from its batches' answers (in order): counts add
    up, ``exists`` and ``tiers`` lists join, ``num_requested_chunks`` is ``num_keys``;
    other fields are the last answer's."""
    out = dict(answers[-1])
    for name in _COUNTS:
        if name in out:
            out[name] = sum(a.get(name, 0) for a in answers)
    for name in ("exists", "tiers"):
        if name in out:
            out[name] = [x for a in answers for x in a.get(name, ())]
    if "num_requested_chunks" in out:
        out["num_requested_chunks"] = num_keys
    return out


__all__ = ["run_batches", "run_batches_async", "lookup_done", "merge_answers", "DaemonLimits", "ChunkTooLarge", "LIMIT_HEADERS", "MAX_BODY_HEADER",
           "MAX_KEYS_HEADER", "limits_from", "limits_from_413", "plan", "batch_parents",
           "merge_lookups"]

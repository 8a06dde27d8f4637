"""What a connector's put stored, refused and found stored before, for every store.

A daemon's put answers a ``kvstore.daemon.put_result.PutResult`` that says which chunks it
refused (``refused``, ``first_refused``). An in-process ``ChunkStore`` (alone, or in front of
a daemon in a ``LayeredStore``) answers a plain count of chunks newly stored: a chunk it did
not store may have been stored before, or refused (``rejected_chunks`` in its metrics: no tier
could take it without evicting its own prefix, or its parent is stored nowhere).
``checked_put`` tells them apart as the daemon does (``kvstore.daemon.state.put_answer``):
when fewer chunks than sent were newly stored, one ``exists`` call (plus one for the parent of
the first chunk not held) makes a ``LocalPutResult``, so the connectors count refusals in
``refused_chunks`` whichever store refused them.

A store refuses ``no_room`` when its tiers cannot hold a prompt's prefix up to the chunk: a
chunk is stored only with its whole prefix (the store never evicts a chunk's ancestors to
make room for it), so the in-process tiers' total size caps how many chunks of one prompt are
stored, and a remote (Redis) tier below them receives only chunks they stored.
``room_hint`` says so in words for the one WARNING.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvstore.daemon.put_result import PutResult
from kvstore.keys import ChunkKey, Namespace
from kvstore.units import format_size


class LocalPutResult(PutResult):
    """A ``PutResult`` made by ``checked_put`` for a store that answered a plain count (an
    in-process store): the same fields, found by ``exists`` just after the put."""


def _direct(fn: Callable, *args):
    return fn(*args)


def checked_put(store, ns: Namespace, keys: Sequence[ChunkKey], stored: int,
                parents: Sequence[ChunkKey | None] | None = None,
                call: Callable = _direct) -> int:
    """The answer of a put of ``keys`` into ``store`` that returned ``stored``, with its
    refusals: ``stored`` itself when a daemon made it (a ``PutResult``; an older daemon's
    ``refused`` None stays unknown) or when every chunk was newly stored; else (a plain count:
    an in-process store) a ``LocalPutResult`` with
    ``already_stored`` (held, not newly stored), ``refused`` (held nowhere, as
    ``store.exists`` says just after the put: a chunk evicted meanwhile by another put reads as
    refused) and ``first_refused`` (``{"index", "key", "reason"}``: ``parent_missing`` when its
    parent, ``parents[i]`` or by default the key before it, is stored nowhere, else
    ``no_room``).

    Args:
        parents: as the put was given them (None: ``keys`` chain from a prompt's first chunk).
        call: ``call(fn, *args)`` makes each store call (default ``fn(*args)``).

    Raises:
        whatever ``store.exists`` raises (the put itself succeeded: the caller keeps
        ``stored``).
    """
    n = len(keys)
    if isinstance(stored, PutResult) or int(stored) >= n:
        return stored
    present = call(store.exists, ns, list(keys))
    held = sum(map(bool, present))
    first = next((i for i, p in enumerate(present) if not p), None)
    first_refused = None
    if first is not None:
        if parents is not None:
            parent = parents[first]
        else:
            parent = keys[first - 1] if first else None
        orphan = parent is not None and not call(store.exists, ns, [parent])[0]
        first_refused = {"index": first, "key": keys[first].hex(),
                         "reason": "parent_missing" if orphan else "no_room"}
    return LocalPutResult(int(stored), n, max(0, held - int(stored)), n - held, first_refused)


def local_tiers(store) -> list:
    """The tiers (``kvstore.tiers.base.Tier``: ``name``, ``capacity_bytes``) of ``store``'s
    in-process ``ChunkStore`` (``store`` itself, or a ``LayeredStore``'s ``local``); [] for a
    daemon client."""
    for s in (store, getattr(store, "local", None)):
        tiers = getattr(s, "tiers", None)
        if isinstance(tiers, list) and all(hasattr(t, "capacity_bytes") for t in tiers):
            return tiers
    return []


def room_hint(store, ns: Namespace) -> str:
    """Words for a ``no_room`` refusal of the in-process store: its tier sizes, ``ns``'s chunk
    size, about how many chunks of one prompt they hold (a chunk is kept only with its whole
    prefix), and the flags that change it. ``""`` when ``store`` has no in-process tiers."""
    tiers = local_tiers(store)
    if not tiers:
        return ""
    chunk = ns.layout.chunk_bytes
    sizes = ", ".join(f"{t.name} {format_size(t.capacity_bytes)}" for t in tiers)
    fit = sum(t.capacity_bytes // chunk for t in tiers) if chunk else 0
    return (f"the in-process tiers ({sizes}) hold about {fit} chunk(s) of "
            f"{format_size(chunk)} ({ns.layout.chunk_size} tokens) of one prompt, since a "
            f"chunk is stored only with its whole prefix; a remote tier below them receives "
            f"only the chunks they store; raise --kvstore-cpu-bytes (vLLM: cpu_bytes) or add "
            f"a disk tier (--kvstore-disk-path)")


def log_local_refusal(logger: logging.Logger, told: set, store, ns: Namespace, kind: str,
                      result: PutResult) -> None:
    """Log a put of ``ns`` (a ``kind`` of save, ``"save"``, ``"tail save"``) that the
    in-process store refused ``result.refused`` chunks of (a ``LocalPutResult``), by the first
    refused chunk's reason: the first ``no_room`` of a connector (``told``: its set of what
    was logged, updated) at WARNING with ``room_hint``, every other refusal at DEBUG (a
    ``parent_missing`` follows a chunk refused in an earlier save, or a prefix evicted since
    the lookup). The tier size does not change while the engine runs: one WARNING says it."""
    reason = (result.first_refused or {}).get("reason", "unknown")
    first = reason == "no_room" and "local no_room" not in told
    told.add(f"local {reason}")
    hint = room_hint(store, ns) if first else ""
    logger.log(logging.WARNING if first else logging.DEBUG,
               "kv connector: the in-process store refused %d of %d chunks of a %s (%s; "
               "counted in refused_chunks%s)%s", result.refused, result.num_chunks, kind,
               reason, ", logged at DEBUG from now on" if first else "",
               f": {hint}" if hint else "")


__all__ = ["LocalPutResult", "checked_put", "local_tiers", "log_local_refusal", "room_hint"]

"""The borrowing read a connector's loads use: ``borrowing_read(store)`` returns
``read(ns, keys)``, whose result's ``parts`` (per key, the chunk's bytes as 1-D uint8 tensors,
or None), ``lower`` / ``read_lower()`` and ``release()`` are those of
``kvstore.direct.BorrowedChunks``, or None when the store lends nothing (the loads then copy
through ``get_chunks``).

* An in-process store that declares ``borrowed_reads`` (``ChunkStore``): ``borrow_chunks``,
  views of its CPU tier's pages.
* The daemon client (``KVStoreClient``, alone or behind its ``CircuitBreakerStore``):
  ``get_borrowed``, read-only views of the daemon's shared arena held by the daemon's reader
  pins when it is on this host (``kvstore.daemon.shm_borrow``), the chunks copied out over
  HTTP otherwise. Behind a breaker the read is the breaker's ``get``: skipped while it is open,
  tripping it when the daemon is unavailable, under its per-chunk get deadline.

Why here and not a capability: ``StoreCapabilities.borrowed_reads`` promises zero-copy views on
every path, which the client gives only over its Unix socket.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from kvstore.api import KVStoreBase
from kvstore.daemon.client import KVStoreClient
from kvstore.keys import ChunkKey, Namespace
from kvstore.layered import CircuitBreakerStore

BorrowingRead = Callable[[Namespace, Sequence[ChunkKey]], Any]


def borrowing_read(store: KVStoreBase) -> BorrowingRead | None:
    """``read(ns, keys) -> borrow`` for ``store`` (module docstring), or None."""
    if store.capabilities.borrowed_reads:
        return store.borrow_chunks
    breaker = store if isinstance(store, CircuitBreakerStore) else None
    client = breaker.remote if breaker is not None else store
    if not isinstance(client, KVStoreClient):
        return None
    if breaker is None:
        return client.get_borrowed

    def read(ns: Namespace, keys: Sequence[ChunkKey]) -> Any:
        fn = client.get_borrowed
        if breaker.get_timeout_s_per_chunk is not None:
            fn = functools.partial(fn, timeout_s=breaker.get_timeout_s_base
                                   + breaker.get_timeout_s_per_chunk * len(keys))
        return breaker._call("get", fn, ns, keys)  # noqa: SLF001 - the breaker's get path
    return read


__all__ = ["BorrowingRead", "borrowing_read"]

"""Whether the kvstore daemon takes a chunk of the engine's namespace in one request.

The daemon refuses a request larger than ``kvstore serve --max-body-bytes`` (413), and its
client refuses a put of a chunk that alone exceeds it before sending anything
(``kvstore.daemon.batches.ChunkTooLarge``). An engine whose chunk is that large (SmolLM2-135M
fp16 in 256-token chunks: 5.9 MB, against a 4 MiB limit) could then never save. The connector
checks at start, once it knows the daemon's limit (``oversize``), and logs one WARNING naming
both sizes and the two settings that fix it (``warn``); a save that meets ``ChunkTooLarge``
later (the daemon was not answering at start, or a put's header tips a chunk over) logs the
same warning, once.
"""
from __future__ import annotations

import logging
from typing import Any

from kvstore.api import KVStoreBase
from kvstore.keys import Namespace

log = logging.getLogger("connectors.chunk_limit")

#: Deadline of the one call that asks the daemon its limits at start, when no call was
#: answered yet (seconds).
ASK_TIMEOUT_S = 2.0


def daemon_client(store: KVStoreBase) -> Any | None:
    """The daemon client (``kvstore.daemon.client.KVStoreClient``: it has ``request_limits``)
    in ``store``: the store itself, or the ``remote`` of a ``CircuitBreakerStore`` or a
    ``LayeredStore`` around it; None when the store reaches no daemon."""
    obj: Any = store
    for _ in range(4):
        if obj is None:
            return None
        if callable(getattr(obj, "request_limits", None)):
            return obj
        obj = getattr(obj, "remote", None)
    return None


def oversize(store: KVStoreBase, ns: Namespace, timeout_s: float = ASK_TIMEOUT_S
             ) -> tuple[int, int] | None:
    """``(chunk_bytes, max_body_bytes)`` when one chunk of ``ns`` (``ns.layout.chunk_bytes``)
    is larger than the daemon's ``max_body_bytes``; None when it fits, when ``store`` reaches
    no daemon, or when the daemon's limit is unknown (not answering within ``timeout_s``
    seconds, an older daemon). Never raises."""
    client = daemon_client(store)
    if client is None:
        return None
    limits = client.request_limits(timeout_s=timeout_s)
    if limits is None or ns.layout.chunk_bytes <= limits.max_body_bytes:
        return None
    return ns.layout.chunk_bytes, limits.max_body_bytes


def warn(store: KVStoreBase, ns: Namespace, chunk_bytes: int, max_body_bytes: int,
         skipped: bool) -> None:
    """Log the one WARNING of a chunk of ``ns`` (``chunk_bytes``, a request of at least as
    many) that the daemon cannot take (``max_body_bytes``): both sizes, and the settings to
    change. ``skipped``: the engine's saves of such chunks are skipped (the daemon is its only
    store); else only the daemon misses them (in-process tiers in front keep them)."""
    client = daemon_client(store)
    url = getattr(client, "url", None)
    log.warning(
        "kvstore daemon %s takes requests of at most %d bytes (kvstore serve "
        "--max-body-bytes) but one %d-token chunk of %s is %d bytes: %s; start the daemon "
        "with --max-body-bytes above %d (a chunk and its request's header), or give the "
        "engine a smaller chunk size "
        "(--kvstore-chunk-size)", url, max_body_bytes, ns.layout.chunk_size, ns.model_id,
        chunk_bytes, "its saves are skipped (counted in save_errors)" if skipped
        else "the daemon stores none of its chunks", chunk_bytes)


def saves_go_to_daemon_only(store: KVStoreBase) -> bool:
    """Whether every save of ``store`` goes to the daemon alone (the bare client or its
    breaker): a chunk it cannot take is then not stored anywhere, and skipping its save
    loses nothing. False for a ``LayeredStore`` (its in-process tiers keep the chunk)."""
    from kvstore.layered import LayeredStore
    return daemon_client(store) is not None and not isinstance(store, LayeredStore)

"""Build an ``EngineMinConnector`` from simple options (the server's ``--kvstore-*`` flags).

Which store:

* ``cpu_bytes`` and/or ``disk_path`` (+ ``disk_bytes``) only: an in-process ``ChunkStore``
  (``disk_path`` alone = disk tier only, no CPU tier);
* ``url`` only: the ``kvstore serve`` daemon through ``KVStoreClient``;
* both: ``LayeredStore`` = the in-process tiers in front of the daemon.

The daemon's client is always wrapped in a ``CircuitBreakerStore``: once the daemon fails, it is
skipped for a cool-down (2 s doubling to 30 s), so a dead daemon costs requests ~nothing.

Sizes accept ints or text (``"512MiB"``). ``url`` accepts ``http://HOST:PORT`` or
``tcp://HOST:PORT`` (the same daemon).
"""
from __future__ import annotations

import argparse
import logging
from typing import Any
from urllib.parse import urlsplit

from connectors.engine_min import EngineMinConnector
from kvstore.layered import CircuitBreakerStore, LayeredStore

log = logging.getLogger("kvstore.connectors.factory")

#: disk tier size when only ``disk_path`` is given.
DEFAULT_DISK_BYTES = "4GiB"


def _http_url(url: str) -> str:
    if url.startswith("tcp://"):
        url = "http://" + url[len("tcp://"):]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"kvstore url must look like http://HOST:PORT, got {url!r}")
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises on a bad port
    except ValueError as e:  # a port out of range or not a number
        raise ValueError(f"kvstore url must look like http://HOST:PORT, got {url!r}: {e}") \
            from None
    if not host:
        raise ValueError(f"kvstore url must look like http://HOST:PORT, got {url!r}: no host")
    return url


#: Deadline of one background save to a daemon (seconds).
SAVE_TIMEOUT_S = 30.0


def create_connector(cpu_bytes: int | str | None = None, disk_path: str | None = None,
                     disk_bytes: int | str | None = None, url: str | None = None,
                     chunk_size: int = 256, deadline_s: float = 0.5, *,
                     model_id: str | None = None, revision: str | None = None,
                     auth_token: str | None = None, save_generated: bool = True,
                     tail_chunk_size: int = 0,
                     **connector_kwargs: Any) -> EngineMinConnector:
    """A connector over the store these options describe (see module docstring).

    Args:
        cpu_bytes: in-process CPU tier bytes.
        disk_path: in-process disk tier directory (lmdb; created if missing).
        disk_bytes: disk tier bytes (default ``DEFAULT_DISK_BYTES`` when ``disk_path`` is set).
        url: remote daemon URL.
        chunk_size: tokens per chunk (a multiple of the engine's block size).
        deadline_s: longest wait of a lookup and base wait of a step's loads; also the client's
            per-call timeout for the daemon.
        model_id, revision: chunk-key namespace names; None (default) = the engine's own
            (its ``kv_identity``: the model's metadata name, or its ``--model-id`` /
            ``--model-revision``). The namespace always holds the engine's weights
            fingerprint, dtype and RoPE too (``EngineMinConnector.register_model``).
        auth_token: daemon bearer token. A tenant's token (``kvstore serve --tenants-file``)
            binds the connector to its tenant's salt: the daemon is asked for it once here
            (``GET /v1/whoami``, see ``daemon_tenant_salt``) and every namespace carries it
            (a ``cache_salt`` in ``connector_kwargs`` becomes a sub-salt ``tenant/salt``).
        save_generated: save generated tokens' full chunks at request end.
        tail_chunk_size: also store the tokens past the last full chunk as pieces of this
            many tokens (a multiple of the block size dividing ``chunk_size``); 0 (default) =
            full chunks only. See ``connectors.engine_min``.
        connector_kwargs: further ``EngineMinConnector`` arguments.

    Raises:
        ValueError: no store given, ``disk_bytes`` without ``disk_path``, a bad URL or size,
            a bad ``tail_chunk_size``.
    """
    if disk_bytes and not disk_path:
        raise ValueError("disk_bytes needs disk_path")
    local_wanted = bool(cpu_bytes) or bool(disk_path)
    if not local_wanted and not url:
        raise ValueError("no store: give cpu_bytes, disk_path or url")
    stores = []
    if local_wanted:
        from kvstore.config import StoreConfig
        from kvstore.store import ChunkStore
        cfg = StoreConfig(cpu_bytes=cpu_bytes or 0,
                          disk_bytes=(disk_bytes or DEFAULT_DISK_BYTES) if disk_path else 0,
                          disk_path=disk_path)
        stores.append(ChunkStore(cfg))
    if url:
        from kvstore.daemon.client import KVStoreClient
        timeout_s = max(deadline_s, 0.05)
        client = KVStoreClient(_http_url(url), auth_token=auth_token, timeout_s=timeout_s)
        if auth_token:
            from kvstore.daemon.tenants import bind_salt
            connector_kwargs["cache_salt"] = bind_salt(
                daemon_tenant_salt(client, max(timeout_s, WHOAMI_TIMEOUT_S)),
                connector_kwargs.get("cache_salt", ""))
        # Saves are background work: a long deadline, so a big save on a busy host does not
        # trip the breaker; gets get the connector's per-chunk load allowance.
        stores.append(CircuitBreakerStore(
            client, put_timeout_s=SAVE_TIMEOUT_S,
            get_timeout_s_per_chunk=connector_kwargs.get("deadline_s_per_chunk", 0.05),
            get_timeout_s_base=timeout_s))
    store = stores[0] if len(stores) == 1 else LayeredStore(stores[0], stores[1])
    return EngineMinConnector(store, chunk_size=chunk_size, model_id=model_id,
                              revision=revision, deadline_s=deadline_s,
                              save_generated=save_generated, tail_chunk_size=tail_chunk_size,
                              **connector_kwargs)


#: Deadline of the one ``whoami`` call a daemon-backed connector makes at start (seconds).
WHOAMI_TIMEOUT_S = 2.0


def daemon_tenant_salt(client: Any, timeout_s: float) -> str | None:
    """The salt the daemon binds ``client``'s token to (``GET /v1/whoami``), or None for an
    unbound (admin) token. A daemon that cannot be asked (down, an old version, a wrong
    token) also gives None, logged: the connector then names unsalted namespaces, which a
    tenant token is refused (403), so it recomputes; it never reads another tenant's chunks.
    """
    from kvstore.daemon.client import RemoteError, StoreUnavailable
    try:
        salt = client.whoami(timeout_s=timeout_s).get("cache_salt")
    except (StoreUnavailable, RemoteError, ValueError) as e:
        log.warning("kvstore daemon %s: cannot learn this token's tenant salt (%s); its "
                    "requests may be refused until the engine restarts", client.url, e)
        return None
    return salt if isinstance(salt, str) else None


def connector_from_args(args: argparse.Namespace) -> EngineMinConnector | None:
    """The connector of the server's flags (``kvstore_cpu_bytes``, ``kvstore_disk_path``,
    ``kvstore_disk_bytes``, ``kvstore_url``, ``kvstore_chunk_size``, optional
    ``kvstore_deadline_s``, ``kvstore_auth_token`` and ``kvstore_tail_chunk_size``), or None
    when no store flag is set.

    Raises:
        ValueError: as ``create_connector``.
    """
    opts = {k: getattr(args, f"kvstore_{k}", None)
            for k in ("cpu_bytes", "disk_path", "disk_bytes", "url")}
    if not any(v is not None for v in opts.values()):
        return None
    extra = {}
    for k in ("chunk_size", "deadline_s", "auth_token", "tail_chunk_size"):
        v = getattr(args, f"kvstore_{k}", None)
        if v is not None:
            extra[k] = v
    return create_connector(**opts, **extra)

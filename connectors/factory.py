"""Build an ``EngineMinConnector`` from simple options (the server's ``--kvstore-*`` flags).

The store is built by ``connectors.stores.open_store`` (the one path the vLLM adapter uses
too): in-process tiers (``cpu_bytes``, ``disk_path``), the ``kvstore serve`` daemon (``url``),
or both layered. The daemon's client is always wrapped in a ``CircuitBreakerStore`` here: once
the daemon fails, it is skipped for a cool-down (2 s doubling to 30 s), so a dead daemon costs
requests ~nothing.
"""
from __future__ import annotations

from typing import Any

from connectors.engine_min import EngineMinConnector
from connectors.stores import (DEFAULT_DISK_BYTES, GET_TIMEOUT_S_PER_CHUNK,  # noqa: F401
                               SAVE_TIMEOUT_S, BreakerTimes, StoreSpec, daemon_tenant_salt,
                               engine_saves, open_store)
from kvstore.defaults import DEFAULT_CHUNK_SIZE


def create_connector(cpu_bytes: int | str | None = None, disk_path: str | None = None,
                     disk_bytes: int | str | None = None, url: str | None = None,
                     chunk_size: int = DEFAULT_CHUNK_SIZE, deadline_s: float = 0.5, *,
                     model_id: str | None = None, revision: str | None = None,
                     auth_token: str | None = None, save_generated: bool = True,
                     tail_chunk_size: int | None = None, remote: dict | None = None,
                     wire_codec: str = "",
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
            many tokens (a multiple of the block size dividing ``chunk_size``); None (default)
            = the engine's block size when it divides ``chunk_size``; 0 = full chunks only.
            See ``connectors.engine_min``.
        remote: the in-process store's remote tier (Redis) as ``StoreSpec`` fields
            (``remote_url``, ``remote_key_prefix``, ``remote_ttl_s``, ``remote_timeout_s``);
            None = none.
        wire_codec: the daemon client's wire codec (``StoreSpec.wire_codec``): chunks of
            namespaces that accept it travel to and from the daemon encoded; ``""``: raw.
        connector_kwargs: further ``EngineMinConnector`` arguments; its ``lossy_codec``
            also sets the in-process store's disk and remote tier codec (``StoreSpec``).

    A daemon token whose role is ``reader`` (``GET /v1/whoami`` at start) may only read: with
    the daemon alone the connector saves nothing (no gather, no put; one INFO line says so),
    lookups and loads as usual; in front of in-process tiers saves go to those tiers only
    (the ``LayeredStore`` sends the daemon nothing; one INFO line says so).

    Raises:
        ValueError: no store given, ``disk_bytes`` without ``disk_path``, a bad URL or size,
            a bad ``chunk_size``, ``tail_chunk_size`` or deadline (the store opened for the
            connector is closed again).
    """
    timeout_s = max(deadline_s, 0.05)
    # Saves are background work: a long deadline, so a big save on a busy host does not
    # trip the breaker; gets get the connector's per-chunk load allowance.
    breaker = BreakerTimes.for_connector(
        timeout_s, connector_kwargs.get("deadline_s_per_chunk", GET_TIMEOUT_S_PER_CHUNK))
    opened = open_store(StoreSpec(cpu_bytes=cpu_bytes, disk_path=disk_path,
                                  disk_bytes=disk_bytes, url=url, auth_token=auth_token,
                                  timeout_s=timeout_s, breaker=breaker,
                                  lossy_codec=connector_kwargs.get("lossy_codec", ""),
                                  wire_codec=wire_codec,
                                  **(remote or {})))
    store = opened.store
    try:
        if url and auth_token:
            from kvstore.daemon.tenants import bind_salt
            connector_kwargs["cache_salt"] = bind_salt(opened.tenant_salt,
                                                       connector_kwargs.get("cache_salt", ""))
        if not engine_saves(opened):
            connector_kwargs["saves"] = False
        return EngineMinConnector(store, chunk_size=chunk_size, model_id=model_id,
                                  revision=revision, deadline_s=deadline_s,
                                  save_generated=save_generated,
                                  tail_chunk_size=tail_chunk_size, **connector_kwargs)
    except BaseException:
        store.close()   # a refused option leaves nothing open (a disk path's lock, the arena)
        raise

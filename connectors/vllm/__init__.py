"""The KV store as a KV connector for the real vLLM engine (vLLM's ``KVConnectorBase_V1``).

Use (a vLLM ``KVTransferConfig``)::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="connectors.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"kvstore_url": "http://127.0.0.1:8500",
                                                "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                "chunk_size": 256})

``kv_connector_extra_config`` keys (all optional; ``connectors.vllm.options`` checks every
value before a store opens, naming the key of a bad one; an unknown key is refused, naming the
closest known key, so a misspelt ``kvstore_ulr`` does not fall back to the in-process store):

* ``kvstore_url``: a ``kvstore serve`` daemon (``kvstore.daemon.client.KVStoreClient``). Without it the
  store is an in-process ``kvstore.store.ChunkStore``, shared by the scheduler-side and
  worker-side connectors of one process. That needs an executor that runs the worker in the
  scheduler's process (``distributed_executor_backend="uni"``, one worker; on vLLM's CPU
  platform also ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, without which it turns ``"uni"`` into
  ``"mp"``): under ``"mp"`` or ``"ray"`` the engine refuses to start
  (``options.check_store_reach``), since the worker would fill a store the scheduler never
  reads. With several worker processes use the daemon.
* ``cpu_bytes`` (default ``"1GiB"``), ``disk_bytes``, ``disk_path``: in-process tiers
  (``disk_path`` alone: a disk tier of ``connectors.stores.DEFAULT_DISK_BYTES``; with
  ``kvstore_url`` they are not used, and a warning says so). Stores are
  opened by ``connectors.stores.open_store``, as the engine_min connector's are.
  ``store_name`` (default ``"default"``) tells apart in-process stores of equal sizes in one
  process.
* ``remote_url``, ``remote_key_prefix``, ``remote_ttl_s``, ``remote_timeout_s``: a remote tier
  in Redis or a Redis Cluster below the in-process tiers, shared with every store on any host
  that points at it (not with ``kvstore_url``: set ``--remote-url`` on the daemon instead);
  the password from the URL or ``$KVSTORE_REMOTE_PASSWORD``. See docs/remote-tier.md.
* ``model_id`` (default: vLLM's served model name, else the model's path), ``revision``,
  ``weights_fingerprint`` (text: ``"auto"``, ``"off"`` or a given fingerprint),
  ``chunk_size`` (default ``kvstore.defaults.DEFAULT_CHUNK_SIZE``, 256; a multiple of vLLM's
  block size), ``hash_algo``: the
  chunk-key namespace (``kvstore.keys.Namespace``), which also holds everything else in vLLM's
  config that changes the KV of the same tokens (the weights' content fingerprint, dtype, RoPE,
  weight and KV-cache quantization, a request's LoRA adapter; ``connectors.vllm.identity``).
  A request's ``cache_salt`` becomes the namespace's salt.
* ``auth_token``: the daemon's bearer token (refused without ``kvstore_url``). A tenant's
  token (``kvstore serve --tenants-file``) binds every namespace to the tenant's salt, which
  the connector asks the daemon for once (``GET /v1/whoami``); a request's ``cache_salt`` then becomes the sub-salt
  ``<tenant salt>/<cache_salt>`` (``kvstore.daemon.tenants.bind_salt``). A token with the
  read-only role (``reader``) loads and never sends the daemon a save: with the daemon alone
  nothing is saved, in front of in-process tiers saves stay in those tiers.
* ``tail_chunk_size`` (default: vLLM's block size when it divides ``chunk_size``, else 0 =
  off): the tokens past the last full chunk are also stored as pieces of this many
  tokens, in a namespace of their own (the same layout with this chunk size), so a hit
  recomputes at most ``tail_chunk_size`` tokens instead of up to ``chunk_size``, as vLLM's
  block-granular ExampleConnector does. The full chunks keep engine_min's keys.
* ``timeout_s`` (default 2.0): deadline of each store call made before or during a forward
  pass; a late or failed lookup means a miss, a late or failed load is reported to vLLM as
  failed blocks, which vLLM recomputes when ``kv_load_failure_policy="recompute"`` (set it:
  vLLM's default ``"fail"`` fails the request instead). A daemon's client is behind the
  circuit breaker engine_min's uses (``kvstore.circuit_store.CircuitBreakerStore``,
  ``connectors.stores.BreakerTimes.for_connector``): after a failed call the daemon is skipped
  for a cool-down (2 s doubling to 30 s), then probed, so a hung daemon costs one
  ``timeout_s``, not one per request; loads get ``timeout_s`` + 0.05 s a chunk, background
  saves 30 s. Failures are warned once per kind and cause (``shared.StoreCalls.warn``).
* ``save_queue_bytes`` (default 512 MiB; an int or text such as ``"1GiB"``; the old count
  ``save_queue`` is ignored, with a warning): bytes of gathered chunks waiting for the background
  writer (``connectors.save_queue.SaveQueue``, shared with the engine_min connector); a save
  that does not fit is dropped (counted) instead of stalling the engine.
* ``pin_lease_s`` (default 30): chunks found by a lookup are pinned so no eviction removes them
  before the load, until the request ends (then unpinned) or at most this long (0 disables
  pinning; a reader token with the daemon alone pins nothing, as the daemon refuses a reader's
  pin).
* ``layerwise_load`` (default ``auto``): ``true``: a step's loads run on a background thread,
  store read then layer after layer, while the forward pass runs; vLLM's
  ``wait_for_layer_load`` in layer ``i``'s attention waits only until layer ``i`` is written.
  ``false``: whole loads, every layer written before the forward pass starts. ``auto``:
  layer-wise when the KV caches are on a GPU (the copies overlap compute), whole on CPU
  (copies and the forward pass share the cores: whole loads measured faster there,
  ``bench.vllm_compare``).

``KVTransferConfig.kv_role`` as vLLM defines it: ``kv_both`` (set it for a plain cache) loads
and saves; ``kv_producer`` saves and never loads (no lookup is made: every request is
prefilled); ``kv_consumer`` loads and never saves (lookups and pins as usual).

What moves: whole chunks of ``chunk_size`` tokens, as tensors
``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` (K = index 0, V = index 1), then the
tail past the last full chunk in whole pieces of ``tail_chunk_size`` tokens (looked up where
the stored chunks end, up to the end of that chunk; counted as ``*_tail_chunks``). Only
tokens beyond vLLM's own prefix-cache hit are loaded, and at most ``prompt_len - 1`` tokens
(the last prompt token is always computed). Saved: prompt AND generated tokens. A chunk (a
piece, once the prompt's last full chunk is computed) is saved at the step that computes its
last token, so a chat's round 2 (round 1's prompt + answer + a new turn) finds round 1's
answer too; the last sampled token (no KV yet) and a partial block are never stored. The KV
is copied out of the paged cache at the end of that step and written by a background thread.
A unit left when a request finishes (its last token's id unknown at that step: async
scheduling) makes ``request_finished`` keep the blocks until the next step has copied it
out (``get_finished``). Keys, hits, load plans and save ranges are the connector core's
(``connectors.chunk_plan.RequestChunks``), the engine_min connector's too, so both engines
name the same chunks and pieces.

Paged layout: not hard-coded. At the first transfer the worker writes known K/V values through
the attention backend's own ``do_kv_cache_update`` into a scratch two-block cache shaped like
the real one, and reads back where each (token-in-block, K/V, head, dim) element landed; the
resulting offset table drives every gather and scatter. On vLLM 0.32's CPU backend this finds
the cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` holding, per (block, head),
all K rows and then all V rows (i.e. ``view(B, H, 2, N, D)``).

Files: ``connector`` (the ``KVConnectorBase_V1`` shell), ``scheduler`` (lookups, each step's
metadata), ``worker`` (loads, saves, the writer), ``layer_load`` (the layer-wise loader
thread), ``records`` (what passes between the sides),
``options`` (the configuration keys), ``identity`` (namespaces), ``paged_layout`` (the probed
paged-cache layout), ``shared`` (store calls, counters).

``KVStoreConnector`` and ``KVStoreConnectorMetadata`` need vLLM (imported on first use); the
other files, and the rest of the project, do not.
"""
from __future__ import annotations

from typing import Any

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]


def __getattr__(name: str) -> Any:
    """``KVStoreConnector`` / ``KVStoreConnectorMetadata``, imported on first use (they need
    vLLM; ``connectors.vllm.identity`` and friends do not)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from connectors.vllm import connector, scheduler
    except ImportError as e:
        if not (e.name or "").startswith("vllm"):
            raise
        raise ImportError("connectors.vllm needs vLLM (build .venv-vllm with "
                          "tools/make_vllm_env.sh)") from e
    return getattr(connector if name == "KVStoreConnector" else scheduler, name)

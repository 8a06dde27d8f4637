"""``KVStoreConnector``: vLLM's ``KVConnectorBase_V1`` over a ``KVStoreBase``, a thin shell
that reads the configuration, opens the shared store and hands each call to its scheduler side
(``connectors.vllm.scheduler``) or worker side (``connectors.vllm.worker``).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorRole)

from kvstore.api import KVStoreBase
from kvstore.layered import remote_breaker
from kvstore.layout import KVLayout

from connectors.chunk_geometry import ChunkGeometry
from connectors.stores import StoreRegistry, engine_saves
from connectors.vllm.identity import RequestNamespaces, vllm_namespace
from connectors.vllm.options import ConnectorOptions, check_store_reach
from connectors.vllm.paged_layout import PagedLayout
from connectors.vllm.scheduler import KVStoreConnectorMetadata, SchedulerSide
from connectors.vllm.shared import Counters, StoreCalls
from connectors.vllm.worker import WorkerSide, layer_index

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connectors.vllm")

class KVStoreConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a ``KVStoreBase`` (in-process tiers or a daemon).

    Constructed by vLLM once per role: ``(vllm_config, role, kv_cache_config)``. See
    ``connectors.vllm`` for the configuration keys. ``KVTransferConfig.kv_role``:
    ``kv_both`` loads and saves, ``kv_producer`` saves and never loads (no lookup: every
    request is prefilled), ``kv_consumer`` loads and never saves.

    Attributes:
        layout: the full chunks' layout ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]``.
        namespaces: the requests' namespaces (``namespaces.base``: the engine's).
        store: the store (shared with the other role's connector of this process).
        counters: this side's counters (``stats``).
        scheduler: the scheduler side (SCHEDULER role), else None.
        worker: the worker side (WORKER role), else None.

    Raises:
        ValueError: a KV cache config this connector cannot serve (several KV cache groups, a
            non-attention group), bad configuration values (``ConnectorOptions.from_extra``),
            or an in-process store under an executor whose workers are other processes
            (``options.check_store_reach``).
    """

    #: The stores of this process, shared by its scheduler-side and worker-side connectors.
    stores: ClassVar[StoreRegistry] = StoreRegistry()

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole",
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("KVStoreConnector supports exactly one KV cache group "
                             "(full attention models)")
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
            if not hasattr(spec, attr):
                raise ValueError(f"KV cache spec {type(spec).__name__} is not attention KV")
        layer_names = sorted(group.layer_names, key=layer_index)
        opts = ConnectorOptions.from_extra(extra, int(spec.block_size))
        check_store_reach(opts.store, vllm_config.parallel_config.distributed_executor_backend)
        self.options = opts
        self.tail_chunk_size = opts.tail_chunk_size
        self.layout = KVLayout(len(layer_names), int(spec.num_kv_heads), int(spec.head_size),
                               spec.dtype, opts.chunk_size)
        base = vllm_namespace(vllm_config, self.layout, extra)
        if role == KVConnectorRole.SCHEDULER:
            log.info("kvstore namespace: %s", base.describe())
        opened = self._store_handle = self.stores.acquire(opts.store)
        self._remote = bool(opts.store.url)   # a daemon (its client behind a breaker)
        self.namespaces = RequestNamespaces(base, opened.tenant_salt, opts.tail_chunk_size)
        self._counters = Counters()
        self.counters = self._counters.values
        self._calls = calls = StoreCalls(opened.store, opened.remote, opts.timeout_s)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        geometry = ChunkGeometry(int(spec.block_size), opts.chunk_size, opts.tail_chunk_size)
        if role == KVConnectorRole.SCHEDULER:
            # a read-only (reader) daemon token with the daemon alone: no saves, no pins
            writable = engine_saves(opened)
            ktc = self._kv_transfer_config
            self.scheduler = SchedulerSide(geometry, self.namespaces, calls, self._counters,
                                           opts.pin_lease_s, self._block_table,
                                           saves=writable and ktc.is_kv_producer,
                                           loads=ktc.is_kv_consumer, pins=writable)
            log.info("kvstore kv_role %s: %s", ktc.kv_role,
                     {(True, True): "loads and saves", (True, False): "saves only",
                      (False, True): "loads only"}.get(
                         (ktc.is_kv_producer, ktc.is_kv_consumer), "neither"))
        else:
            cc = vllm_config.compilation_config
            self.worker = WorkerSide(self.layout, layer_names, int(spec.block_size),
                                     int(kv_cache_config.num_blocks), calls, self._counters,
                                     opts.save_queue_bytes,
                                     lambda: cc.static_forward_context, opts.layerwise_load)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning("kv_load_failure_policy=%r: a failed store load fails the request; "
                        "set it to 'recompute' to fall back to prefill", policy)

    @property
    def store(self) -> KVStoreBase:
        """The store every call of both sides goes to (settable: a wrapper in its place)."""
        return self._calls.store

    @store.setter
    def store(self, store: KVStoreBase) -> None:
        self._calls.store = store

    def stats(self) -> dict:
        """Counters of this side (JSON-able): lookups, hit/local/external tokens, loads,
        loaded chunks/tokens, load errors, seconds in loads, saved/dropped chunks, chunks the
        store refused (``refused_chunks``: parent missing or no room; a daemon's or the
        in-process store's), errors; with a daemon its breaker's ``remote_skipped_calls``
        (calls not sent while a failed daemon cools down), ``remote_breaker_trips`` and
        ``remote_breaker_open``."""
        out: dict[str, Any] = self._counters.snapshot()
        out["role"] = self.role.name
        out["remote"] = self._remote
        breaker = remote_breaker(self._calls.store)
        if breaker is not None:
            out.update(breaker.breaker_stats())
        paged = self.paged_layout
        if paged is not None:
            out["paged_layout"] = paged.describe()
        return out

    @property
    def paged_layout(self) -> PagedLayout | None:
        """The derived paged layout (worker side, after the first transfer), else None."""
        return self.worker.paged if self.worker is not None else None

    # ==== scheduler side ===================================================================
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` (vLLM's own hit) that the store can
        supply (``SchedulerSide.lookup``), and False (loads are synchronous)."""
        return self.scheduler.lookup(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Record that ``num_external_tokens`` tokens are to be loaded for ``request``."""
        self.scheduler.allocated(request, num_external_tokens)

    def _block_table(self, req_id: str, fallback: list[int]) -> list[int]:
        mgr = self._kv_cache_manager
        if mgr is not None:
            try:
                return list(mgr.get_block_ids(req_id)[0])
            except Exception:
                pass
        return list(fallback or [])

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
        """This step's loads and saves (``SchedulerSide.build_meta``)."""
        return self.scheduler.build_meta(scheduler_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Its chunks and pieces are saved at the step that computes
        their last token (generated tokens included), so usually nothing is left and the
        blocks may be freed at once: ``(False, None)``. When a unit is left (its last token's
        id was not known at that step: async scheduling), ``(True, None)``: the next step
        copies it out of ``block_ids`` and ``get_finished`` then frees the blocks."""
        return self.scheduler.finished(request, block_ids), None

    # ==== worker side ======================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer paged caches (``WorkerSide.register``), then check that a chunk
        fits the daemon's ``--max-body-bytes`` (``WorkerSide.check_chunk_limit``: one WARNING
        naming both sizes, and saves skipped when the daemon is the only store).

        Raises:
            ValueError: the caches do not match the KV cache config's layers.
        """
        self.worker.register(kv_caches)
        base = self.namespaces.base
        self.worker.check_chunk_limit(base, self.namespaces.tail(base))

    def _metadata(self) -> KVStoreConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVStoreConnectorMetadata) else None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Start this step's loads: layer-wise (``layerwise_load``; by default on GPU) on the
        loader thread while the forward pass runs, else whole before returning. A missing chunk, a
        store error or a deadline marks the blocks of the remaining tokens as failed, for
        vLLM to recompute."""
        meta = self._metadata()
        if meta is not None and meta.loads:
            self.worker.start_load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's load has written ``layer_name``'s KV (layer-wise loads;
        whole loads are done already)."""
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves are copied out for all layers at once in ``wait_for_save``: per layer the
        copy is the same work, and the step waits for it either way (on CPU nothing runs
        beside the forward pass to hide it)."""

    def wait_for_save(self) -> None:
        """Wait for this step's load to end, then copy this step's finished chunks out of the
        paged cache (the only part of a save that blocks the step) and queue them for the
        background writer; when the queue is full the save is dropped and counted. The
        finished requests whose last saves these were may then free their blocks."""
        if self.worker is None:
            return
        self.worker.finish_load()
        meta = self._metadata()
        if meta is None:
            return
        try:
            if meta.saves:
                self.worker.save(meta.saves)
        finally:
            if meta.finished:
                self.worker.copied(meta.finished)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Finished requests whose delayed blocks may now be freed (their last saves are
        copied out), and no asynchronous loads."""
        if self.worker is None:
            return None, None
        return self.worker.finished_sending(finished_req_ids) or None, None

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued saves are written. Returns False on timeout."""
        return self.worker.flush(timeout_s) if self.worker is not None else True

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them); waits for this
        step's layer-wise load first."""
        if self.worker is None:
            return set()
        self.worker.finish_load()
        return self.worker.failed_blocks()

    def shutdown(self) -> None:
        """Write queued saves (bounded wait), stop the writer, release the store."""
        if self.worker is not None:
            self.worker.close(30.0)
        if self._store_handle is not None:
            self.stores.release(self._store_handle)
            self._store_handle = None

"""The KV store as a KV connector for the real vLLM engine (vLLM's ``KVConnectorBase_V1``).

Use (a vLLM ``KVTransferConfig``)::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="connectors.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"kvstore_url": "http://127.0.0.1:8500",
                                                "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                "chunk_size": 256})

``kv_connector_extra_config`` keys (all optional):

* ``kvstore_url``: a ``kvstore serve`` daemon (``kvstore.daemon.client.KVStoreClient``). Without it the
  store is an in-process ``kvstore.store.ChunkStore``, shared by the scheduler-side and
  worker-side connectors of one process (the uni-process executor); with several worker
  processes use the daemon.
* ``cpu_bytes`` (default ``"1GiB"``), ``disk_bytes``, ``disk_path``: in-process tiers.
* ``model_id`` (default: vLLM's served model name), ``revision``, ``weights_fingerprint``
  (``"auto"``, ``"off"`` or a given string), ``chunk_size`` (default 256), ``hash_algo``: the
  chunk-key namespace (``kvstore.keys.Namespace``), which also holds everything else in vLLM's
  config that changes the KV of the same tokens (the weights' content fingerprint, dtype, RoPE,
  weight and KV-cache quantization, a request's LoRA adapter; ``connectors.vllm_identity``).
  A request's ``cache_salt`` becomes the namespace's salt.
* ``auth_token``: the daemon's bearer token. A tenant's token (``kvstore serve --tenants-file``)
  binds every namespace to the tenant's salt, which the connector asks the daemon for once
  (``GET /v1/whoami``); a request's ``cache_salt`` then becomes the sub-salt
  ``<tenant salt>/<cache_salt>`` (``kvstore.daemon.tenants.bind_salt``).
* ``tail_chunk_size`` (default: vLLM's block size when it divides ``chunk_size``, else 0 =
  off): the prompt tokens past the last full chunk are also stored as pieces of this many
  tokens, in a namespace of their own (the same layout with this chunk size), so a hit
  recomputes at most ``tail_chunk_size`` tokens instead of up to ``chunk_size``, as vLLM's
  block-granular ExampleConnector does. The full chunks keep engine_min's keys.
* ``timeout_s`` (default 2.0): deadline of each store call made before or during a forward
  pass; a late or failed lookup means a miss, a late or failed load is reported to vLLM as
  failed blocks, which vLLM recomputes when ``kv_load_failure_policy="recompute"`` (set it:
  vLLM's default ``"fail"`` fails the request instead).
* ``save_queue`` (default 8): saves waiting for the background writer; when full, a save is
  dropped (counted) instead of stalling the engine.
* ``pin_lease_s`` (default 30): chunks found by a lookup are pinned for this long so no eviction
  removes them before the load (0 disables pinning).

What moves: whole chunks of ``chunk_size`` prompt tokens, as tensors
``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` (K = index 0, V = index 1), then the
prompt's tail past the last full chunk in whole pieces of ``tail_chunk_size`` tokens (loaded
only when every full chunk past vLLM's own hit is stored; counted as ``*_tail_chunks``). Only tokens
beyond vLLM's own prefix-cache hit are loaded, and at most ``prompt_len - 1`` tokens (the last
prompt token is always computed). A chunk is saved once vLLM has computed all its tokens; the
KV is copied out of the paged cache at the end of that step and written by a background thread.

Paged layout: not hard-coded. At the first transfer the worker writes known K/V values through
the attention backend's own ``do_kv_cache_update`` into a scratch two-block cache shaped like
the real one, and reads back where each (token-in-block, K/V, head, dim) element landed; the
resulting offset table drives every gather and scatter. On vLLM 0.32's CPU backend this finds
the cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` holding, per (block, head),
all K rows and then all V rows (i.e. ``view(B, H, 2, N, D)``).

Importing this module needs vLLM; the rest of the project does not.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError("connectors.vllm needs vLLM (build .venv-vllm with "
                      "tools/make_vllm_env.sh)") from e

from kvstore.api import KVStoreBase, chain_parents
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout
from kvstore.daemon.tenants import bind_salt

from connectors.vllm_identity import adapter_identity, request_namespace, vllm_namespace
from connectors.vllm_layout import PagedLayout, derive_paged_layout  # noqa: F401 (public here too)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.connectors.vllm")

# ------------------------------------------------------------------------------------------
# Store handles shared by the scheduler-side and worker-side connectors of one process.
# ------------------------------------------------------------------------------------------
_STORES: dict[tuple, tuple[KVStoreBase, int]] = {}
_STORES_LOCK = threading.Lock()


def _store_spec(extra: dict) -> tuple:
    if extra.get("kvstore_url"):
        return ("remote", str(extra["kvstore_url"]), float(extra.get("timeout_s", 2.0)),
                extra.get("auth_token"))
    return ("local", str(extra.get("cpu_bytes", "1GiB")), str(extra.get("disk_bytes", 0)),
            extra.get("disk_path"), str(extra.get("store_name", "default")))


def _acquire_store(extra: dict) -> tuple[tuple, KVStoreBase]:
    spec = _store_spec(extra)
    with _STORES_LOCK:
        if spec in _STORES:
            store, refs = _STORES[spec]
            _STORES[spec] = (store, refs + 1)
            return spec, store
        if spec[0] == "remote":
            from kvstore.daemon.client import KVStoreClient
            store = KVStoreClient(spec[1], timeout_s=spec[2], auth_token=spec[3])
        else:
            from kvstore.config import StoreConfig
            from kvstore.store import ChunkStore
            store = ChunkStore(StoreConfig(cpu_bytes=spec[1], disk_bytes=spec[2],
                                           disk_path=spec[3]))
        _STORES[spec] = (store, 1)
        return spec, store


def _release_store(spec: tuple) -> None:
    with _STORES_LOCK:
        if spec not in _STORES:
            return
        store, refs = _STORES[spec]
        if refs > 1:
            _STORES[spec] = (store, refs - 1)
            return
        del _STORES[spec]
    store.close()


# ------------------------------------------------------------------------------------------
# Metadata passed from the scheduler-side connector to the worker-side connector each step.
# ------------------------------------------------------------------------------------------
@dataclass
class ChunkTransfer:
    """Move chunks of one request between the store and vLLM's paged cache.

    Attributes:
        request_id: vLLM request id.
        ns: the chunk-key namespace (carries the cache salt).
        first_chunk: index of the first chunk in ``keys`` (chunk ``i`` = tokens
            ``[i*chunk_size, (i+1)*chunk_size)``).
        keys: keys of chunks ``first_chunk, first_chunk+1, ...``.
        start, end: tokens to write (load) or read (save); ``[start, end)`` lies inside the
            chunks of ``keys``.
        block_ids: the request's block table (block ``j`` holds tokens
            ``[j*block_size, (j+1)*block_size)``).
        parent: (saves) key of the chunk before ``keys[0]`` when a save continues chunks
            stored earlier, None when ``keys[0]`` starts its chain (the store keeps prefixes
            reachable only with true parents).
    """

    request_id: str
    ns: Namespace
    first_chunk: int
    keys: list[ChunkKey]
    start: int
    end: int
    block_ids: list[int]
    parent: ChunkKey | None = None


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's loads (before the forward pass) and saves (after it)."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)


@dataclass
class _ReqState:
    """Scheduler-side bookkeeping of one request."""

    request: Any
    ns: Namespace
    keys: list[ChunkKey]
    present: list[bool]
    num_local: int = 0          # tokens computed by vLLM's own prefix cache at admission
    num_external: int = 0       # tokens to load from the store (granted by vLLM)
    load_pending: bool = False
    saved_upto: int = 0         # chunks [0, saved_upto) are stored or queued for saving
    block_ids: list[int] = field(default_factory=list)
    # tail pieces (``tail_ns``'s chunk size): pieces ``tail_first, ...`` past the full chunks
    tail_ns: Namespace | None = None
    tail_first: int = 0
    tail_keys: list[ChunkKey] = field(default_factory=list)
    tail_present: list[bool] = field(default_factory=list)
    tail_saved_upto: int = 0


def _layer_index(name: str) -> int:
    m = re.findall(r"\.(\d+)\.", "." + name + ".")
    if not m:
        raise ValueError(f"cannot find a layer index in layer name {name!r}")
    return int(m[0])


# ------------------------------------------------------------------------------------------
# The connector.
# ------------------------------------------------------------------------------------------
class KVStoreConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a ``KVStoreBase`` (in-process tiers or a daemon).

    Constructed by vLLM once per role: ``(vllm_config, role, kv_cache_config)``. See the module
    docstring for the configuration keys.

    Raises:
        ValueError: a KV cache config this connector cannot serve (several KV cache groups, a
            non-attention group), or bad configuration values.
    """

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole",
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("KVStoreConnector supports exactly one KV cache group "
                             "(full attention models)")
        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        for attr in ("num_kv_heads", "head_size", "dtype", "block_size"):
            if not hasattr(spec, attr):
                raise ValueError(f"KV cache spec {type(spec).__name__} is not attention KV")
        self._layer_names = sorted(group.layer_names, key=_layer_index)
        self._block_size = int(spec.block_size)
        self._num_blocks = int(kv_cache_config.num_blocks)
        chunk_size = int(extra.get("chunk_size", 256))
        self.layout = KVLayout(len(self._layer_names), int(spec.num_kv_heads),
                               int(spec.head_size), spec.dtype, chunk_size)
        self._ns_base = vllm_namespace(vllm_config, self.layout, extra)
        if role == KVConnectorRole.SCHEDULER:
            log.info("kvstore namespace: %s", self._ns_base.describe())
        self._ns_cache: dict[tuple, Namespace] = {("", ""): self._ns_base}
        tail = extra.get("tail_chunk_size")
        if tail is None:
            bs = self._block_size
            tail = bs if bs < chunk_size and chunk_size % bs == 0 else 0
        tail = int(tail)
        if tail and (tail < 0 or tail >= chunk_size or chunk_size % tail):
            raise ValueError(f"tail_chunk_size {tail} must divide chunk_size {chunk_size} "
                             f"and be smaller (0 disables tail pieces)")
        self.tail_chunk_size = tail
        self._tail_ns_cache: dict[bytes, Namespace] = {}
        self.timeout_s = float(extra.get("timeout_s", 2.0))
        self.pin_lease_s = float(extra.get("pin_lease_s", 30.0))
        self._remote = bool(extra.get("kvstore_url"))
        self._store_spec, self.store = _acquire_store(extra)
        #: the daemon tenant's salt (``kvstore.daemon.tenants``): every namespace carries it
        self._tenant_salt = None
        if self._remote and extra.get("auth_token"):
            from connectors.factory import daemon_tenant_salt
            self._tenant_salt = daemon_tenant_salt(self.store, self.timeout_s)
            self._ns_base = dataclasses.replace(self._ns_base, cache_salt=bind_salt(
                self._tenant_salt, self._ns_base.cache_salt))
            self._ns_cache = {}
        self.counters: dict[str, float] = {
            "lookups": 0, "lookup_errors": 0, "hit_tokens": 0, "local_tokens": 0,
            "external_tokens": 0, "loads": 0, "loaded_chunks": 0, "loaded_tokens": 0,
            "load_errors": 0, "load_s": 0.0, "saved_chunks": 0, "save_errors": 0,
            "dropped_saves": 0, "save_copy_s": 0.0, "save_s": 0.0,
            "loaded_tail_chunks": 0, "saved_tail_chunks": 0}
        self._counters_lock = threading.Lock()
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._paged: PagedLayout | None = None
        self._layout_error: str | None = None
        self._failed_blocks: set[int] = set()
        self._save_q: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        if role == KVConnectorRole.WORKER:
            self._save_q = queue.Queue(maxsize=int(extra.get("save_queue", 8)))
            self._writer = threading.Thread(target=self._write_loop, name="kvstore-vllm-saver",
                                            daemon=True)
            self._writer.start()
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            log.warning("kv_load_failure_policy=%r: a failed store load fails the request; "
                        "set it to 'recompute' to fall back to prefill", policy)

    # ---- helpers --------------------------------------------------------------------------
    def _count(self, **kw: float) -> None:
        with self._counters_lock:
            for k, v in kw.items():
                self.counters[k] += v

    def stats(self) -> dict:
        """Counters of this side (JSON-able): lookups, hit/local/external tokens, loads,
        loaded chunks/tokens, load errors, seconds in loads, saved/dropped chunks, errors."""
        with self._counters_lock:
            out = dict(self.counters)
        out["role"] = self.role.name
        out["remote"] = self._remote
        if self._paged is not None:
            out["paged_layout"] = self._paged.describe()
        return out

    def _ns(self, request: Any) -> Namespace:
        """The request's namespace: the base one with its ``cache_salt`` and LoRA adapter."""
        salt = bind_salt(self._tenant_salt, getattr(request, "cache_salt", None) or "")
        lora = getattr(request, "lora_request", None)
        ck = (salt, adapter_identity(lora)) if lora is not None else (salt, "")
        ns = self._ns_cache.get(ck)
        if ns is None:
            ns = self._ns_cache[ck] = request_namespace(self._ns_base, salt, lora)
        return ns

    def _tail_ns(self, ns: Namespace) -> Namespace | None:
        """The namespace of tail pieces for ``ns`` (same model, layout but the tail chunk size,
        same salt), or None when tail pieces are off."""
        if not self.tail_chunk_size:
            return None
        t = self._tail_ns_cache.get(ns.ns_id)
        if t is None:
            lay = dataclasses.replace(ns.layout, chunk_size=self.tail_chunk_size)
            t = dataclasses.replace(ns, layout=lay)
            self._tail_ns_cache[ns.ns_id] = t
        return t

    def _call(self, fn, *args):
        if self._remote:
            return fn(*args, timeout_s=self.timeout_s)
        return fn(*args)

    # ==== scheduler side ===================================================================
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` (vLLM's own hit) that the store can
        supply: the leading stored chunks past the hit, capped at ``prompt_len - 1``. Any store
        error or deadline means 0 (prefill as usual)."""
        tokens = list(request.prompt_token_ids or [])
        C = self.layout.chunk_size
        n_chunks = len(tokens) // C
        self._count(local_tokens=num_computed_tokens)
        state = self._reqs.get(request.request_id)
        if state is None:
            ns = self._ns(request)
            keys = ns.chunk_keys(tokens[:n_chunks * C]) if n_chunks else []
            state = _ReqState(request, ns, keys, [False] * len(keys))
            tns = self._tail_ns(ns)
            if tns is not None:
                F = self.tail_chunk_size
                state.tail_ns, state.tail_first = tns, n_chunks * C // F
                n_f = len(tokens) // F
                if n_f > state.tail_first:
                    state.tail_keys = tns.chunk_keys(tokens[:n_f * F])[state.tail_first:]
                state.tail_present = [False] * len(state.tail_keys)
            self._reqs[request.request_id] = state
        state.num_local = num_computed_tokens
        state.num_external = 0
        max_end = len(tokens) - 1
        nc = num_computed_tokens
        first = nc // C
        has_full = first < n_chunks and first * C < max_end
        if nc >= max_end or not (has_full or state.tail_keys):
            return 0, False
        t0 = time.perf_counter()
        n_hit, end = 0, nc
        if has_full:
            try:
                state.present = list(self._call(self.store.exists, state.ns, state.keys))
            except Exception as e:  # store down or late: a miss
                self._count(lookups=1, lookup_errors=1)
                log.warning("kvstore lookup failed (%s); prefilling", e)
                state.present = [False] * len(state.keys)
                return 0, False
            while first + n_hit < n_chunks and state.present[first + n_hit]:
                n_hit += 1
            end = (first + n_hit) * C
        # tail pieces past the last full chunk, when every full chunk past vLLM's hit is here
        F = self.tail_chunk_size
        r0 = max(0, nc // F - state.tail_first) if F else 0
        t_hit = 0
        if (F and (not has_full or first + n_hit == n_chunks) and r0 < len(state.tail_keys)
                and (state.tail_first + r0) * F < max_end):
            try:
                got = list(self._call(self.store.exists, state.tail_ns, state.tail_keys[r0:]))
                state.tail_present[r0:] = got
            except Exception as e:  # the full chunks still count
                log.warning("kvstore tail lookup failed (%s)", e)
                self._count(lookup_errors=1)
                got = []
            while t_hit < len(got) and got[t_hit]:
                t_hit += 1
            if t_hit:
                end = (state.tail_first + r0 + t_hit) * F
        hit_end = min(end, max_end)
        ext = max(0, hit_end - nc)
        self._count(lookups=1, hit_tokens=ext)
        if ext and self.pin_lease_s > 0:
            try:
                if n_hit:
                    self._call(self.store.pin, state.ns, state.keys[first:first + n_hit],
                               self.pin_lease_s)
                if t_hit:
                    self._call(self.store.pin, state.tail_ns,
                               state.tail_keys[r0:r0 + t_hit], self.pin_lease_s)
            except Exception as e:
                log.warning("kvstore pin failed (%s); prefilling", e)
                self._count(lookup_errors=1)
                return 0, False
        log.debug("lookup %s: %.2f ms, %d local + %d external tokens", request.request_id,
                  (time.perf_counter() - t0) * 1e3, nc, ext)
        return ext, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Record that ``num_external_tokens`` tokens are to be loaded for ``request``."""
        state = self._reqs.get(request.request_id)
        if state is None:
            return
        state.num_external = num_external_tokens
        state.load_pending = num_external_tokens > 0
        if num_external_tokens:
            self._count(external_tokens=num_external_tokens)

    def _block_ids(self, req_id: str, fallback: list[int] | None) -> list[int]:
        mgr = self._kv_cache_manager
        if mgr is not None:
            try:
                return list(mgr.get_block_ids(req_id)[0])
            except Exception:
                pass
        return list(fallback or [])

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
        """This step's loads (requests admitted with external tokens) and saves (chunks whose
        tokens are all computed once this step's forward pass is done)."""
        meta = KVStoreConnectorMetadata()
        C = self.layout.chunk_size
        steps: list[tuple[str, int, list[int] | None]] = []
        for nr in scheduler_output.scheduled_new_reqs:
            steps.append((nr.req_id, nr.num_computed_tokens, nr.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            steps.append((req_id, cached.num_computed_tokens[i], nb[0] if nb else None))
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for req_id, num_computed, new_blocks in steps:
            state = self._reqs.get(req_id)
            if state is None:
                continue
            if new_blocks is not None:
                if req_id in resumed or not state.block_ids:
                    state.block_ids = list(new_blocks)   # a new or resumed request: full table
                else:
                    state.block_ids = state.block_ids + list(new_blocks)
            block_ids = self._block_ids(req_id, state.block_ids)
            if state.load_pending:
                state.load_pending = False
                start = state.num_local
                end = start + state.num_external
                full_end = len(state.keys) * C     # full chunks, then tail pieces
                if start < full_end:
                    e = min(end, full_end)
                    first, last = start // C, (e - 1) // C
                    meta.loads.append(ChunkTransfer(req_id, state.ns, first,
                                                    state.keys[first:last + 1], start, e,
                                                    block_ids))
                    for j in range(first, last + 1):
                        state.present[j] = True
                if end > full_end and state.tail_ns is not None:
                    F, tf = self.tail_chunk_size, state.tail_first
                    s0 = max(start, full_end)
                    first, last = s0 // F, (end - 1) // F
                    meta.loads.append(ChunkTransfer(req_id, state.tail_ns, first,
                                                    state.tail_keys[first - tf:last + 1 - tf],
                                                    s0, end, block_ids))
                    for j in range(first, last + 1):
                        state.tail_present[j - tf] = True
            done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            n_full = min(done // C, len(state.keys))
            todo = [j for j in range(state.saved_upto, n_full) if not state.present[j]]
            state.saved_upto = max(state.saved_upto, n_full)
            meta.saves += self._save_runs(req_id, state.ns, state.keys, 0, todo, block_ids)
            if state.tail_keys:
                F, tf = self.tail_chunk_size, state.tail_first
                n_t = min(done // F, tf + len(state.tail_keys))
                todo = [j for j in range(max(state.tail_saved_upto, tf), n_t)
                        if not state.tail_present[j - tf]]
                state.tail_saved_upto = max(state.tail_saved_upto, n_t)
                meta.saves += self._save_runs(req_id, state.tail_ns, state.tail_keys, tf, todo,
                                              block_ids)
        return meta

    @staticmethod
    def _save_runs(req_id: str, ns: Namespace, keys: list[ChunkKey], key0: int, todo: list[int],
                   block_ids: list[int]) -> list[ChunkTransfer]:
        """One save transfer per run of consecutive chunk indices in ``todo`` (``keys[0]`` is
        chunk ``key0`` of ``ns``'s chunk size)."""
        C = ns.layout.chunk_size
        out, run = [], []
        for j in todo + [None]:
            if run and (j is None or j != run[-1] + 1):
                parent = keys[run[0] - 1 - key0] if run[0] > key0 else None
                out.append(ChunkTransfer(req_id, ns, run[0], [keys[k - key0] for k in run],
                                         run[0] * C, (run[-1] + 1) * C, block_ids, parent))
                run = []
            if j is not None:
                run.append(j)
        return out

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves were copied out synchronously, so blocks may be freed."""
        self._reqs.pop(request.request_id, None)
        return False, None

    # ==== worker side ======================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer paged caches (layer order = model layer index).

        Raises:
            ValueError: the caches do not match the KV cache config's layers.
        """
        names = sorted(kv_caches, key=_layer_index)
        if names != self._layer_names:
            raise ValueError(f"registered KV caches {names[:3]}... differ from the KV cache "
                             f"group's layers {self._layer_names[:3]}...")
        self._kv_caches = {n: kv_caches[n] for n in names}

    def _ensure_layout(self) -> PagedLayout | None:
        if self._paged is not None or self._layout_error is not None:
            return self._paged
        try:
            if not self._kv_caches:
                raise ValueError("no KV caches registered")
            ctx = self._vllm_config.compilation_config.static_forward_context
            name = self._layer_names[0]
            layer = ctx[name]
            cache0 = self._kv_caches[name]
            paged = derive_paged_layout(layer.impl, layer, cache0, self._num_blocks,
                                        self._block_size, self.layout.num_kv_heads,
                                        self.layout.head_dim)
            for n, c in self._kv_caches.items():
                if (tuple(c.shape) != paged.shape or tuple(c.stride()) != paged.stride
                        or c.dtype != self.layout.torch_dtype):
                    raise ValueError(f"layer {n} cache {list(c.shape)} {c.dtype} differs "
                                     f"from layer {name}'s")
            self._paged = paged
            log.info("kvstore connector: derived paged layout: %s", paged.describe())
        except Exception as e:
            self._layout_error = str(e)
            log.error("kvstore connector disabled: %s", e)
        return self._paged

    def _slots(self, t: ChunkTransfer, lo: int, hi: int) -> torch.Tensor:
        tok = torch.arange(lo, hi, dtype=torch.int64)
        bs = self._block_size
        blocks = torch.tensor(t.block_ids, dtype=torch.int64)
        if hi > len(t.block_ids) * bs:
            raise ValueError(f"request {t.request_id}: tokens up to {hi} need "
                             f"{-(-hi // bs)} blocks, block table has {len(t.block_ids)}")
        return blocks[torch.div(tok, bs, rounding_mode="floor")] * bs + tok % bs

    def _fail(self, t: ChunkTransfer, from_token: int) -> None:
        bs = self._block_size
        first, last = from_token // bs, (t.end - 1) // bs
        self._failed_blocks.update(t.block_ids[first:last + 1])
        self._count(load_errors=1)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Load this step's chunks into the paged cache (synchronously, before the forward
        pass). A missing chunk, a store error or a deadline marks the blocks of the remaining
        tokens as failed, for vLLM to recompute."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads:
            return
        paged = self._ensure_layout()
        caches = list(self._kv_caches.values())
        for t in meta.loads:
            t0 = time.perf_counter()
            C = t.ns.layout.chunk_size
            tail = t.ns.layout != self.layout
            if paged is None:
                self._fail(t, t.start)
                continue
            try:
                chunks = self._call(self.store.get_chunks, t.ns, t.keys)
            except Exception as e:
                log.warning("kvstore load of %s failed (%s); recomputing", t.request_id, e)
                self._fail(t, t.start)
                continue
            n_tok = 0
            for i, kv in enumerate(chunks):
                c0 = (t.first_chunk + i) * C
                lo, hi = max(t.start, c0), min(t.end, c0 + C)
                if kv is None:
                    self._fail(t, lo)
                    break
                try:
                    t.ns.layout.validate(kv)
                    plan = paged.plan(self._slots(t, lo, hi))
                    part = kv[:, :, lo - c0:hi - c0]
                    for layer, cache in enumerate(caches):
                        paged.scatter(cache, plan, part[layer])
                except Exception as e:
                    log.warning("kvstore chunk of %s unusable (%s); recomputing", t.request_id, e)
                    self._fail(t, lo)
                    break
                n_tok += hi - lo
                self._count(**{"loaded_tail_chunks" if tail else "loaded_chunks": 1})
            self._count(loads=1, loaded_tokens=n_tok, load_s=time.perf_counter() - t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv``; nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves are copied out for all layers at once in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Copy this step's finished chunks out of the paged cache (the only part that blocks
        the step) and queue them for the background writer; when the queue is full the save
        is dropped and counted."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves:
            return
        paged = self._ensure_layout()
        if paged is None:
            return
        caches = list(self._kv_caches.values())
        for t in meta.saves:
            t0 = time.perf_counter()
            lay = t.ns.layout
            C = lay.chunk_size
            try:
                kvs = []
                for i in range(len(t.keys)):
                    plan = paged.plan(self._slots(t, t.start + i * C, t.start + (i + 1) * C))
                    kv = torch.empty(lay.shape(), dtype=lay.torch_dtype)
                    for layer, c in enumerate(caches):
                        paged.gather(c, plan, out=kv[layer])
                    kvs.append(kv)
            except Exception as e:
                log.warning("kvstore save of %s failed (%s)", t.request_id, e)
                self._count(save_errors=1)
                continue
            self._count(save_copy_s=time.perf_counter() - t0)
            try:
                self._save_q.put_nowait((t.ns, t.keys, kvs, t.parent))
            except queue.Full:
                self._count(dropped_saves=len(t.keys))

    def _write_loop(self) -> None:
        while True:
            item = self._save_q.get()
            try:
                if item is None:
                    return
                ns, keys, kvs, parent = item
                t0 = time.perf_counter()
                try:
                    if parent is None:
                        self._call(self.store.put_chunks, ns, keys, kvs)
                    else:
                        self._call(self.store.put_chunks, ns, keys, kvs,
                                   chain_parents(keys, parent))
                    which = "saved_tail_chunks" if ns.layout != self.layout else "saved_chunks"
                    self._count(**{which: len(keys), "save_s": time.perf_counter() - t0})
                except Exception as e:
                    log.warning("kvstore put failed (%s)", e)
                    self._count(save_errors=1)
            finally:
                self._save_q.task_done()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued saves are written. Returns False on timeout."""
        if self._save_q is None:
            return True
        deadline = time.monotonic() + timeout_s
        while self._save_q.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def shutdown(self) -> None:
        """Write queued saves (bounded wait), stop the writer, release the store."""
        if self._writer is not None and self._writer.is_alive():
            self.flush(30.0)
            self._save_q.put(None)
            self._writer.join(5.0)
        if self._store_spec is not None:
            _release_store(self._store_spec)
            self._store_spec = None

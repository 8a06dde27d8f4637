"""``EngineMinConnector``: engine_min's paged KV pool <-> any ``KVStoreBase`` (in-process
``ChunkStore``, the daemon's ``KVStoreClient``, or ``LayeredStore`` = local tiers in front of the
daemon). Contract and call order: ``connectors.base``.

A thin adapter: what to look up, load and save, and the keys, comes from the engine-agnostic
core (``connectors.chunk_plan.RequestChunks``, one per request); this module translates
engine_min's sequences and steps into it, runs the store calls on worker threads within
deadlines, and moves KV. One module per job: lookups ``connectors.engine_min_lookup``
(``PrefixLookup``), loads ``connectors.engine_min_load`` (``Loader``), saves
``connectors.engine_min_save`` (``Saver``, over ``connectors.save_queue.SaveQueue``), counters
``connectors.engine_min_stats``.

Per request (``C`` = chunk size; keys are ``Namespace.chunk_keys`` of the request's tokens)::

    admission   lookup_keys(keys of the full chunks past the engine's own hit) -> H tokens;
                E = min(H, N - 1) - local                      (get_num_new_matched_tokens)
    same step   get_chunks(chunks covering [local, local + E)) within the deadline, then one
                scatter_chunk per chunk into the request's blocks   (start_load_kv/wait_for_load)
    each step   full prompt chunks whose KV is now computed: one gather_chunk per chunk, queued
                for the background writer                                        (save)
    at the end  full chunks of prompt + generated tokens not saved yet           (request_finished)

Tail pieces (``tail_chunk_size=F``; default: the engine's block size when it divides ``C``
and is smaller, set at ``register_kv_caches``; 0 = off): the tokens past the last full chunk are
also stored as whole pieces of ``F`` tokens (a multiple of the block size dividing ``C``) in a
namespace of their own, the same layout with chunk size ``F`` (the scheme ``connectors.vllm``
uses, so both engines share pieces), so a whole prompt is reused, not only its full chunks. A
piece's key is the chained prefix hash of *every* token before its end in ``F``-token units,
so it only matches the identical prefix. Pieces are saved when a prompt's prefill completes
(``[floor_C(P), floor_F(P))`` for a prompt of ``P`` tokens) and at request end (the same over
prompt + generated tokens), each piece once per request: fewer than ``2 * C / F`` pieces in all
(under one chunk of the prompt and one of the whole request), and none inside a chunk saved
before it. Pieces take tier bytes like chunks (they are chunks of the tail namespace: evicted,
spilled and counted alike). When a request's answer later fills the chunk of pieces it saved,
the chunk's save (its background write, after the put; ``connectors.engine_min_save``) demotes
those pieces (``KVStoreBase.demote``): they become the first eviction candidates of every tier,
so they never take room something else needs, yet they still serve any prompt sharing the
prefix up to a piece but not the whole chunk (the next question about the same document) while
there is room; a demoted piece that is read again is no longer demoted. A lookup asks for
pieces from where the leading stored full chunks end, up to the end of that chunk (no piece
lies past a prompt's first missing chunk), so a hit recomputes fewer than ``F`` tokens of a
stored prefix instead of up to ``C - 1``::

    tokens  |      chunk 0 (C)      |      chunk 1 (C)      | F | F | F |..       (P tokens)
    keys    ns (chunk C)            ns                     tail ns (chunk F), chained from 0

Loads: each step's chunks (and pieces) are read on a worker thread and scattered into the
request's blocks there, one chunk at a time; from an in-process ``ChunkStore`` the scatter
copies straight out of the CPU tier's pages, borrowed under reader pins
(``ChunkStore.borrow_chunks``: one copy, no intermediate tensor). A deadline that passes stops
the worker before its next scatter (a lock orders the two), and what landed so far counts.
With ``layerwise_load`` (default: on CUDA only) the worker reads a step's pieces first and then
writes them layer after layer while the forward pass runs (``connectors.engine_min_layers``):
``wait_for_layer_load(i)`` holds layer ``i``'s attention until its layer is written, the pages
stay borrowed until the last layer is, and a load stopped part-way (an error, the deadline)
lands nothing of what it read: the model runner computes those tokens again.

Robustness: every lookup and every step's loads run on worker threads and are waited for at
most ``deadline_s`` (+ ``deadline_s_per_chunk`` per chunk loaded); a late, failed or partial
load counts a fallback, logs once per kind, and leaves ``seq.num_computed_tokens`` at the end of
what landed, so the engine prefills the rest. Saves go through a bounded queue
(``save_queue_bytes``); when it is full the save is dropped and counted, never waited for.

Counters (``get_stats``), cumulative: ``external_prefix_cache_queries`` (tokens of requests
looked up, once per request), ``external_prefix_cache_hits`` (tokens loaded, once per request;
``kvstore_hit_tokens_by_tier`` splits them by the tier they came from: ``"cpu"``, ``"disk"``,
``"remote:cpu"``... for chunks held by the daemon's tiers; each name the store can give at 0
from the start, ``connectors.engine_min_lookup.hit_tier_names``), loaded/saved bytes and
chunks (tail pieces apart: ``kvstore_loaded_tail_chunks``, ``kvstore_saved_tail_chunks``; their
bytes are in the byte counters; ``kvstore_demoted_tail_chunks``, ``kvstore_demote_errors``),
load/save/lookup latency (count, sum, max in seconds), fallbacks, dropped saves; with a
daemon behind ``CircuitBreakerStore``: ``kvstore_remote_skipped_calls`` (calls not sent while a
failed daemon cools down), ``kvstore_remote_breaker_trips``, ``kvstore_remote_breaker_open``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from connectors.base import KVConnectorBase, LoadResult
from connectors.chunk_geometry import ChunkGeometry
from connectors.chunk_plan import RequestChunks
from connectors.chunk_records import LoadPlan
from connectors.engine_min_load import Loader
from connectors.engine_min_lookup import PrefixLookup, hit_tier_names
from connectors.engine_min_save import Saver
from connectors.engine_min_stats import ConnectorStats
from kvstore.api import KVStoreBase
from kvstore.keys import IDENTITY_FIELDS, Namespace, rope_identity
from kvstore.kv_codec import LOSSY_CODECS
from kvstore.layered import remote_breaker
from kvstore.layout import DEFAULT_CHUNK_SIZE, KVLayout

log = logging.getLogger("connectors.engine_min")

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def default_tail_size(block_size: int, chunk_size: int) -> int:
    """Tail piece size (tokens) used when none is given: ``block_size`` when it divides
    ``chunk_size`` and is smaller, else 0 (off)."""
    ok = 0 < block_size < chunk_size and chunk_size % block_size == 0
    return block_size if ok else 0


def auto_layerwise(layerwise_load: bool | None, device: torch.device) -> bool:
    """Whether loads into a pool on ``device`` run layer by layer: ``layerwise_load`` when
    given, else (auto) on CUDA only: there the copies run on the copy engine beside the
    kernels, while on the CPU they take the cores the forward pass computes on (README:
    the figures)."""
    return device.type == "cuda" if layerwise_load is None else layerwise_load


@dataclass
class _Request:
    """Connector-side state of one request (kept across preemptions, dropped when it ends)."""

    chunks: RequestChunks          # key chains, last lookup, saved marks (the core)
    counted: bool = False          # queried tokens counted (first admission)
    count_hits: bool = False       # the pending load is of the first admission
    pending: tuple[LoadPlan, list[int]] | None = None   # (plan, block ids) to start


class EngineMinConnector(KVConnectorBase):
    """KV connector for engine_min over one ``KVStoreBase``.

    Args:
        store: the store (``ChunkStore``, ``KVStoreClient`` or ``LayeredStore``); closed by
            ``close()`` when ``owns_store``.
        chunk_size: tokens per store chunk; a multiple of the engine's block size (checked at
            ``register_kv_caches``).
        model_id: model identity in the chunk-key namespace; None (default) = the engine's
            (``register_model``), else ``DEFAULT_MODEL_ID``.
        revision: weights revision in the namespace; None (default) = the engine's, else "".
        cache_salt: tenant salt (different salts never share chunks).
        hash_algo: chunk-key hash (``kvstore.keys.HASH_ALGOS``).
        deadline_s: longest wait for one lookup, and base wait for one step's loads (seconds).
        deadline_s_per_chunk: extra load wait per chunk loaded in the step (seconds).
        save_queue_bytes: bytes of gathered chunks waiting for the writer; a save that would
            exceed it is dropped (counted) unless the queue is empty.
        save_generated: at request end also save the full chunks of generated tokens (so the
            next chat round reuses this round's answer).
        owns_store: ``close()`` closes the store too.
        tail_chunk_size: tokens per tail piece (module docstring); None (default) = the
            engine's block size when it divides ``chunk_size`` and is smaller, else 0 (resolved
            at ``register_kv_caches``, which sets this attribute to the int used); 0 stores
            only full chunks. Must divide ``chunk_size``, be smaller, and be a multiple of the
            engine's block size (checked at ``register_kv_caches``).
        lossy_codec: the lossy codec (``"int8"``, ``"fp8"``) this engine accepts its chunks to
            be stored with by a disk or remote tier configured for it (``kvstore.kv_codec``):
            goes into the namespace (``Namespace.lossy_codec``); ``""`` (default) = bit-exact.
        layerwise_load: loads run layer by layer beside the forward pass
            (``connectors.engine_min_layers``; layer ``i``'s attention waits only for layer
            ``i``); False: whole loads before it; None (default, "auto"): layer by layer when
            the pool is on CUDA, whole on the CPU (resolved at ``register_kv_caches``, which
            sets ``layerwise_load`` to the bool used).
        saves: False: nothing is saved (no gather, no put; a daemon token that may only
            read), lookups and loads as usual.

    Raises:
        ValueError: a non-positive chunk size or deadline, or a tail chunk size that is
            negative, not smaller than ``chunk_size`` or does not divide it, or an unknown
            lossy codec.
    """

    def __init__(self, store: KVStoreBase, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 model_id: str | None = None, revision: str | None = None,
                 cache_salt: str = "",
                 hash_algo: str = "sha256", deadline_s: float = 0.5,
                 deadline_s_per_chunk: float = 0.05, save_queue_bytes: int = 512 << 20,
                 save_generated: bool = True, owns_store: bool = True,
                 tail_chunk_size: int | None = None, lossy_codec: str = "",
                 layerwise_load: bool | None = None, saves: bool = True):
        if lossy_codec and lossy_codec not in LOSSY_CODECS:
            raise ValueError(f"unknown lossy_codec {lossy_codec!r}; choose one of {LOSSY_CODECS}")
        self.lossy_codec = lossy_codec
        if layerwise_load not in (None, True, False):
            raise ValueError(f"layerwise_load must be True, False or None (auto), got "
                             f"{layerwise_load!r}")
        self._layerwise_arg = layerwise_load
        self.layerwise_load = bool(layerwise_load)   # resolved when bound
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if tail_chunk_size is not None and (
                not isinstance(tail_chunk_size, int) or isinstance(tail_chunk_size, bool) or
                tail_chunk_size < 0 or (tail_chunk_size and (
                    tail_chunk_size >= chunk_size or chunk_size % tail_chunk_size))):
            raise ValueError(f"tail_chunk_size must be 0 (off) or divide chunk_size="
                             f"{chunk_size} and be smaller, got {tail_chunk_size!r}")
        if not deadline_s > 0 or deadline_s_per_chunk < 0:
            raise ValueError(f"deadline_s must be > 0 and deadline_s_per_chunk >= 0, got "
                             f"{deadline_s}, {deadline_s_per_chunk}")
        self.store = store
        self.chunk_size = chunk_size
        self.model_id, self.revision, self.cache_salt = model_id, revision, cache_salt
        self.hash_algo = hash_algo
        self.deadline_s, self.deadline_s_per_chunk = deadline_s, deadline_s_per_chunk
        self.save_queue_bytes = save_queue_bytes
        self.save_generated = save_generated
        self.owns_store = owns_store
        self.tail_chunk_size = tail_chunk_size   # resolved when bound
        self._tail_arg = tail_chunk_size
        self.tail_ns: Namespace | None = None
        self.model_identity: dict[str, str] = {}
        self.ns: Namespace | None = None
        self.geometry: ChunkGeometry | None = None
        self.kv_cache: torch.Tensor | None = None
        self._reqs: dict[str, _Request] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvconn-io")
        self.stats = ConnectorStats(hit_tier_names(store))
        self.c = self.stats.c          # counters by name (``get_stats`` reports them)
        self._lookups = PrefixLookup(store, self._pool, self.stats, deadline_s)
        self._loader = Loader(store, self._pool, self.stats, deadline_s, deadline_s_per_chunk)
        self._saver = Saver(store, self.stats, save_queue_bytes, enabled=saves)
        self._closed = False

    # ---- helpers ------------------------------------------------------------------------------
    def _state(self, seq: Any) -> _Request:
        st = self._reqs.get(seq.request_id)
        if st is None:
            st = self._reqs[seq.request_id] = _Request(
                RequestChunks(self.geometry, self.ns, self.tail_ns))
        return st

    def _require_bound(self) -> None:
        if self.ns is None:
            raise RuntimeError("EngineMinConnector: register_kv_caches() was not called "
                               "(pass the connector to LLMEngine)")

    # ---- worker side: binding -----------------------------------------------------------------
    def register_model(self, identity: dict[str, str]) -> None:
        """What the engine loaded that changes the KV of the same token ids (its
        ``kv_identity``: ``model_id``, ``revision``, ``weights_fingerprint``, ``compute_dtype``,
        ``rope``, ``quantization``, ``kv_quantization``, ``adapter``; strings): goes into the
        namespace that ``register_kv_caches`` builds. Called by the engine before it."""
        self.model_identity = dict(identity)

    def _namespace(self, layout: KVLayout) -> Namespace:
        ident = self.model_identity
        model_id = self.model_id or ident.get("model_id") or DEFAULT_MODEL_ID
        revision = self.revision if self.revision is not None else ident.get("revision", "")
        fields = {f: str(ident.get(f) or "") for f in IDENTITY_FIELDS}
        if fields["rope"]:      # one form for every engine (vLLM's connector writes it too)
            rope = json.loads(fields["rope"])
            fields["rope"] = rope_identity(rope["theta"], rope.get("scaling"))
        fields["lossy_codec"] = self.lossy_codec
        return Namespace(model_id, layout, revision, self.cache_salt, self.hash_algo, **fields)

    def geometry_for(self, block_size: int) -> ChunkGeometry:
        """This connector's chunk and tail sizes for an engine of ``block_size``-token blocks
        (tail pieces of one block unless a size was given), checked: a command line can refuse
        sizes that do not fit before it loads a model.

        Raises:
            ValueError: a chunk size that is not a multiple of ``block_size``, or a tail size
                that does not divide the chunk or is not a multiple of the block.
        """
        tail = self._tail_arg if self._tail_arg is not None else \
            default_tail_size(block_size, self.chunk_size)     # default: pieces of one block
        return ChunkGeometry(block_size, self.chunk_size, tail)

    def register_kv_caches(self, kv_cache: torch.Tensor, block_size: int) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or kv_cache.shape[3] != block_size:
            raise ValueError(f"kv_cache must be [num_layers, 2, num_blocks, block_size="
                             f"{block_size}, num_kv_heads, head_dim], got {list(kv_cache.shape)}")
        self.geometry = self.geometry_for(block_size)
        self.tail_chunk_size = self.geometry.tail_size
        layout = KVLayout(num_layers=int(kv_cache.shape[0]), num_kv_heads=int(kv_cache.shape[4]),
                          head_dim=int(kv_cache.shape[5]), dtype=kv_cache.dtype,
                          chunk_size=self.chunk_size)
        self.ns = self._namespace(layout)
        log.info("kvstore namespace: %s", self.ns.describe())
        if not self.model_identity.get("weights_fingerprint") and self.revision is None:
            log.warning("kvstore namespace has no weights fingerprint (the engine gave none): "
                        "engines share its chunks by model id %r alone", self.ns.model_id)
        self.tail_ns = None
        if self.tail_chunk_size:   # connectors.vllm's tail namespace: chunk size F, rest equal
            self.tail_ns = dataclasses.replace(self.ns, layout=dataclasses.replace(
                layout, chunk_size=self.tail_chunk_size))
        self.kv_cache = kv_cache
        self._lookups.bind(self.ns, self.tail_ns)
        self.layerwise_load = auto_layerwise(self._layerwise_arg, kv_cache.device)
        self._loader.bind(kv_cache, block_size, self.layerwise_load)
        self._saver.bind(kv_cache, self.geometry, self.tail_ns)
        self._saver.check_chunk_limit(self.ns, self.tail_ns)   # one warning when too large
        self.store.register(self.ns)  # a tier smaller than one chunk fails here, not mid-run
        if self.tail_ns is not None:
            self.store.register(self.tail_ns)

    @property
    def layout(self) -> KVLayout:
        self._require_bound()
        return self.ns.layout

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._require_bound()
        chunks = self._state(seq).chunks
        n = seq.num_tokens
        hit = chunks.cached_hit(n, num_computed_tokens)
        if hit is None:
            query = chunks.lookup_query(seq.token_ids, n, num_computed_tokens)
            if query is None:
                return 0, False
            hit = self._lookups.run(query)
        return chunks.record(hit), False

    def update_state_after_alloc(self, seq: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self._require_bound()
        st = self._state(seq)
        first_admission = not st.counted
        if first_admission:
            st.counted = True
            self.stats.add(requests=1, queried_tokens=seq.num_tokens)
        local = seq.num_computed_tokens - num_external_tokens
        plan = st.chunks.admit(seq.token_ids, seq.num_tokens, local, num_external_tokens)
        st.pending = None if plan is None else (plan, list(block_ids))
        if plan is not None:
            st.count_hits = first_admission

    def request_finished(self, seq: Any, block_ids: list[int]) -> None:
        st = self._reqs.pop(seq.request_id, None)
        if st is None or self.ns is None or not block_ids:
            return
        end = seq.num_computed_tokens if self.save_generated else \
            min(seq.num_computed_tokens, seq.num_prompt_tokens)
        end = min(end, len(block_ids) * self.geometry.block_size)
        self._saver.queue(st.chunks.chunks_to_save(seq.token_ids, end), block_ids)
        self._saver.queue(st.chunks.pieces_to_save(seq.token_ids, end), block_ids)

    # ---- worker side: loads -------------------------------------------------------------------
    def start_load_kv(self, sched_out: Any, kv_cache: torch.Tensor) -> None:
        for item in sched_out.scheduled:
            st = self._reqs.get(item.seq.request_id)
            if st is None or st.pending is None:
                continue
            (plan, block_ids), st.pending = st.pending, None
            self._loader.start(item, plan, st.chunks, block_ids, st.count_hits)
            st.count_hits = False

    def wait_for_load(self) -> list[LoadResult]:
        return self._loader.wait()

    def wait_for_layer_load(self, layer: int) -> None:
        self._loader.wait_layer(layer)

    # ---- worker side: saves -------------------------------------------------------------------
    def save(self, sched_out: Any, kv_cache: torch.Tensor) -> None:
        for item in sched_out.scheduled:
            seq = item.seq
            st = self._reqs.get(seq.request_id)
            if st is None:
                continue
            end = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens)
            self._saver.queue(st.chunks.chunks_to_save(seq.token_ids, end), seq.block_table)
            if end == seq.num_prompt_tokens:   # the prompt's prefill is complete
                self._saver.queue(st.chunks.pieces_to_save(seq.token_ids, end), seq.block_table)

    def wait_for_save(self, timeout_s: float | None = None) -> bool:
        return self._saver.wait(timeout_s)

    # ---- metrics and lifetime -----------------------------------------------------------------
    def get_stats(self) -> dict:
        snap = self.stats.snapshot()
        out = {k: snap.pop(k) for k in ("external_prefix_cache_queries",
                                        "external_prefix_cache_hits",
                                        "kvstore_hit_tokens_by_tier")}
        out.update({"kvstore_save_queue_bytes": self._saver.queued_bytes,
                    "store_namespace": None if self.ns is None else self.ns.to_dict()})
        out.update(snap)
        breaker = remote_breaker(self.store)
        if breaker is not None:  # a dead daemon: calls skipped during its cool-downs
            out.update({f"kvstore_{k}": v for k, v in breaker.breaker_stats().items()})
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._saver.close(30.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.owns_store:
            self.store.close()


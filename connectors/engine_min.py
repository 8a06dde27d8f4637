"""``EngineMinConnector``: engine_min's paged KV pool <-> any ``KVStoreBase`` (in-process
``ChunkStore``, the daemon's ``KVStoreClient``, or ``LayeredStore`` = local tiers in front of the
daemon). Contract and call order: ``connectors.base``.

Per request (``C`` = chunk size; keys are ``Namespace.chunk_keys`` of the request's tokens)::

    admission   lookup_keys(keys of the full chunks past the engine's own hit) -> H tokens;
                E = min(H, N - 1) - local                      (get_num_new_matched_tokens)
    same step   get_chunks(chunks covering [local, local + E)) within the deadline, then one
                scatter_chunk per chunk into the request's blocks   (start_load_kv/wait_for_load)
    each step   full prompt chunks whose KV is now computed: one gather_chunk per chunk, queued
                for the background writer                                        (save)
    at the end  full chunks of prompt + generated tokens not saved yet           (request_finished)

Tail pieces (``tail_chunk_size=F``, default 0 = off, as issue 5's "partial trailing chunks are not
stored by default"): the tokens past the last full chunk are also stored as whole pieces of ``F``
tokens (a multiple of the block size dividing ``C``) in a namespace of their own, the same layout
with chunk size ``F`` (the scheme ``connectors.vllm`` uses, so both engines share pieces). A
piece's key is the chained prefix hash of *every* token before its end in ``F``-token units,
so it only matches the identical prefix. Pieces are saved when a prompt's prefill completes
(``[floor_C(P), floor_F(P))`` for a prompt of ``P`` tokens) and at request end (the same over
prompt + generated tokens). A lookup asks for pieces from where the leading stored full chunks
end, up to the end of that chunk (no piece lies past a prompt's first missing chunk), so a hit
recomputes fewer than ``F`` tokens of a stored prefix instead of up to ``C - 1``::

    tokens  |      chunk 0 (C)      |      chunk 1 (C)      | F | F | F |..       (P tokens)
    keys    ns (chunk C)            ns                     tail ns (chunk F), chained from 0

Loads: each step's chunks (and pieces) are read on a worker thread and scattered into the
request's blocks there, one chunk at a time; from an in-process ``ChunkStore`` the scatter
copies straight out of the CPU tier's pages, borrowed under reader pins
(``ChunkStore.borrow_chunks``: one copy, no intermediate tensor). A deadline that passes stops
the worker before its next scatter (a lock orders the two), and what landed so far counts.

Robustness: every lookup and every step's loads run on worker threads and are waited for at
most ``deadline_s`` (+ ``deadline_s_per_chunk`` per chunk loaded); a late, failed or partial
load counts a fallback, logs once per kind, and leaves ``seq.num_computed_tokens`` at the end of
what landed, so the engine prefills the rest. Saves go through a bounded queue
(``connectors.save_queue.SaveQueue``, ``save_queue_bytes``); when it is full the save is
dropped and counted, never waited for.

Counters (``get_stats``), cumulative: ``external_prefix_cache_queries`` (tokens of requests
looked up, once per request), ``external_prefix_cache_hits`` (tokens loaded, once per request;
``kvstore_hit_tokens_by_tier`` splits them by the tier they came from: ``"cpu"``, ``"disk"``,
``"remote:cpu"``... for chunks held by the daemon's tiers), loaded/saved bytes and
chunks (tail pieces apart: ``kvstore_loaded_tail_chunks``, ``kvstore_saved_tail_chunks``; their
bytes are in the byte counters), load/save/lookup latency (count, sum, max in seconds), fallbacks, dropped saves; with a
daemon behind ``CircuitBreakerStore``: ``kvstore_remote_skipped_calls`` (calls not sent while a
failed daemon cools down), ``kvstore_remote_breaker_trips``, ``kvstore_remote_breaker_open``.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.base import KVConnectorBase
from connectors.block_chunk_map import BlockChunkMap
from kvstore.layered import remote_breaker
from connectors.engine_min_load import LoadWorker, _borrower, _Piece
from connectors.save_queue import SaveQueue
from kernels import ops
from kvstore.api import KVStoreBase, chain_parents
from kvstore.keys import IDENTITY_FIELDS, ChunkKey, Namespace, chain_hashes
from kvstore.layout import KVLayout

log = logging.getLogger("connectors.engine_min")

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class _Request:
    """Connector-side state of one request (kept across preemptions, dropped when it ends)."""

    keys: list[ChunkKey] = field(default_factory=list)   # keys of the first len(keys) chunks
    tail_keys: list[ChunkKey] = field(default_factory=list)  # tail-ns keys of pieces 0..
    lookup: tuple | None = None     # (num_tokens, num_local, hit, {piece start: tier}, full_end)
    saved: int = 0                  # tokens whose chunks are saved or known stored
    tail_saved: int = 0             # tokens whose tail pieces are saved or known stored
    counted: bool = False           # queried tokens counted (first admission)
    count_hits: bool = False        # the pending load is of the first admission
    pending: tuple | None = None    # (LoadPlan, [_Piece], block_ids)


class _Latency:
    """count / sum / max of durations in seconds."""

    def __init__(self) -> None:
        self.count, self.sum, self.max = 0, 0.0, 0.0

    def add(self, s: float) -> None:
        self.count += 1
        self.sum += s
        self.max = max(self.max, s)

    def as_dict(self, prefix: str) -> dict:
        return {f"{prefix}_count": self.count, f"{prefix}_seconds_sum": self.sum,
                f"{prefix}_seconds_max": self.max}


class EngineMinConnector(LoadWorker, KVConnectorBase):
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
        tail_chunk_size: tokens per tail piece (module docstring); 0 (default) stores only full
            chunks. Must divide ``chunk_size``, be smaller, and be a multiple of the engine's
            block size (checked at ``register_kv_caches``).

    Raises:
        ValueError: a non-positive chunk size or deadline, or a tail chunk size that is
            negative, not smaller than ``chunk_size`` or does not divide it.
    """

    def __init__(self, store: KVStoreBase, *, chunk_size: int = 256,
                 model_id: str | None = None, revision: str | None = None,
                 cache_salt: str = "",
                 hash_algo: str = "sha256", deadline_s: float = 0.5,
                 deadline_s_per_chunk: float = 0.05, save_queue_bytes: int = 512 << 20,
                 save_generated: bool = True, owns_store: bool = True,
                 tail_chunk_size: int = 0):
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if not isinstance(tail_chunk_size, int) or isinstance(tail_chunk_size, bool) or \
                tail_chunk_size < 0 or (tail_chunk_size and (
                    tail_chunk_size >= chunk_size or chunk_size % tail_chunk_size)):
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
        self.tail_chunk_size = tail_chunk_size
        self.tail_ns: Namespace | None = None
        self.model_identity: dict[str, str] = {}
        # a ChunkStore lends views of its host-memory pages: loads scatter from them directly
        self._borrow = _borrower(store)
        # a daemon client reports the daemon's tier names: shown as "remote:<tier>"
        self._remote = hasattr(store, "url") and not hasattr(store, "local")
        self.ns: Namespace | None = None
        self.bcm: BlockChunkMap | None = None
        self.kv_cache: torch.Tensor | None = None
        self._reqs: dict[str, _Request] = {}
        self._loads: list = []  # engine_min_load._Load of this step
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvconn-io")
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        # counters
        self.c: dict[str, int] = {k: 0 for k in (
            "requests", "queried_tokens", "hit_tokens", "loaded_tokens", "loaded_chunks",
            "loaded_bytes", "saved_chunks", "saved_bytes", "queued_chunks", "dropped_save_chunks",
            "save_errors", "fallbacks", "lookup_fallbacks", "load_fallbacks",
            "load_failed_tokens", "loaded_tail_chunks", "saved_tail_chunks")}
        self.hits_by_tier: dict[str, int] = {}
        self.lat = {k: _Latency() for k in ("lookup", "load", "save")}
        self._closed = False
        self._saves = SaveQueue(store.put_chunks, save_queue_bytes, self._saved)

    # ---- helpers ------------------------------------------------------------------------------
    def _warn_once(self, kind: str, msg: str, *args) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning(msg + " (logged once)", *args)

    def _state(self, seq: Any) -> _Request:
        st = self._reqs.get(seq.request_id)
        if st is None:
            st = self._reqs[seq.request_id] = _Request()
        return st

    def _keys(self, st: _Request, seq: Any, n_chunks: int) -> list[ChunkKey]:
        """Keys of the first ``n_chunks`` chunks of seq (extended incrementally)."""
        have = len(st.keys)
        if have < n_chunks:
            C = self.chunk_size
            seed = st.keys[-1].prefix_hash if have else self.ns.digest
            hashes = chain_hashes(seed, seq.token_ids[have * C:n_chunks * C], C, self.hash_algo)
            st.keys.extend(ChunkKey(self.ns.ns_id, h) for h in hashes)
        return st.keys[:n_chunks]

    def _tail_keys(self, st: _Request, seq: Any, n_pieces: int) -> list[ChunkKey]:
        """Tail-namespace keys of the first ``n_pieces`` pieces of seq (chained from token 0,
        extended incrementally)."""
        have = len(st.tail_keys)
        if have < n_pieces:
            F, tns = self.tail_chunk_size, self.tail_ns
            seed = st.tail_keys[-1].prefix_hash if have else tns.digest
            hashes = chain_hashes(seed, seq.token_ids[have * F:n_pieces * F], F, self.hash_algo)
            st.tail_keys.extend(ChunkKey(tns.ns_id, h) for h in hashes)
        return st.tail_keys[:n_pieces]

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
        return Namespace(model_id, layout, revision, self.cache_salt, self.hash_algo,
                         **{f: str(ident.get(f) or "") for f in IDENTITY_FIELDS})

    def register_kv_caches(self, kv_cache: torch.Tensor, block_size: int) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or kv_cache.shape[3] != block_size:
            raise ValueError(f"kv_cache must be [num_layers, 2, num_blocks, block_size="
                             f"{block_size}, num_kv_heads, head_dim], got {list(kv_cache.shape)}")
        if self.tail_chunk_size % block_size:
            raise ValueError(f"tail_chunk_size={self.tail_chunk_size} must be a multiple of the "
                             f"engine's block_size={block_size}")
        self.bcm = BlockChunkMap(block_size, self.chunk_size)
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
        register = getattr(self.store, "register", None)
        if register is not None:
            register(self.ns)  # a tier smaller than one chunk fails here, not mid-run
            if self.tail_ns is not None:
                register(self.tail_ns)

    @property
    def layout(self) -> KVLayout:
        self._require_bound()
        return self.ns.layout

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._require_bound()
        st = self._state(seq)
        n, local = seq.num_tokens, num_computed_tokens
        C, F = self.chunk_size, self.tail_chunk_size
        first = local // C
        n_chunks = self.bcm.num_full_chunks(n)
        if local % self.bcm.block_size or (first >= n_chunks and not self._tail_range(n, local)):
            return 0, False
        cached = st.lookup
        if cached is None or cached[0] != n or cached[1] != local:
            keys = self._keys(st, seq, n_chunks)[first:]
            tail_keys = self._tail_keys(st, seq, n // F) if F else []
            t0 = time.perf_counter()
            fut = self._pool.submit(self._lookup, n, local, keys, tail_keys)
            try:
                hit, tiers, full_end = fut.result(timeout=self.deadline_s)
            except FutureTimeout:
                self._fallback("lookup", "lookup timed out after %.3f s; recomputing",
                               self.deadline_s)
                hit, tiers, full_end = 0, {}, 0
            except Exception as exc:  # noqa: BLE001 - any store trouble means a miss
                self._fallback("lookup", "lookup failed (%s: %s); recomputing",
                               type(exc).__name__, exc)
                hit, tiers, full_end = 0, {}, 0
            self._observe("lookup", time.perf_counter() - t0)
            if self._remote:
                tiers = {k: f"remote:{t}" for k, t in tiers.items()}
            cached = st.lookup = (n, local, hit, tiers, full_end)
        return self.bcm.num_external_tokens(n, local, cached[2]), False

    def _tail_range(self, num_tokens: int, start: int) -> range:
        """Tail pieces worth looking up once the leading stored prefix ends at token ``start``
        (the end of the full-chunk hit, or the engine's own ``num_local``): the pieces from
        the one holding ``start`` to the end of its chunk or the last whole piece of the
        request. Pieces are stored only past a prompt's last full chunk, so none past the
        first missing chunk can exist. Empty when tail pieces are off or no piece would add a
        loadable token."""
        F = self.tail_chunk_size
        if not F:
            return range(0)
        lo = start // F
        hi = min(self.bcm.floor_to_chunk(start) + self.chunk_size, num_tokens) // F
        return range(lo, hi) if lo < hi and start < num_tokens - 1 else range(0)

    def _lookup(self, n: int, local: int, keys: list[ChunkKey], tail_keys: list[ChunkKey]):
        """Worker thread: ``(hit_tokens, {piece start token: tier}, full_end)`` of a request of
        ``n`` tokens with ``local`` computed: the leading stored full chunks from ``local //
        chunk_size`` (``keys``) end at ``full_end`` (a chunk boundary), then the stored tail
        pieces (``tail_keys``: all of the request's pieces) from ``max(full_end, local)``."""
        C, F = self.chunk_size, self.tail_chunk_size
        first = local // C
        full_end, tiers = first * C, {}
        if keys:
            res = self.store.lookup_keys(self.ns, keys)
            full_end = (first + res.num_hit_chunks) * C
            tiers = {(first + i) * C: t for i, t in enumerate(res.tiers)}
        hit = full_end
        rng = self._tail_range(n, max(full_end, local))
        if rng:
            res = self.store.lookup_keys(self.tail_ns, tail_keys[rng.start:rng.stop])
            if res.num_hit_chunks:
                hit = (rng.start + res.num_hit_chunks) * F
                tiers.update({(rng.start + i) * F: t for i, t in enumerate(res.tiers)})
        return hit, tiers, full_end

    def _observe(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.lat[kind].add(seconds)

    def _fallback(self, kind: str, msg: str, *args) -> None:
        with self._lock:
            self.c["fallbacks"] += 1
            self.c[f"{kind}_fallbacks"] += 1
        self._warn_once(kind, "kv connector: " + msg, *args)

    def update_state_after_alloc(self, seq: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self._require_bound()
        st = self._state(seq)
        first_admission = not st.counted
        if first_admission:
            st.counted = True
            with self._lock:
                self.c["requests"] += 1
                self.c["queried_tokens"] += seq.num_tokens
        lookup, st.lookup = st.lookup, None
        if lookup is not None and lookup[0] == seq.num_tokens:
            st.saved = max(st.saved, lookup[2])  # chunks the store already holds
            if self.tail_chunk_size:
                st.tail_saved = max(st.tail_saved, lookup[2] // self.tail_chunk_size
                                    * self.tail_chunk_size)
        if num_external_tokens <= 0:
            st.pending = None
            return
        local = seq.num_computed_tokens - num_external_tokens
        plan = self.bcm.load_plan(local, num_external_tokens)
        tiers = lookup[3] if lookup is not None else {}
        C, F = self.chunk_size, self.tail_chunk_size
        full_end = lookup[4] if lookup is not None else self.bcm.floor_to_chunk(seq.num_tokens)
        keys = self._keys(st, seq, min(plan.last_chunk, full_end // C))
        pieces = [_Piece(c * C, C, self.ns, keys[c], tiers.get(c * C, "unknown"),
                         keys[c - 1] if c else None)
                  for c in range(plan.first_chunk, len(keys))]
        if plan.end > full_end:    # the rest comes from tail pieces (found by the lookup)
            j0, j1 = max(full_end, local) // F, -(-plan.end // F)
            tail = self._tail_keys(st, seq, j1)
            pieces += [_Piece(j * F, F, self.tail_ns, tail[j], tiers.get(j * F, "unknown"),
                              tail[j - 1] if j * F > full_end else None)
                       for j in range(j0, j1)]
        st.pending = (plan, pieces, list(block_ids))
        st.count_hits = first_admission

    def request_finished(self, seq: Any, block_ids: list[int]) -> None:
        st = self._reqs.pop(seq.request_id, None)
        if st is None or self.ns is None or not block_ids:
            return
        end = seq.num_computed_tokens if self.save_generated else \
            min(seq.num_computed_tokens, seq.num_prompt_tokens)
        end = min(end, len(block_ids) * self.bcm.block_size)
        self._queue_save(seq, st, end, block_ids)
        self._queue_tail_save(seq, st, end, block_ids)

    # ---- worker side: saves -------------------------------------------------------------------
    def save(self, sched_out: Any, kv_cache: torch.Tensor) -> None:
        for item in sched_out.scheduled:
            seq = item.seq
            st = self._reqs.get(seq.request_id)
            if st is None:
                continue
            end = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens)
            self._queue_save(seq, st, end, seq.block_table)
            if end == seq.num_prompt_tokens:   # the prompt's prefill is complete
                self._queue_tail_save(seq, st, end, seq.block_table)

    def _queue_save(self, seq: Any, st: _Request, end: int, block_ids: list[int]) -> None:
        """Gather the full chunks in ``[st.saved, end)`` and queue them (or drop them)."""
        rng = self.bcm.chunks_to_save(st.saved, end)
        if not rng:
            return
        st.saved = rng.stop * self.chunk_size
        if not self._reserve(len(rng), len(rng) * self.layout.chunk_bytes):
            return
        all_keys = self._keys(st, seq, rng.stop)
        keys = all_keys[rng.start:rng.stop]
        kvs = [ops.gather_chunk(self.kv_cache, self.bcm.chunk_blocks(block_ids, c)) for c in rng]
        # a save continuing chunks saved earlier names its first chunk's parent (the store
        # keeps prefixes reachable only with true parents)
        parents = chain_parents(keys, all_keys[rng.start - 1]) if rng.start else None
        self._saves.submit(self.ns, keys, kvs, len(rng) * self.layout.chunk_bytes, parents)

    def _queue_tail_save(self, seq: Any, st: _Request, end: int, block_ids: list[int]) -> None:
        """Gather the tail pieces past the last full chunk of ``[0, end)`` that are not saved
        yet (``[max(st.tail_saved, floor_C(end)), floor_F(end))``) and queue them."""
        F = self.tail_chunk_size
        if not F:
            return
        lo = max(st.tail_saved, self.bcm.floor_to_chunk(end)) // F
        hi = end // F
        if hi <= lo:
            return
        st.tail_saved = hi * F
        nbytes = (hi - lo) * self.tail_ns.layout.chunk_bytes
        if not self._reserve(hi - lo, nbytes):
            return
        all_keys = self._tail_keys(st, seq, hi)
        keys = all_keys[lo:hi]
        per = F // self.bcm.block_size
        kvs = [ops.gather_chunk(self.kv_cache, list(block_ids[j * per:(j + 1) * per]))
               for j in range(lo, hi)]
        # pieces are looked up from the last full chunk on: the piece there starts a chain
        # (no parent); one continuing pieces saved earlier names the piece before it
        continues = lo * F > self.bcm.floor_to_chunk(end)
        parents = chain_parents(keys, all_keys[lo - 1]) if continues else None
        self._saves.submit(self.tail_ns, keys, kvs, nbytes, parents)

    def _reserve(self, n_chunks: int, nbytes: int) -> bool:
        """Room in the save queue for ``nbytes`` (counted as queued), or a counted drop."""
        ok = self._saves.try_reserve(nbytes)
        with self._lock:
            self.c["queued_chunks" if ok else "dropped_save_chunks"] += n_chunks
        if not ok:
            self._warn_once("save_drop", "kv connector: save queue full (%d bytes); dropping "
                            "saves", self.save_queue_bytes)
        return ok

    def _saved(self, ns: Namespace, stored: int | None, seconds: float,
               error: Exception | None) -> None:
        """``SaveQueue`` callback (writer thread): count what one put stored, or its error."""
        with self._lock:
            self.lat["save"].add(seconds)
            if error is None:
                self.c["saved_tail_chunks" if ns is self.tail_ns else "saved_chunks"] += stored
                self.c["saved_bytes"] += stored * ns.layout.chunk_bytes
            else:
                self.c["save_errors"] += 1
        if error is not None:
            self._warn_once("save", "kv connector: save failed (%s: %s)",
                            type(error).__name__, error)

    def wait_for_save(self, timeout_s: float | None = None) -> bool:
        return self._saves.wait(timeout_s)

    # ---- metrics and lifetime -----------------------------------------------------------------
    def get_stats(self) -> dict:
        with self._lock:
            c = dict(self.c)
            tiers = dict(self.hits_by_tier)
            lat = {k: v.as_dict(f"kvstore_{k}") for k, v in self.lat.items()}
        out = {"external_prefix_cache_queries": c["queried_tokens"],
               "external_prefix_cache_hits": c["hit_tokens"],
               "kvstore_hit_tokens_by_tier": tiers,
               "kvstore_save_queue_bytes": self._saves.queued_bytes,
               "store_namespace": None if self.ns is None else self.ns.to_dict()}
        out.update({f"kvstore_{k}": v for k, v in c.items()})
        for d in lat.values():
            out.update(d)
        breaker = remote_breaker(self.store)
        if breaker is not None:  # a dead daemon: calls skipped during its cool-downs
            out.update({f"kvstore_{k}": v for k, v in breaker.breaker_stats().items()})
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._saves.close(30.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.owns_store:
            self.store.close()

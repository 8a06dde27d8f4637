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

Robustness: every lookup and every step's loads run on worker threads and are waited for at
most ``deadline_s`` (+ ``deadline_s_per_chunk`` per chunk loaded); a late, failed or partial
load counts a fallback, logs once per kind, and leaves ``seq.num_computed_tokens`` at the end of
what landed, so the engine prefills the rest. Saves go through a bounded queue
(``save_queue_bytes``); when it is full the save is dropped and counted, never waited for.

Counters (``get_stats``), cumulative: ``external_prefix_cache_queries`` (tokens of requests
looked up, once per request), ``external_prefix_cache_hits`` (tokens loaded, once per request;
``kvstore_hit_tokens_by_tier`` splits them by the tier they came from: ``"cpu"``, ``"disk"``,
``"remote:cpu"``... for chunks held by the daemon's tiers), loaded/saved bytes and
chunks, load/save/lookup latency (count, sum, max in seconds), fallbacks, dropped saves; with a
daemon behind ``CircuitBreakerStore``: ``kvstore_remote_skipped_calls`` (calls not sent while a
failed daemon cools down), ``kvstore_remote_breaker_trips``, ``kvstore_remote_breaker_open``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.base import KVConnectorBase, LoadResult
from connectors.block_chunk_map import BlockChunkMap, LoadPlan
from connectors.layered_store import remote_breaker
from kernels import ops
from kvstore.api import KVStoreBase
from kvstore.keys import ChunkKey, Namespace, chain_hashes
from kvstore.layout import KVLayout

log = logging.getLogger("connectors.engine_min")

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class _Request:
    """Connector-side state of one request (kept across preemptions, dropped when it ends)."""

    keys: list[ChunkKey] = field(default_factory=list)   # keys of the first len(keys) chunks
    lookup: tuple | None = None     # (num_tokens, first_chunk, hit_tokens, tiers) cached
    saved: int = 0                  # tokens whose chunks are saved or known stored
    counted: bool = False           # queried tokens counted (first admission)
    count_hits: bool = False        # the pending load is of the first admission
    pending: tuple | None = None    # (LoadPlan, keys, block_ids, tiers of those chunks)


@dataclass
class _Load:
    seq: Any
    item: Any
    plan: LoadPlan
    block_ids: list[int]
    tiers: tuple[str, ...]
    future: Future
    count_hits: bool


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


class EngineMinConnector(KVConnectorBase):
    """KV connector for engine_min over one ``KVStoreBase``.

    Args:
        store: the store (``ChunkStore``, ``KVStoreClient`` or ``LayeredStore``); closed by
            ``close()`` when ``owns_store``.
        chunk_size: tokens per store chunk; a multiple of the engine's block size (checked at
            ``register_kv_caches``).
        model_id: model identity in the chunk-key namespace.
        revision: weights revision in the namespace.
        cache_salt: tenant salt (different salts never share chunks).
        hash_algo: chunk-key hash (``kvstore.keys.HASH_ALGOS``).
        deadline_s: longest wait for one lookup, and base wait for one step's loads (seconds).
        deadline_s_per_chunk: extra load wait per chunk loaded in the step (seconds).
        save_queue_bytes: bytes of gathered chunks waiting for the writer; a save that would
            exceed it is dropped (counted) unless the queue is empty.
        save_generated: at request end also save the full chunks of generated tokens (so the
            next chat round reuses this round's answer).
        owns_store: ``close()`` closes the store too.

    Raises:
        ValueError: a non-positive chunk size or deadline.
    """

    def __init__(self, store: KVStoreBase, *, chunk_size: int = 256,
                 model_id: str = DEFAULT_MODEL_ID, revision: str = "", cache_salt: str = "",
                 hash_algo: str = "sha256", deadline_s: float = 0.5,
                 deadline_s_per_chunk: float = 0.05, save_queue_bytes: int = 512 << 20,
                 save_generated: bool = True, owns_store: bool = True):
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
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
        # a daemon client reports the daemon's tier names: shown as "remote:<tier>"
        self._remote = hasattr(store, "url") and not hasattr(store, "local")
        self.ns: Namespace | None = None
        self.bcm: BlockChunkMap | None = None
        self.kv_cache: torch.Tensor | None = None
        self._reqs: dict[str, _Request] = {}
        self._loads: list[_Load] = []
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvconn-io")
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        # counters
        self.c: dict[str, int] = {k: 0 for k in (
            "requests", "queried_tokens", "hit_tokens", "loaded_tokens", "loaded_chunks",
            "loaded_bytes", "saved_chunks", "saved_bytes", "queued_chunks", "dropped_save_chunks",
            "save_errors", "fallbacks", "lookup_fallbacks", "load_fallbacks",
            "load_failed_tokens")}
        self.hits_by_tier: dict[str, int] = {}
        self.lat = {k: _Latency() for k in ("lookup", "load", "save")}
        # background writer
        self._q: queue.Queue = queue.Queue()
        self._q_bytes = 0
        self._q_items = 0
        self._cv = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kvconn-writer", daemon=True)
        self._writer.start()

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

    def _require_bound(self) -> None:
        if self.ns is None:
            raise RuntimeError("EngineMinConnector: register_kv_caches() was not called "
                               "(pass the connector to LLMEngine)")

    # ---- worker side: binding -----------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor, block_size: int) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or kv_cache.shape[3] != block_size:
            raise ValueError(f"kv_cache must be [num_layers, 2, num_blocks, block_size="
                             f"{block_size}, num_kv_heads, head_dim], got {list(kv_cache.shape)}")
        self.bcm = BlockChunkMap(block_size, self.chunk_size)
        layout = KVLayout(num_layers=int(kv_cache.shape[0]), num_kv_heads=int(kv_cache.shape[4]),
                          head_dim=int(kv_cache.shape[5]), dtype=kv_cache.dtype,
                          chunk_size=self.chunk_size)
        self.ns = Namespace(self.model_id, layout, self.revision, self.cache_salt, self.hash_algo)
        self.kv_cache = kv_cache
        register = getattr(self.store, "register", None)
        if register is not None:
            register(self.ns)  # a tier smaller than one chunk fails here, not mid-run

    @property
    def layout(self) -> KVLayout:
        self._require_bound()
        return self.ns.layout

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._require_bound()
        st = self._state(seq)
        n, local = seq.num_tokens, num_computed_tokens
        first = local // self.chunk_size
        n_chunks = self.bcm.num_full_chunks(n)
        if first >= n_chunks or local % self.bcm.block_size:
            return 0, False
        cached = st.lookup
        if cached is None or cached[0] != n or cached[1] != first:
            keys = self._keys(st, seq, n_chunks)[first:]
            t0 = time.perf_counter()
            fut = self._pool.submit(self.store.lookup_keys, self.ns, keys)
            try:
                res = fut.result(timeout=self.deadline_s)
                hit, tiers = (first + res.num_hit_chunks) * self.chunk_size, tuple(res.tiers)
            except FutureTimeout:
                self._fallback("lookup", "lookup timed out after %.3f s; recomputing",
                               self.deadline_s)
                hit, tiers = 0, ()
            except Exception as exc:  # noqa: BLE001 - any store trouble means a miss
                self._fallback("lookup", "lookup failed (%s: %s); recomputing",
                               type(exc).__name__, exc)
                hit, tiers = 0, ()
            self._observe("lookup", time.perf_counter() - t0)
            if self._remote:
                tiers = tuple(f"remote:{t}" for t in tiers)
            cached = st.lookup = (n, first, hit, tiers)
        return self.bcm.num_external_tokens(n, local, cached[2]), False

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
        if num_external_tokens <= 0:
            st.pending = None
            return
        local = seq.num_computed_tokens - num_external_tokens
        plan = self.bcm.load_plan(local, num_external_tokens)
        keys = self._keys(st, seq, plan.last_chunk)[plan.first_chunk:plan.last_chunk]
        tiers: tuple[str, ...] = ()
        if lookup is not None:
            off = plan.first_chunk - lookup[1]
            tiers = tuple(lookup[3][off:off + plan.num_chunks])
        st.pending = (plan, keys, list(block_ids), tiers)
        st.count_hits = first_admission

    def request_finished(self, seq: Any, block_ids: list[int]) -> None:
        st = self._reqs.pop(seq.request_id, None)
        if st is None or self.ns is None or not block_ids:
            return
        end = seq.num_computed_tokens if self.save_generated else \
            min(seq.num_computed_tokens, seq.num_prompt_tokens)
        end = min(end, len(block_ids) * self.bcm.block_size)
        self._queue_save(seq, st, end, block_ids)

    # ---- worker side: loads -------------------------------------------------------------------
    def start_load_kv(self, sched_out: Any, kv_cache: torch.Tensor) -> None:
        for item in sched_out.scheduled:
            st = self._reqs.get(item.seq.request_id)
            if st is None or st.pending is None:
                continue
            plan, keys, block_ids, tiers = st.pending
            st.pending = None
            fut = self._pool.submit(self.store.get_chunks, self.ns, keys)
            self._loads.append(_Load(item.seq, item, plan, block_ids, tiers, fut, st.count_hits))
            st.count_hits = False

    def wait_for_load(self) -> list[LoadResult]:
        loads, self._loads = self._loads, []
        if not loads:
            return []
        t0 = time.perf_counter()
        deadline = t0 + self.deadline_s + self.deadline_s_per_chunk * sum(
            ld.plan.num_chunks for ld in loads)
        results = []
        for ld in loads:
            chunks: list = []
            try:
                chunks = ld.future.result(timeout=max(0.0, deadline - time.perf_counter()))
            except FutureTimeout:
                ld.future.cancel()
                self._fallback("load", "load of %d chunks missed its deadline; recomputing",
                               ld.plan.num_chunks)
            except Exception as exc:  # noqa: BLE001
                self._fallback("load", "load failed (%s: %s); recomputing",
                               type(exc).__name__, exc)
            results.append(self._land(ld, chunks))
        self._observe("load", time.perf_counter() - t0)
        return results

    def _land(self, ld: _Load, chunks: list) -> LoadResult:
        """Scatter the leading chunks that arrived; rewind the sequence past the rest."""
        plan, bcm, C, bs = ld.plan, self.bcm, self.chunk_size, self.bcm.block_size
        want = self.layout.shape()
        n_ok = 0
        for kv in chunks:
            if kv is None or tuple(kv.shape) != want or kv.dtype != self.kv_cache.dtype:
                break
            n_ok += 1
        end = bcm.landed_end(plan, n_ok)
        loaded_chunks = 0
        by_tier: dict[str, int] = {}
        for i in range(n_ok):
            c = plan.first_chunk + i
            lo = max(plan.start, c * C)
            hi = min(-(-end // bs) * bs, (c + 1) * C)
            if hi <= lo:
                break
            ops.scatter_chunk(self.kv_cache, ld.block_ids[lo // bs:hi // bs],
                              chunks[i][:, :, lo - c * C:hi - c * C])
            loaded_chunks += 1
            tier = ld.tiers[i] if i < len(ld.tiers) else "unknown"
            by_tier[tier] = by_tier.get(tier, 0) + min(hi, end) - lo
        short = plan.end - end
        if short:
            if n_ok < plan.num_chunks and chunks:
                self._fallback("load", "store returned %d of %d chunks; recomputing the rest",
                               n_ok, plan.num_chunks)
            seq = ld.seq
            seq.num_computed_tokens -= short
            seq.num_cached_tokens = max(0, seq.num_cached_tokens - short)
            ld.item.num_new_tokens += short
            st = self._reqs.get(seq.request_id)
            if st is not None:
                st.saved = min(st.saved, bcm.floor_to_chunk(end))
        with self._lock:
            self.c["loaded_tokens"] += end - plan.start
            self.c["loaded_chunks"] += loaded_chunks
            self.c["loaded_bytes"] += loaded_chunks * self.layout.chunk_bytes
            self.c["load_failed_tokens"] += short
            if ld.count_hits:
                self.c["hit_tokens"] += end - plan.start
                for t, v in by_tier.items():
                    self.hits_by_tier[t] = self.hits_by_tier.get(t, 0) + v
        return LoadResult(ld.seq.request_id, plan.num_tokens, end - plan.start, short == 0)

    # ---- worker side: saves -------------------------------------------------------------------
    def save(self, sched_out: Any, kv_cache: torch.Tensor) -> None:
        for item in sched_out.scheduled:
            seq = item.seq
            st = self._reqs.get(seq.request_id)
            if st is None:
                continue
            end = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens)
            self._queue_save(seq, st, end, seq.block_table)

    def _queue_save(self, seq: Any, st: _Request, end: int, block_ids: list[int]) -> None:
        """Gather the full chunks in ``[st.saved, end)`` and queue them (or drop them)."""
        rng = self.bcm.chunks_to_save(st.saved, end)
        if not rng:
            return
        st.saved = rng.stop * self.chunk_size
        nbytes = len(rng) * self.layout.chunk_bytes
        with self._cv:
            full = self._q_items > 0 and self._q_bytes + nbytes > self.save_queue_bytes
            if full or self._closed:
                self.c["dropped_save_chunks"] += len(rng)
                drop = True
            else:
                self._q_bytes += nbytes
                self._q_items += 1
                self.c["queued_chunks"] += len(rng)
                drop = False
        if drop:
            self._warn_once("save_drop", "kv connector: save queue full (%d bytes); dropping "
                            "saves", self.save_queue_bytes)
            return
        keys = self._keys(st, seq, rng.stop)[rng.start:rng.stop]
        kvs = [ops.gather_chunk(self.kv_cache, self.bcm.chunk_blocks(block_ids, c)) for c in rng]
        self._q.put((keys, kvs, nbytes))

    def _write_loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            keys, kvs, nbytes = item
            t0 = time.perf_counter()
            try:
                n = self.store.put_chunks(self.ns, keys, kvs)
                with self._lock:
                    self.c["saved_chunks"] += n
                    self.c["saved_bytes"] += n * self.layout.chunk_bytes
            except Exception as exc:  # noqa: BLE001 - a failed save only costs a future hit
                with self._lock:
                    self.c["save_errors"] += 1
                self._warn_once("save", "kv connector: save failed (%s: %s)",
                                type(exc).__name__, exc)
            with self._lock:
                self.lat["save"].add(time.perf_counter() - t0)
            with self._cv:
                self._q_bytes -= nbytes
                self._q_items -= 1
                self._cv.notify_all()

    def wait_for_save(self, timeout_s: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._q_items == 0, timeout_s)

    # ---- metrics and lifetime -----------------------------------------------------------------
    def get_stats(self) -> dict:
        with self._lock:
            c = dict(self.c)
            tiers = dict(self.hits_by_tier)
            lat = {k: v.as_dict(f"kvstore_{k}") for k, v in self.lat.items()}
        out = {"external_prefix_cache_queries": c["queried_tokens"],
               "external_prefix_cache_hits": c["hit_tokens"],
               "kvstore_hit_tokens_by_tier": tiers,
               "kvstore_save_queue_bytes": self._q_bytes}
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
        self.wait_for_save(30.0)
        with self._cv:
            self._closed = True
        self._q.put(None)
        self._writer.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.owns_store:
            self.store.close()

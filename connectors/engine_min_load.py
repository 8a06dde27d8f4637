"""Worker-side loads of ``connectors.engine_min.EngineMinConnector`` (a mixin).

``start_load_kv`` hands each scheduled request's pending load (pieces chosen by the scheduler
side at admission) to a worker thread, which reads them from the store and scatters the leading
ones that arrived whole into the request's blocks (``kernels.ops.scatter_chunk``), one at a time
under the load's lock. ``wait_for_load`` waits until the step's deadline, then cancels (nothing
is scattered afterwards) and ``_land`` rewinds each sequence past what did not land, so the
engine prefills the rest. From an in-process ``ChunkStore`` the scatter copies straight out of
the CPU tier's pages (``ChunkStore.borrow_chunks``, reader-pinned while in use).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.base import LoadResult
from connectors.block_chunk_map import LoadPlan
from kernels import ops
from kvstore.api import KVStoreBase
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout


@dataclass(frozen=True)
class _Piece:
    """One stored unit to load: a full chunk (``size`` = chunk size, the connector's namespace)
    or a tail piece (``size`` = tail chunk size, the tail namespace) covering tokens
    ``[start, start + size)``."""

    start: int
    size: int
    ns: Namespace
    key: ChunkKey
    tier: str
    parent: ChunkKey | None = None  # the piece before it in its chain (None: starts one)


@dataclass
class _Load:
    seq: Any
    item: Any
    plan: LoadPlan
    pieces: list[_Piece]
    block_ids: list[int]
    count_hits: bool
    future: Future | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    landed: int = 0                 # leading pieces scattered into the blocks
    cancelled: bool = False         # set under ``lock``: the worker scatters nothing more


def _borrower(store: KVStoreBase):
    """``store.borrow_chunks`` when the store is a ``ChunkStore`` whose reads are its own (a
    subclass that redefines ``get_chunks``, e.g. to inject faults, keeps being read through
    it), else None."""
    from kvstore.store import ChunkStore
    if not isinstance(store, ChunkStore) or type(store).get_chunks is not ChunkStore.get_chunks:
        return None
    return store.borrow_chunks


def _as_chunk(parts: list[torch.Tensor] | None, layout: KVLayout) -> torch.Tensor | None:
    """A borrowed chunk's byte runs (1-D ``uint8``) as ``layout.shape()`` of its dtype: a view
    of the pages when they are one run, else a copy; None when absent or not the chunk's size."""
    if parts is None or sum(int(t.numel()) for t in parts) != layout.chunk_bytes:
        return None
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    return flat.view(layout.torch_dtype).view(layout.shape())


class LoadWorker:
    """Load methods of ``EngineMinConnector``; they use its store, KV pool, block-chunk map,
    request states, worker pool, deadlines and counters."""

    def start_load_kv(self, sched_out: Any, kv_cache: torch.Tensor) -> None:
        for item in sched_out.scheduled:
            st = self._reqs.get(item.seq.request_id)
            if st is None or st.pending is None:
                continue
            plan, pieces, block_ids = st.pending
            st.pending = None
            ld = _Load(item.seq, item, plan, pieces, block_ids, st.count_hits)
            ld.future = self._pool.submit(self._fetch_and_scatter, ld)
            self._loads.append(ld)
            st.count_hits = False

    def _fetch_and_scatter(self, ld: _Load) -> None:
        """Worker thread: read ``ld``'s pieces and scatter the leading ones that arrived whole
        into the request's blocks, one at a time, each under ``ld.lock`` and only while
        ``ld.cancelled`` is false (``ld.landed`` counts them). One read per namespace: from a
        store with ``borrow_chunks`` (``ChunkStore``) the scatter copies straight out of the
        tier's pinned pages (one copy in all), otherwise from ``get_chunks``' tensors.

        Raises:
            whatever the store raises (the caller counts a fallback; what landed stays).
        """
        groups: list[list[_Piece]] = []
        for p in ld.pieces:
            if groups and groups[-1][0].ns is p.ns:
                groups[-1].append(p)
            else:
                groups.append([p])
        for group in groups:
            ns = group[0].ns
            want = ns.layout.shape()
            keys = [p.key for p in group]
            if self._borrow is not None:
                borrowed = self._borrow(ns, keys)
                try:
                    if borrowed.lower:      # chunks only in a lower tier (disk): read them
                        borrowed.read_lower()
                    for p, parts in zip(group, borrowed.parts):
                        if not self._scatter(ld, p, _as_chunk(parts, ns.layout), want):
                            return
                finally:
                    borrowed.release()
                continue
            if self.store.get_takes_parents:  # it keeps copies: they need true parents
                kvs = self.store.get_chunks(ns, keys, [p.parent for p in group])
            else:
                kvs = self.store.get_chunks(ns, keys)
            for p, kv in zip(group, kvs):
                if not self._scatter(ld, p, kv, want):
                    return
            if len(kvs) < len(group):
                return

    def _scatter(self, ld: _Load, p: _Piece, kv: torch.Tensor | None, want: tuple) -> bool:
        """Scatter piece ``p``'s tokens in ``[plan.start, ceil_block(plan.end))`` into the
        request's blocks unless cancelled or ``kv`` is missing or misshapen; True if it landed."""
        if kv is None or tuple(kv.shape) != want or kv.dtype != self.kv_cache.dtype:
            return False
        bs = self.bcm.block_size
        lo = max(ld.plan.start, p.start)
        hi = min(-(-ld.plan.end // bs) * bs, p.start + p.size)
        with ld.lock:
            if ld.cancelled:
                return False
            if hi > lo:
                ops.scatter_chunk(self.kv_cache, ld.block_ids[lo // bs:hi // bs],
                                  kv[:, :, lo - p.start:hi - p.start])
            ld.landed += 1
        return True

    def wait_for_load(self) -> list[LoadResult]:
        loads, self._loads = self._loads, []
        if not loads:
            return []
        t0 = time.perf_counter()
        deadline = t0 + self.deadline_s + self.deadline_s_per_chunk * sum(
            len(ld.pieces) for ld in loads)
        results = []
        for ld in loads:
            failed = True
            try:
                ld.future.result(timeout=max(0.0, deadline - time.perf_counter()))
                failed = False
            except FutureTimeout:
                ld.future.cancel()
                self._fallback("load", "load of %d chunks missed its deadline; recomputing",
                               len(ld.pieces))
            except Exception as exc:  # noqa: BLE001
                self._fallback("load", "load failed (%s: %s); recomputing",
                               type(exc).__name__, exc)
            with ld.lock:          # nothing is scattered after this
                ld.cancelled = True
            results.append(self._land(ld, failed))
        self._observe("load", time.perf_counter() - t0)
        return results

    def _land(self, ld: _Load, failed: bool) -> LoadResult:
        """Account for the leading pieces that landed; rewind the sequence past the rest
        (``failed``: the read raised or missed its deadline, a fallback already counted)."""
        plan, bcm = ld.plan, self.bcm
        n_ok = ld.landed
        end = plan.start
        if n_ok:
            last = ld.pieces[n_ok - 1]
            end = max(plan.start, min(plan.end, last.start + last.size))
        by_tier: dict[str, int] = {}
        full = tail = nbytes = 0
        for p in ld.pieces[:n_ok]:
            lo, hi = max(plan.start, p.start), min(end, p.start + p.size)
            if p.ns is self.ns:
                full += 1
            else:
                tail += 1
            nbytes += p.ns.layout.chunk_bytes
            if hi > lo:
                by_tier[p.tier] = by_tier.get(p.tier, 0) + hi - lo
        short = plan.end - end
        if short:
            if not failed and n_ok < len(ld.pieces):
                self._fallback("load", "store returned %d of %d chunks; recomputing the rest",
                               n_ok, len(ld.pieces))
            seq = ld.seq
            seq.num_computed_tokens -= short
            seq.num_cached_tokens = max(0, seq.num_cached_tokens - short)
            ld.item.num_new_tokens += short
            st = self._reqs.get(seq.request_id)
            if st is not None:
                st.saved = min(st.saved, bcm.floor_to_chunk(end))
                if self.tail_chunk_size:
                    st.tail_saved = min(st.tail_saved,
                                        end // self.tail_chunk_size * self.tail_chunk_size)
        with self._lock:
            self.c["loaded_tokens"] += end - plan.start
            self.c["loaded_chunks"] += full
            self.c["loaded_tail_chunks"] += tail
            self.c["loaded_bytes"] += nbytes
            self.c["load_failed_tokens"] += short
            if ld.count_hits:
                self.c["hit_tokens"] += end - plan.start
                for t, v in by_tier.items():
                    self.hits_by_tier[t] = self.hits_by_tier.get(t, 0) + v
        return LoadResult(ld.seq.request_id, plan.num_tokens, end - plan.start, short == 0)

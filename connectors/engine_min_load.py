"""Worker-side loads of ``connectors.engine_min.EngineMinConnector``: the ``Loader`` it owns.

``start`` hands a request's load plan (``connectors.chunk_records.LoadPlan``: the pieces chosen
at admission by ``connectors.chunk_plan.RequestChunks.admit``) to a worker thread, which reads
them from the store and scatters the leading ones that arrived whole into the request's blocks
(``kernels.ops.scatter_chunk``), one at a time under the load's lock. ``wait`` waits until the
step's deadline, then cancels (nothing is scattered afterwards) and lands each load: the
sequence is rewound past what did not land (``LoadPlan.landed``), so the engine prefills the
rest. From an in-process ``ChunkStore`` the scatter copies straight out of the CPU tier's pages
(``ChunkStore.borrow_chunks``, reader-pinned while in use). A pool off the CPU receives each
piece through ``connectors.engine_min_device.to_pool`` (asynchronous only from pinned pages),
and the worker waits for those copies before borrowed pages go back or it returns.

Layer-wise loads (``bind(..., layerwise=True)``; ``connectors.engine_min_layers``): the worker
reads every piece first, then writes them layer by layer while the forward pass runs;
``wait_layer(i)`` (before layer ``i``'s attention) waits for layer ``i`` within the step's
deadline, and ``wait`` (after the forward pass) lands the loads as above. The borrowed pages
are held until the last layer is written. A piece lands only with all its layers; a load
stopped part-way lands none of what it read (the engine runs those tokens again).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.base import LoadResult
from connectors.chunk_plan import RequestChunks
from connectors.chunk_records import LoadPlan, Piece
from connectors.engine_min_device import (DeviceEvent, join_stream, on_stream, side_stream,
                                          sync_pool, to_pool)
from connectors.engine_min_layers import LayerGate, Move, write_layers
from connectors.engine_min_stats import ConnectorStats
from connectors.remote_borrow import borrowing_read
from kernels import ops
from kvstore.api import KVStoreBase
from kvstore.layout import KVLayout


@dataclass
class _Load:
    """One request's load in flight this step."""

    seq: Any
    item: Any
    plan: LoadPlan
    chunks: RequestChunks
    block_ids: list[int]
    count_hits: bool
    future: Future | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    landed: int = 0                 # leading pieces scattered into the blocks
    cancelled: bool = False         # read under ``lock``: set, then the lock taken, nothing
                                    # more is scattered
    timed_out: bool = False         # cancelled by the step's deadline while waited for
    gate: LayerGate | None = None   # layer-wise: the layers written so far
    moves: list[Move] = field(default_factory=list)   # layer-wise: the pieces read, to write
    kept: int = 0                   # layer-wise: leading pieces read whole (moves' pieces)
    held: list = field(default_factory=list)          # layer-wise: borrowed pages in use


def _as_chunk(parts: list[torch.Tensor] | None, layout: KVLayout) -> torch.Tensor | None:
    """A borrowed chunk's byte runs (1-D ``uint8``) as ``layout.shape()`` of its dtype: a view
    of the pages when they are one run, else a copy; None when absent or not the chunk's size."""
    if parts is None or sum(int(t.numel()) for t in parts) != layout.chunk_bytes:
        return None
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    return flat.view(layout.torch_dtype).view(layout.shape())


class Loader:
    """Loads of one connector's requests into its engine's paged KV pool.

    Args:
        store: the store read from.
        pool: the worker threads loads run on.
        stats: the connector's counters (loads, fallbacks, hits per tier).
        deadline_s, deadline_s_per_chunk: one step's loads are waited for at most
            ``deadline_s + deadline_s_per_chunk * pieces`` seconds.
    """

    def __init__(self, store: KVStoreBase, pool: Executor, stats: ConnectorStats,
                 deadline_s: float, deadline_s_per_chunk: float) -> None:
        self.store, self._pool, self.stats = store, pool, stats
        self.deadline_s, self.deadline_s_per_chunk = deadline_s, deadline_s_per_chunk
        caps = store.capabilities
        # a store that lends views of host-memory pages (a ChunkStore whose reads are its own;
        # the daemon client's shared arena): loads scatter from them directly
        self._borrow = borrowing_read(store)
        # a store that keeps copies of what it fetched needs their true parents
        self._get_takes_parents = caps.get_takes_parents
        self.kv_cache: torch.Tensor | None = None
        self.block_size = 0
        self.layerwise = False
        self._stream = None             # layer-wise on CUDA: the copies' side stream
        self._loads: list[_Load] = []
        self._deadline: float | None = None   # this step's, set by its first wait
        self._waited_s = 0.0            # this step's time the engine spent waiting

    def bind(self, kv_cache: torch.Tensor, block_size: int, layerwise: bool = False) -> None:
        """Load into ``kv_cache`` ``[num_layers, 2, num_blocks, block_size, num_kv_heads,
        head_dim]``; ``layerwise``: layer by layer beside the forward pass (module docstring)."""
        self.kv_cache, self.block_size = kv_cache, block_size
        self.layerwise = layerwise
        self._stream = side_stream(kv_cache.device) if layerwise else None

    def start(self, item: Any, plan: LoadPlan, chunks: RequestChunks, block_ids: list[int],
              count_hits: bool) -> None:
        """Begin loading ``plan`` for ``item.seq`` (a scheduled item) into ``block_ids``;
        ``count_hits``: its loaded tokens count as the request's hits."""
        ld = _Load(item.seq, item, plan, chunks, block_ids, count_hits)
        if self.layerwise:
            ld.gate = LayerGate()
            # the pool's earlier users (this step's block copies...) are queued before this
            ld.future = self._pool.submit(self._fetch_by_layer, ld, DeviceEvent(
                self.kv_cache.device))
        else:
            ld.future = self._pool.submit(self._fetch_and_scatter, ld)
        self._loads.append(ld)

    def _fetch_and_scatter(self, ld: _Load) -> None:
        """Worker thread: read ``ld``'s pieces and scatter the leading ones that arrived whole
        into the request's blocks, one at a time, each under ``ld.lock`` and only while
        ``ld.cancelled`` is false (``ld.landed`` counts them). One read per namespace: from a
        store with ``borrow_chunks`` (``ChunkStore``) the scatter copies straight out of the
        tier's pinned pages (one copy in all), otherwise from ``get_chunks``' tensors.

        Raises:
            whatever the store raises (the caller counts a fallback; what landed stays).
        """
        try:
            self._fetch_groups(ld, self._scatter)
        finally:
            sync_pool(self.kv_cache.device)    # no copy still reads a chunk we drop

    def _fetch_by_layer(self, ld: _Load, ready: DeviceEvent) -> None:
        """Worker thread, layer-wise: read ``ld``'s pieces (the leading ones that arrived whole
        become ``ld.moves``; borrowed pages are held), then write them layer by layer
        (``write_layers``, on the side stream after ``ready``); ``ld.landed`` counts them once
        every layer is written. Borrowed pages go back after the last copy finished.

        Raises:
            what the store or a copy raises (the caller counts a fallback), after the pieces
            read before a failing read were written.
        """
        try:
            with on_stream(self._stream):
                try:
                    error = None
                    try:
                        self._fetch_groups(ld, self._keep)
                    except Exception as exc:  # noqa: BLE001 - raised after the writes
                        error = exc
                    ready.order_current_stream()
                    if write_layers(ld.moves, self.kv_cache, ld.lock, ld.gate,
                                    lambda: ld.cancelled):
                        with ld.lock:
                            ld.landed = 0 if ld.cancelled else ld.kept
                    if error is not None:
                        raise error
                finally:
                    sync_pool(self.kv_cache.device)   # the side stream: every copy done
                    for borrowed in ld.held:
                        borrowed.release()
        finally:
            ld.gate.finish()

    def _fetch_groups(self, ld: _Load, take) -> None:
        """Read ``ld``'s pieces, one read per namespace, and hand each that arrived to
        ``take(ld, piece, kv, want) -> bool`` in order, stopping at the first it refuses.
        Borrowed pages go back after each read (whole loads) or join ``ld.held``
        (layer-wise: released after the last layer)."""
        groups: list[list[Piece]] = []
        for p in ld.plan.pieces:
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
                if ld.gate is not None:
                    ld.held.append(borrowed)
                try:
                    if borrowed.lower:      # chunks only in a lower tier (disk): read them
                        borrowed.read_lower()
                    for p, parts in zip(group, borrowed.parts):
                        if not take(ld, p, _as_chunk(parts, ns.layout), want):
                            return
                finally:
                    if ld.gate is None:
                        sync_pool(self.kv_cache.device)   # the pages' copies are done
                        borrowed.release()
                continue
            if self._get_takes_parents:
                kvs = self.store.get_chunks(ns, keys, [p.parent for p in group])
            else:
                kvs = self.store.get_chunks(ns, keys)
            for p, kv in zip(group, kvs):
                if not take(ld, p, kv, want):
                    return
            if len(kvs) < len(group):
                return

    def _span(self, ld: _Load, p: Piece, kv: torch.Tensor | None,
              want: tuple) -> tuple[int, int] | None:
        """Tokens ``[lo, hi)`` of piece ``p`` to write (``[plan.start, ceil_block(plan.end))``
        within it), or None when ``kv`` is missing or misshapen."""
        if kv is None or tuple(kv.shape) != want or kv.dtype != self.kv_cache.dtype:
            return None
        bs = self.block_size
        return max(ld.plan.start, p.start), min(-(-ld.plan.end // bs) * bs, p.end)

    def _keep(self, ld: _Load, p: Piece, kv: torch.Tensor | None, want: tuple) -> bool:
        """Layer-wise: queue piece ``p``'s tokens as a ``Move`` unless ``kv`` is missing or
        misshapen; True if kept."""
        span = self._span(ld, p, kv, want)
        if span is None:
            return False
        lo, hi, bs = *span, self.block_size
        if hi > lo:
            ld.moves.append(Move(kv[:, :, lo - p.start:hi - p.start],
                                 ld.block_ids[lo // bs:hi // bs]))
        ld.kept += 1
        return True

    def _scatter(self, ld: _Load, p: Piece, kv: torch.Tensor | None, want: tuple) -> bool:
        """Scatter piece ``p``'s tokens in ``[plan.start, ceil_block(plan.end))`` into the
        request's blocks unless cancelled or ``kv`` is missing or misshapen; True if it landed."""
        span = self._span(ld, p, kv, want)
        if span is None:
            return False
        lo, hi, bs = *span, self.block_size
        with ld.lock:
            if ld.cancelled:
                return False
            if hi > lo:
                src, _ = to_pool(kv[:, :, lo - p.start:hi - p.start], self.kv_cache.device)
                ops.scatter_chunk(self.kv_cache, ld.block_ids[lo // bs:hi // bs], src)
            ld.landed += 1
        return True

    def _step_deadline(self) -> float:
        """This step's deadline (``time.perf_counter()``), fixed by its first wait."""
        if self._deadline is None:
            self._deadline = time.perf_counter() + self.deadline_s + \
                self.deadline_s_per_chunk * sum(len(ld.plan.pieces) for ld in self._loads)
        return self._deadline

    def wait_layer(self, layer: int) -> None:
        """Layer-wise: block until every load of this step has written ``layer`` (on CUDA:
        order the engine's stream after those copies), or the step's deadline passed (the
        late loads are stopped: they land nothing and count a fallback at ``wait``)."""
        if not self._loads:
            return
        t0 = time.perf_counter()
        deadline = self._step_deadline()
        for ld in self._loads:
            if ld.gate is not None and not ld.timed_out:
                ld.gate.wait_layer(layer, deadline, lambda ld=ld: _stop(ld))
        self._waited_s += time.perf_counter() - t0

    def wait(self) -> list[LoadResult]:
        """Wait (up to the step's deadline) for the loads started; land each (module
        docstring). Layer-wise: called after the forward pass; the engine's stream is then
        ordered after every copy the loads issued."""
        if not self._loads:
            return []
        t0 = time.perf_counter()
        deadline = self._step_deadline()
        loads, self._loads, self._deadline = self._loads, [], None
        results = []
        for ld in loads:
            failed = True
            try:  # (wait() first: a store error may itself be a TimeoutError, see lookups)
                if not ld.timed_out and wait(
                        [ld.future], timeout=max(0.0, deadline - time.perf_counter())).done:
                    ld.future.result()
                    failed = False
                    self.stats.recovered("load")
                else:
                    ld.future.cancel()
                    self.stats.fallback("load", "load of %d chunks missed its deadline; "
                                        "recomputing", len(ld.plan.pieces))
            except Exception as exc:  # noqa: BLE001
                self.stats.fallback("load", "load failed (%s: %s); recomputing",
                                    type(exc).__name__, exc)
            ld.cancelled = True    # checked before each write, under the lock:
            with ld.lock:          # once we hold it, nothing is or will be scattered
                pass
            results.append(self._land(ld, failed))
        join_stream(self._stream)  # CUDA: what a stopped load issued is done before reuse
        waited, self._waited_s = self._waited_s + time.perf_counter() - t0, 0.0
        self.stats.observe("load", waited)
        return results

    def _land(self, ld: _Load, failed: bool) -> LoadResult:
        """Account for the leading pieces that landed; rewind the sequence past the rest
        (``failed``: the read raised or missed its deadline, a fallback already counted)."""
        plan, n_ok = ld.plan, ld.landed
        got = plan.landed(n_ok)
        if got.short:
            if not failed and n_ok < len(plan.pieces):
                self.stats.fallback("load", "store returned %d of %d chunks; recomputing the "
                                    "rest", n_ok, len(plan.pieces))
            seq = ld.seq
            seq.num_computed_tokens -= got.short
            seq.num_cached_tokens = max(0, seq.num_cached_tokens - got.short)
            ld.item.num_new_tokens += got.short
            ld.chunks.rewind(got.end)
        loaded = got.end - plan.start
        hits = {"hit_tokens": loaded, "hits_by_tier": got.tokens_by_tier} if ld.count_hits \
            else {}
        self.stats.add(loaded_tokens=loaded, loaded_chunks=got.full_chunks,
                       loaded_tail_chunks=got.tail_pieces, loaded_bytes=got.nbytes,
                       load_failed_tokens=got.short, **hits)
        return LoadResult(ld.seq.request_id, plan.num_tokens, loaded, got.short == 0)


def _stop(ld: _Load) -> None:
    """The step's deadline passed while the engine waited for ``ld``: no layer is written
    after the one being written (``wait`` later takes the lock: that one is done too)."""
    ld.cancelled = ld.timed_out = True

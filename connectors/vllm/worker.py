"""Worker side of the vLLM connector: the paged KV caches, loads scattered into them (layer
by layer beside the forward pass, ``connectors.vllm.layer_load``, or whole before it), saves
gathered out of them after the forward pass and written by the shared background writer
(``connectors.save_queue.SaveQueue``), which then demotes the tail pieces a saved full chunk
covers (``ChunkTransfer.supersedes``).

A chunk larger than the daemon's ``--max-body-bytes`` (``connectors.chunk_limit``): at
registration ``check_chunk_limit`` asks the daemon, and one WARNING names both sizes; when the
daemon is the only store, the saves of chunks of that layout are then skipped before any gather,
each counted in ``save_errors`` as the put's ``ChunkTooLarge`` was (as later ones, once met).
Failed loads, saves and demotions warn once per cause (``StoreCalls.warn``).
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable

import torch

from kvstore.api import chain_parents
from kvstore.daemon.batches import ChunkTooLarge
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout

from connectors import chunk_limit
from connectors.put_answer import LocalPutResult, checked_put, log_local_refusal
from connectors.save_queue import SaveQueue, demote_superseded
from connectors.vllm.layer_load import LayerLoad, Loader
from connectors.vllm.paged_layout import PagedLayout, derive_paged_layout
from connectors.vllm.records import ChunkTransfer
from connectors.vllm.shared import Counters, StoreCalls

log = logging.getLogger("kvstore.connectors.vllm")


def layer_index(name: str) -> int:
    """The model layer index in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7).

    Raises:
        ValueError: no ``.<digits>.`` part in ``name``.
    """
    m = re.findall(r"\.(\d+)\.", "." + name + ".")
    if not m:
        raise ValueError(f"cannot find a layer index in layer name {name!r}")
    return int(m[0])


class WorkerSide:
    """Moves chunks between the store and vLLM's paged KV caches.

    Args:
        layout: the full chunks' layout (a transfer whose namespace has another layout moves
            tail pieces).
        layer_names: the KV cache group's attention layers, in layer order.
        block_size: tokens per block; num_blocks: blocks per layer cache.
        calls: the store and its deadline; counters: the connector's counters.
        save_queue_bytes: bytes of gathered chunks the background writer may hold.
        forward_context: ``() -> {layer name: attention layer}`` (vLLM's static forward
            context), read once when the paged layout is derived.
        layerwise: loads run layer by layer on a background thread (``start_load``,
            ``wait_layer``); False: whole loads before the forward pass; None: decided at
            ``register``, layer by layer when the caches are on a GPU, whole on CPU.
    """

    def __init__(self, layout: KVLayout, layer_names: list[str], block_size: int,
                 num_blocks: int, calls: StoreCalls, counters: Counters, save_queue_bytes: int,
                 forward_context: Callable[[], dict[str, Any]],
                 layerwise: bool | None = False) -> None:
        self.layout, self.layer_names, self.block_size = layout, layer_names, block_size
        self.num_blocks, self.calls, self.counters = num_blocks, calls, counters
        self._forward_context, self.layerwise = forward_context, layerwise
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.paged: PagedLayout | None = None
        self._layout_error: str | None = None
        self._failed_blocks: set[int] = set()
        self._fail_lock = threading.Lock()
        self._layer_pos = {n: i for i, n in enumerate(layer_names)}
        self._caches: list[torch.Tensor] = []
        self._loader: Loader | None = None
        self._load: LayerLoad | None = None
        self._copied: set[str] = set()    # finished requests whose last saves are copied out
        self.saves = SaveQueue(self._put, save_queue_bytes, self._saved, name="kvstore-vllm-saver")
        self._oversize: set[KVLayout] = set()   # warned: the daemon cannot take its chunk
        self._skipped: set[KVLayout] = set()    # ... and saves of chunks of it are skipped
        self._refusals_told: set[str] = set()   # in-process refusals logged (log_local_refusal)

    # ---- caches and layout -----------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer paged caches (layer order = model layer index).

        Raises:
            ValueError: the caches do not match the KV cache group's layers.
        """
        names = sorted(kv_caches, key=layer_index)
        if names != self.layer_names:
            raise ValueError(f"registered KV caches {names[:3]}... differ from the KV cache "
                             f"group's layers {self.layer_names[:3]}...")
        self.kv_caches = {n: kv_caches[n] for n in names}
        self._caches = list(self.kv_caches.values())
        if self.layerwise is None:  # auto: overlap only where copies do not take the cores
            self.layerwise = bool(self._caches) and self._caches[0].device.type == "cuda"

    def check_chunk_limit(self, *namespaces: Namespace | None) -> None:
        """At start: for each namespace whose chunk is larger than the daemon's
        ``max_body_bytes`` (``chunk_limit.oversize``; asks the daemon when no call was
        answered yet), log the one WARNING and skip the saves of chunks of its layout when the
        daemon is the only store. Nothing for a store without a daemon. Never raises."""
        for ns in namespaces:
            if ns is not None:
                over = chunk_limit.oversize(self.calls.store, ns)
                if over is not None:
                    self._too_large(ns, *over)

    def _too_large(self, ns: Namespace, chunk_bytes: int, max_body_bytes: int) -> None:
        """A chunk of ``ns`` cannot reach the daemon: warn once per layout; skip the saves of
        that layout from now on when the daemon is the only store."""
        if ns.layout in self._oversize:
            return
        self._oversize.add(ns.layout)
        skip = chunk_limit.saves_go_to_daemon_only(self.calls.store)
        if skip:
            self._skipped.add(ns.layout)
        chunk_limit.warn(self.calls.store, ns, chunk_bytes, max_body_bytes, skip)

    def ensure_layout(self) -> PagedLayout | None:
        """The paged layout, derived at the first call; None (logged once) when it cannot be
        derived: the connector then loads and saves nothing."""
        if self.paged is not None or self._layout_error is not None:
            return self.paged
        try:
            if not self.kv_caches:
                raise ValueError("no KV caches registered")
            name = self.layer_names[0]
            layer = self._forward_context()[name]
            lay = self.layout
            paged = derive_paged_layout(layer.impl, layer, self.kv_caches[name],
                                        self.num_blocks, self.block_size, lay.num_kv_heads,
                                        lay.head_dim)
            for n, c in self.kv_caches.items():
                if (tuple(c.shape) != paged.shape or tuple(c.stride()) != paged.stride
                        or c.dtype != lay.torch_dtype):
                    raise ValueError(f"layer {n} cache {list(c.shape)} {c.dtype} differs "
                                     f"from layer {name}'s")
            self.paged = paged
            log.info("kvstore connector: derived paged layout: %s", paged.describe())
        except Exception as e:
            self._layout_error = str(e)
            log.error("kvstore connector disabled: %s", e)
        return self.paged

    def _slots(self, t: ChunkTransfer, lo: int, hi: int) -> torch.Tensor:
        """Slots ``[hi - lo]`` int64 of tokens ``[lo, hi)`` in ``t``'s block table."""
        tok = torch.arange(lo, hi, dtype=torch.int64)
        bs = self.block_size
        blocks = torch.tensor(t.block_ids, dtype=torch.int64)
        if hi > len(t.block_ids) * bs:
            raise ValueError(f"request {t.request_id}: tokens up to {hi} need "
                             f"{-(-hi // bs)} blocks, block table has {len(t.block_ids)}")
        return blocks[torch.div(tok, bs, rounding_mode="floor")] * bs + tok % bs

    # ---- loads -----------------------------------------------------------------------------
    def _fail(self, t: ChunkTransfer, from_token: int, count: bool = True) -> None:
        """Mark the blocks of ``t``'s tokens ``[from_token, t.end)`` failed (vLLM recomputes
        from the first); ``count``: one more ``load_errors``."""
        bs = self.block_size
        first, last = from_token // bs, (t.end - 1) // bs
        with self._fail_lock:
            self._failed_blocks.update(t.block_ids[first:last + 1])
        if count:
            self.counters.add(load_errors=1)

    def load(self, loads: list[ChunkTransfer]) -> None:
        """Scatter ``loads`` into the paged caches, every layer, before returning (whole
        loads). A missing chunk, a store error or a deadline marks the blocks of the remaining
        tokens as failed."""
        t0 = time.perf_counter()
        moves = self._fetch(loads)
        for layer in range(len(self.layer_names)):
            self._scatter_layer(moves, layer)
        self.counters.add(load_s=time.perf_counter() - t0)

    def start_load(self, loads: list[ChunkTransfer]) -> None:
        """Start ``loads``: layer-wise (``layerwise``) on the loader thread, where
        ``wait_layer`` waits for one layer; else whole (``load``) before returning."""
        self.finish_load()
        if not loads:
            return
        self.ensure_layout()    # derived here, on the engine's thread, not on the loader's
        if not self.layerwise:
            self.load(loads)
            return
        if self._loader is None:
            self._loader = Loader(len(self.layer_names))
        t0 = time.perf_counter()

        def scatter(moves: list, layer: int) -> None:
            self._scatter_layer(moves, layer)
            if layer == len(self.layer_names) - 1:
                self.counters.add(load_s=time.perf_counter() - t0)

        def failed(e: BaseException) -> None:
            self.calls.warn("load", "kvstore layer-wise load failed (%r); recomputing", e)
            for t in loads:
                self._fail(t, t.start)

        self._load = self._loader.start(lambda: self._fetch(loads), scatter, failed)

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's load has written layer ``layer_name`` (no load in flight,
        or a layer the connector does not move: return at once)."""
        load, i = self._load, self._layer_pos.get(layer_name)
        if load is not None and i is not None:
            load.wait_layer(i)

    def finish_load(self) -> None:
        """Block until this step's layer-wise load is done (every layer written, or failed
        blocks recorded)."""
        load, self._load = self._load, None
        if load is not None:
            load.wait()

    def _fetch(self, loads: list[ChunkTransfer]) -> list[tuple[Any, torch.Tensor]]:
        """Read ``loads``' chunks from the store and check them: the moves ``(plan, kv)`` with
        ``kv`` ``[num_layers, 2, n, num_kv_heads, head_dim]`` of the tokens to write. A
        missing or unusable chunk, a store error or a deadline marks the blocks from there on
        as failed (the later chunks of that transfer are not written)."""
        paged = self.ensure_layout()
        moves: list[tuple[Any, torch.Tensor]] = []
        failed: set[str] = set()    # requests whose load stopped: later transfers not read
        for t in loads:
            C = t.ns.layout.chunk_size
            tail = t.ns.layout != self.layout
            if t.request_id in failed:
                self._fail(t, t.start, count=False)
                continue
            if not self._fetch_one(t, paged, C, tail, moves):
                failed.add(t.request_id)
        return moves

    def _fetch_one(self, t: ChunkTransfer, paged: PagedLayout | None, C: int, tail: bool,
                   moves: list[tuple[Any, torch.Tensor]]) -> bool:
        """``_fetch`` of one transfer (chunk size ``C``; ``tail``: tail pieces), appending
        to ``moves``; False when it stopped short (its blocks from there on marked failed)."""
        if paged is None:
            self._fail(t, t.start)
            return False
        try:
            chunks = self.calls(self.calls.store.get_chunks, t.ns, t.keys)
        except Exception as e:
            self.calls.warn("load", "kvstore load of %s failed (%r); recomputing", t.request_id,
                            e)
            self._fail(t, t.start)
            return False
        self.calls.recovered("load")
        n_tok, ok = 0, True
        for i, kv in enumerate(chunks):
            c0 = (t.first_chunk + i) * C
            lo, hi = max(t.start, c0), min(t.end, c0 + C)
            if kv is None:
                self._fail(t, lo)
                ok = False
                break
            try:
                t.ns.layout.validate(kv)
                moves.append((paged.plan(self._slots(t, lo, hi)), kv[:, :, lo - c0:hi - c0]))
            except Exception as e:
                log.warning("kvstore chunk of %s unusable (%s); recomputing", t.request_id, e)
                self._fail(t, lo)
                ok = False
                break
            n_tok += hi - lo
            self.counters.add(**{"loaded_tail_chunks" if tail else "loaded_chunks": 1})
        self.counters.add(loads=1, loaded_tokens=n_tok)
        return ok

    def _scatter_layer(self, moves: list[tuple[Any, torch.Tensor]], layer: int) -> None:
        """Write layer ``layer`` of every move into that layer's paged cache."""
        paged, cache = self.paged, self._caches[layer]
        for plan, kv in moves:
            paged.scatter(cache, plan, kv[layer])

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        with self._fail_lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    # ---- saves -----------------------------------------------------------------------------
    def save(self, saves: list[ChunkTransfer]) -> None:
        """Gather ``saves``' chunks out of the paged caches and queue them for the writer; a
        save the queue cannot take is dropped and counted (``dropped_saves``, in chunks); one
        of a layout the daemon cannot take a chunk of (``check_chunk_limit``) is skipped, one
        ``save_errors`` each."""
        if self._skipped:
            kept = [t for t in saves if t.ns.layout not in self._skipped]
            self.counters.add(save_errors=len(saves) - len(kept))
            saves = kept
        if not saves:
            return
        paged = self.ensure_layout()
        if paged is None:
            return
        caches = list(self.kv_caches.values())
        for t in saves:
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
                self.counters.add(save_errors=1)
                continue
            self.counters.add(save_copy_s=time.perf_counter() - t0)
            nbytes = sum(kv.numel() * kv.element_size() for kv in kvs)
            if not self.saves.try_reserve(nbytes):
                self.counters.add(dropped_saves=len(t.keys))
                continue
            parents = None if t.parent is None else chain_parents(t.keys, t.parent)
            then = None if t.supersedes is None else (lambda stored, t=t: self._demote(t, stored))
            self.saves.submit(t.ns, t.keys, kvs, nbytes, parents, then)

    def _demote(self, t: ChunkTransfer, stored: int) -> None:
        """Writer thread, after ``t``'s chunks were put: demote the tail pieces they cover
        (``connectors.save_queue.demote_superseded``); a failure is counted
        (``demote_errors``) and logged, never raised."""
        try:
            n = demote_superseded(self.calls.store, t.ns, t.keys, stored, t.supersedes,
                                  self.calls)
            self.counters.add(demoted_tail_chunks=n)
        except Exception as e:  # noqa: BLE001 - a lost demotion only costs room, later
            self.calls.warn("demote", "kvstore tail demote of %s failed (%r)", t.request_id, e)
            self.counters.add(demote_errors=1)

    def _put(self, ns: Namespace, keys: list[ChunkKey], kvs: list[torch.Tensor],
             *parents: Any) -> int:
        """The writer's ``put_chunks``; counts the chunks written (``saved_chunks`` or, in a
        tail namespace, ``saved_tail_chunks``: stored now or before) when the put succeeds,
        and those the store refused (``refused_chunks``: parent missing or no room, as a
        daemon's ``PutResult.refused`` says, or an in-process store's ``exists`` after the
        put, ``connectors.put_answer.checked_put``; the chunks after a refused one are refused
        too)."""
        stored = self.calls(self.calls.store.put_chunks, ns, keys, kvs, *parents)
        try:   # an in-process store answers a plain count: ask which chunks it refused
            stored = checked_put(self.calls.store, ns, keys, stored, *parents, call=self.calls)
        except Exception as e:  # noqa: BLE001 - the put succeeded; only the split is lost
            log.debug("kvstore exists after a put failed (%s)", e)
        refused = getattr(stored, "refused", None) or 0   # (None: a store that does not say)
        which = "saved_tail_chunks" if ns.layout != self.layout else "saved_chunks"
        self.counters.add(**{which: len(keys) - refused, "refused_chunks": refused})
        if refused and isinstance(stored, LocalPutResult):   # one WARNING names the tiers
            log_local_refusal(log, self._refusals_told, self.calls.store, ns,
                              "tail save" if which == "saved_tail_chunks" else "save", stored)
        return stored

    def _saved(self, ns: Namespace, stored: int | None, seconds: float,
               error: Exception | None) -> None:
        if isinstance(error, ChunkTooLarge):   # (nothing was sent)
            self.counters.add(save_errors=1)
            self._too_large(ns, error.nbytes, error.max_body_bytes)
        elif error is not None:
            self.calls.warn("save", "kvstore put failed (%r)", error)
            self.counters.add(save_errors=1)
        else:
            self.calls.recovered("save")
            self.counters.add(save_s=seconds)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued saves are written. False on timeout."""
        return self.saves.wait(timeout_s)

    def copied(self, req_ids: set[str]) -> None:
        """The last saves of the finished requests ``req_ids`` are copied out of the paged
        cache (or dropped): their blocks may be freed (``finished_sending``)."""
        self._copied |= req_ids

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """The requests of ``copied`` among ``finished_req_ids`` (vLLM's finished requests
        of this step, which hold every request whose last saves this step's metadata carried),
        reported once."""
        out = self._copied & set(finished_req_ids)
        self._copied -= out
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the load in flight, write queued saves (bounded wait), stop both threads."""
        self.finish_load()
        if self._loader is not None:
            self._loader.close(timeout_s)
        self.saves.close(timeout_s)

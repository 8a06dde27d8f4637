"""Worker side of the vLLM connector: the paged KV caches, loads scattered into them before the
forward pass, saves gathered out of them after it and written by the shared background writer
(``connectors.save_queue.SaveQueue``).
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

import torch

from kvstore.api import chain_parents
from kvstore.keys import ChunkKey, Namespace
from kvstore.layout import KVLayout

from connectors.save_queue import SaveQueue
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
    """

    def __init__(self, layout: KVLayout, layer_names: list[str], block_size: int,
                 num_blocks: int, calls: StoreCalls, counters: Counters, save_queue_bytes: int,
                 forward_context: Callable[[], dict[str, Any]]) -> None:
        self.layout, self.layer_names = layout, layer_names
        self.block_size, self.num_blocks = block_size, num_blocks
        self.calls, self.counters = calls, counters
        self._forward_context = forward_context
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.paged: PagedLayout | None = None
        self._layout_error: str | None = None
        self._failed_blocks: set[int] = set()
        self.saves = SaveQueue(self._put, save_queue_bytes, self._saved,
                               name="kvstore-vllm-saver")

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
    def _fail(self, t: ChunkTransfer, from_token: int) -> None:
        bs = self.block_size
        first, last = from_token // bs, (t.end - 1) // bs
        self._failed_blocks.update(t.block_ids[first:last + 1])
        self.counters.add(load_errors=1)

    def load(self, loads: list[ChunkTransfer]) -> None:
        """Scatter ``loads`` into the paged caches (synchronously). A missing chunk, a store
        error or a deadline marks the blocks of the remaining tokens as failed."""
        paged = self.ensure_layout()
        caches = list(self.kv_caches.values())
        for t in loads:
            t0 = time.perf_counter()
            C = t.ns.layout.chunk_size
            tail = t.ns.layout != self.layout
            if paged is None:
                self._fail(t, t.start)
                continue
            try:
                chunks = self.calls(self.calls.store.get_chunks, t.ns, t.keys)
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
                self.counters.add(**{"loaded_tail_chunks" if tail else "loaded_chunks": 1})
            self.counters.add(loads=1, loaded_tokens=n_tok, load_s=time.perf_counter() - t0)

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    # ---- saves -----------------------------------------------------------------------------
    def save(self, saves: list[ChunkTransfer]) -> None:
        """Gather ``saves``' chunks out of the paged caches and queue them for the writer; a
        save the queue cannot take is dropped and counted (``dropped_saves``, in chunks)."""
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
            self.saves.submit(t.ns, t.keys, kvs, nbytes, parents)

    def _put(self, ns: Namespace, keys: list[ChunkKey], kvs: list[torch.Tensor],
             *parents: Any) -> int:
        """The writer's ``put_chunks``; counts the chunks written (``saved_chunks`` or, in a
        tail namespace, ``saved_tail_chunks``) when the put succeeds."""
        stored = self.calls(self.calls.store.put_chunks, ns, keys, kvs, *parents)
        which = "saved_tail_chunks" if ns.layout != self.layout else "saved_chunks"
        self.counters.add(**{which: len(keys)})
        return stored

    def _saved(self, ns: Namespace, stored: int | None, seconds: float,
               error: Exception | None) -> None:
        if error is not None:
            log.warning("kvstore put failed (%s)", error)
            self.counters.add(save_errors=1)
        else:
            self.counters.add(save_s=seconds)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until queued saves are written. False on timeout."""
        return self.saves.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write queued saves (bounded wait) and stop the writer."""
        self.saves.close(timeout_s)

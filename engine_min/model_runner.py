"""Turns a SchedulerOutput into one batched forward pass over the paged KV pool.

Flat token order: ``[decode tokens | prefill chunk 1 | prefill chunk 2 | ...]`` where a
"decode" is any sequence computing exactly one token this step.

Connector seams (a ``connectors.base.KVConnectorBase``; ``connector=None`` skips them), around
the forward pass:
  ``connector.start_load_kv(sched_out, kv_cache)`` then ``connector.wait_for_load()`` before it
  (and before the inputs are built: a load that falls short moves ``num_computed_tokens`` back),
  ``connector.save(sched_out, kv_cache)`` after it (full blocks now computed may be stored).
A connector whose ``layerwise_load`` is true loads beside the forward pass instead: the inputs
are built as if every load lands, the model calls ``connector.wait_for_layer_load(i)`` in layer
``i`` before it touches its KV, and ``wait_for_load()`` runs after the pass (also when it
raises, so no copy outlives the step); the sequences whose load fell short (moved back to
what landed) are run again alone, their logits replacing the first pass's rows::

    start_load_kv | prepare | forward (wait 0, attn 0, ... wait L-1, attn L-1) | wait_for_load
                  | [forward again: the short loads' sequences, from what landed] | save

Device: every input tensor is built on the host (numpy / lists) and moved once to the KV pool's
device (``kv_cache.device``); the logits stay there (the sampler brings back token ids).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_min.model import AttentionMetadata, LlamaModel, PrefillSpan
from engine_min.scheduler import ScheduledSeq, SchedulerOutput
from kernels import ops

if TYPE_CHECKING:
    from connectors.base import KVConnectorBase


class ModelRunner:
    """Runs the model for scheduled sequences and returns logits of those that sample.

    Args:
        model: the decoder (its weights on ``kv_cache.device``).
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; its
            device is where the step's inputs are placed.
        block_size: tokens per block.
        connector: optional KV connector.
    """

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 connector: KVConnectorBase | None = None):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.device = kv_cache.device
        self.connector = connector

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host-built input tensor on the pool's device (the same tensor on CPU)."""
        return t.to(self.device)

    def _slots(self, item: ScheduledSeq) -> np.ndarray:
        """``[num_new]`` slot ids of the sequence's new tokens."""
        start = item.seq.num_computed_tokens
        pos = np.arange(start, start + item.num_new_tokens)
        table = np.asarray(item.seq.block_table, dtype=np.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, items: list[ScheduledSeq]):
        """Inputs for ``items`` ordered decodes first, on the pool's device.

        Returns:
            (ordered items, input_ids [T], positions [T], AttentionMetadata,
            logits_indices [n_sample] int64 flat index of each sampling sequence's last token).
        """
        decodes = [it for it in items if it.num_new_tokens == 1]
        prefills = [it for it in items if it.num_new_tokens > 1]
        ordered = decodes + prefills
        ids, pos, slots, sample_idx = [], [], [], []
        spans, t = [], 0
        for it in ordered:
            s, n = it.seq.num_computed_tokens, it.num_new_tokens
            ids.extend(it.seq.token_ids[s:s + n])
            pos.append(np.arange(s, s + n))
            slots.append(self._slots(it))
            if n > 1:
                table = self._on_device(torch.tensor(it.seq.block_table, dtype=torch.long))
                spans.append(PrefillSpan(t, t + n, table, s + n))
            t += n
            if it.samples:
                sample_idx.append(t - 1)
        slot_mapping = self._on_device(torch.from_numpy(np.concatenate(slots)))  # [T] int64
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode=len(decodes),
                                 prefills=spans)
        if decodes:
            width = max(len(it.seq.block_table) for it in decodes)
            tables = [it.seq.block_table + [0] * (width - len(it.seq.block_table)) for it in decodes]
            meta.decode_block_tables = self._on_device(torch.tensor(tables, dtype=torch.long))
            meta.decode_context_lens = self._on_device(torch.tensor(
                [it.seq.num_computed_tokens + 1 for it in decodes], dtype=torch.long))
        return (ordered, self._on_device(torch.tensor(ids, dtype=torch.long)),
                self._on_device(torch.from_numpy(np.concatenate(pos))), meta,
                self._on_device(torch.tensor(sample_idx, dtype=torch.long)))

    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Run one step.

        Returns:
            (items in execution order, float32 logits ``[n_sample, vocab]`` on the pool's
            device, of the items whose ``samples`` is true, in that order).
        """
        ops.copy_blocks(self.kv_cache, [s for s, _ in sched_out.blocks_to_copy],
                        [d for _, d in sched_out.blocks_to_copy])
        conn = self.connector
        if conn is not None and conn.layerwise_load:
            ordered, logits = self._forward_layerwise(sched_out, conn)
        else:
            if conn is not None:
                conn.start_load_kv(sched_out, self.kv_cache)
                conn.wait_for_load()
            ordered, logits = self._forward(sched_out.scheduled)
        if conn is not None:
            conn.save(sched_out, self.kv_cache)
        return ordered, logits

    def _forward(self, items: list[ScheduledSeq], layer_ready=None
                 ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """One forward pass of ``items``: (items in execution order, their sampling rows'
        float32 logits ``[n_sample, vocab]``); ``layer_ready`` as ``LlamaModel.forward``."""
        ordered, input_ids, positions, meta, sample_idx = self.prepare(items)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, layer_ready)  # [T, hidden]
        return ordered, self.model.compute_logits(hidden[sample_idx])      # [n_sample, vocab]

    def _forward_layerwise(self, sched_out: SchedulerOutput, conn: KVConnectorBase
                           ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """The forward pass beside the connector's layer-wise loads (module docstring)."""
        conn.start_load_kv(sched_out, self.kv_cache)
        try:
            ordered, logits = self._forward(sched_out.scheduled, conn.wait_for_layer_load)
        finally:
            results = conn.wait_for_load()
        short = {r.request_id for r in results if not r.ok}
        redo = [it for it in ordered if it.seq.request_id in short]
        if not redo:
            return ordered, logits
        # the short loads' sequences now start at what landed: compute the rest again
        rows = {id(it): k for k, it in enumerate(x for x in ordered if x.samples)}
        again, again_logits = self._forward(redo)
        for it, row in zip((x for x in again if x.samples), again_logits):
            logits[rows[id(it)]] = row
        return ordered, logits

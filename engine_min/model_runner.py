"""Turns a SchedulerOutput into one batched forward pass over the paged KV pool.

Flat token order: ``[decode tokens | prefill chunk 1 | prefill chunk 2 | ...]`` where a
"decode" is any sequence computing exactly one token this step.

Connector seams (a ``connectors.base.KVConnectorBase``; ``connector=None`` skips them), around
the forward pass:
  ``connector.start_load_kv(sched_out, kv_cache)`` then ``connector.wait_for_load()`` before it
  (and before the inputs are built: a load that falls short moves ``num_computed_tokens`` back),
  ``connector.save(sched_out, kv_cache)`` after it (full blocks now computed may be stored).

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
        if self.connector is not None:
            self.connector.start_load_kv(sched_out, self.kv_cache)
            self.connector.wait_for_load()
        ordered, input_ids, positions, meta, sample_idx = self.prepare(sched_out.scheduled)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # [T, hidden]
        logits = self.model.compute_logits(hidden[sample_idx])           # [n_sample, vocab]
        if self.connector is not None:
            self.connector.save(sched_out, self.kv_cache)
        return ordered, logits

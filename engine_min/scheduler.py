"""Continuous-batching scheduler: per-step token budget, chunked prefill, decode every step,
FCFS admission, preemption by recompute.

Each ``schedule()``:
  1. running sequences, decodes first then unfinished prefills, each get
     ``min(remaining, budget)`` tokens; when blocks run out the most recently admitted
     unscheduled sequence is preempted (blocks freed, back to the front of ``waiting``);
  2. if nothing was preempted, waiting sequences are admitted in arrival order while budget,
     ``max_num_seqs`` and blocks allow (prefix-cache hits first, then the connector's external
     tokens, then blocks for the rest). The first one that does not fit stops admission (FCFS).

Connector seams (a ``connectors.base.KVConnectorBase``; ``connector=None`` skips them), at
admission of a sequence:
  ``connector.get_num_new_matched_tokens(seq, num_local_computed) -> int | (int, bool)``
      extra prefix tokens loadable from an external store beyond the local hits;
  ``connector.update_state_after_alloc(seq, block_ids, num_external_tokens)``
      after its blocks are allocated (``block_ids`` = seq.block_table);
and ``connector.request_finished(seq, block_ids)`` before a finished sequence's blocks are freed.
A connector that raises costs one request at most: a lookup that raises counts as no external
tokens (a recompute), ``update_state_after_alloc`` that raises fails that request alone
(``SchedulerOutput.failed``; the engine finishes it with finish reason "error"), and
``request_finished`` that raises is logged while the blocks are freed all the same.

Prefix-cache counters (``BlockManager.record_query``): a request's lookup counts at its first
admission only; re-admissions after a preemption count apart (``num_preempted_*``).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_min.block_manager import BlockManager
from engine_min.sequence import SeqFailure, Sequence, SequenceStatus

if TYPE_CHECKING:
    from connectors.base import KVConnectorBase

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    """A sequence and the tokens it computes this step: ``[num_computed, num_computed + num_new)``."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's end, so a token is sampled after it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled: sequences and their token counts (admission/running order).
        blocks_to_copy: ``[(src, dst)]`` whole-block KV copies to run before the forward.
        preempted: sequences preempted this step (now waiting, blocks freed).
        num_external_tokens: request_id -> tokens the connector loads this step.
        failed: sequences that failed at admission (stage ``"admit"``): not scheduled, still
            holding their blocks until the engine finishes them.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_external_tokens: dict[str, int] = field(default_factory=dict)
    failed: list[SeqFailure] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Orders requests into steps (owns ``waiting`` and ``running``; blocks via BlockManager).

    Args:
        block_manager: the pool's block owner.
        max_num_batched_tokens: token budget per step.
        max_num_seqs: most running sequences.
        connector: optional KV connector (see module docstring), None by default.
    """

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int, connector: KVConnectorBase | None = None):
        self.bm = block_manager
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.connector = connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts (allocates their blocks)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._make_room(seq, seq.num_computed_tokens + n, out):
                out.blocks_to_copy += self.bm.allocate(seq, seq.num_computed_tokens + n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        if not out.preempted:
            budget = self._admit(budget, out)
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt the newest unscheduled running sequences until seq's blocks fit.

        Returns False when seq itself had to be preempted.
        """
        scheduled = {id(s.seq) for s in out.scheduled}
        while not self.bm.can_allocate(seq, num_tokens):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it back at the front of ``waiting`` (recompute later)."""
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.lookup(seq)
            num_local = min(len(hits) * self.bm.block_size, seq.num_tokens - 1)
            num_external = self._external_tokens(seq, num_local)
            computed = num_local + num_external
            n = min(seq.num_tokens - computed, budget)
            if not self.bm.can_allocate(seq, computed + n, hits):
                break
            self.waiting.popleft()
            self.bm.record_query(seq.num_tokens, num_local, seq.num_preemptions > 0)
            out.blocks_to_copy += self.bm.allocate(seq, computed + n, hits)
            seq.num_computed_tokens = computed
            seq.num_cached_tokens = computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if not self._connector_alloc(seq, num_local, num_external, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return budget

    def _external_tokens(self, seq: Sequence, num_local: int) -> int:
        """Tokens the connector can load beyond ``num_local`` (at least one token is left to
        compute); 0 when it raises (logged: a recompute, never a failure)."""
        if self.connector is None:
            return 0
        try:
            got = self.connector.get_num_new_matched_tokens(seq, num_local)
        except Exception:  # noqa: BLE001 - a store error costs a recompute
            logger.exception("connector lookup for %s raised; recomputing", seq.request_id)
            return 0
        n = got[0] if isinstance(got, tuple) else got
        return max(0, min(int(n or 0), seq.num_tokens - 1 - num_local))

    def _connector_alloc(self, seq: Sequence, num_local: int, num_external: int,
                         out: SchedulerOutput) -> bool:
        """Tell the connector about seq's blocks; False (seq in ``out.failed``, rewound to its
        ``num_local`` computed tokens so no unloaded KV is ever saved) when it raises."""
        if self.connector is None:
            return True
        try:
            self.connector.update_state_after_alloc(seq, list(seq.block_table), num_external)
        except Exception as exc:  # noqa: BLE001 - fails this request alone
            seq.num_computed_tokens = seq.num_cached_tokens = num_local
            out.failed.append(SeqFailure(seq, "admit", exc))
            return False
        out.num_external_tokens[seq.request_id] = num_external
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished, remove it from its queue and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.connector is not None:
            try:
                self.connector.request_finished(seq, list(seq.block_table))
            except Exception:  # noqa: BLE001 - the blocks are freed all the same
                logger.exception("connector request_finished for %s raised", seq.request_id)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

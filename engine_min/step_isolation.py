"""One engine step's forward pass with per-sequence fault isolation.

Policy when the batched forward (``ModelRunner.execute``: block copies, connector loads, the
model, the logits, connector saves) raises: the error cannot be pinned on one sequence, so each
scheduled sequence is run again alone, in the step's order. A sequence whose solo run raises
fails alone (stage ``"forward"``); the others go on with their solo results, which are the
tokens they compute in any batch. Running a sequence again is safe:

- it writes KV only into its own slots ``[num_computed_tokens, num_computed_tokens +
  num_new_tokens)``, never into a shared prefix-cached block (those lie before
  ``num_computed_tokens``), so its solo run overwrites whatever the failed batch left there;
- a block copy (copy-on-write of a fully hit last block) is re-run only for the sequence whose
  table holds its destination, and copies the same unchanged source;
- the connector loads a request's pending chunks once (a solo run finds none pending if the
  batch already loaded them) and saves only after a forward that succeeded.

When every solo run raises too (a broken model), every sequence of the step fails, each with
its own error, and the engine keeps serving. A step of one sequence is not re-run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine_min.scheduler import ScheduledSeq, SchedulerOutput
from engine_min.sequence import SeqFailure

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step's forward produced.

    Attributes:
        ordered: the items that computed, in execution order.
        logits: float32 ``[n_sample, vocab]``, one row per item of ``ordered`` whose
            ``samples`` is true, in that order; None when no row.
        failed: the sequences whose forward failed (not in ``ordered``).
    """

    ordered: list[ScheduledSeq]
    logits: torch.Tensor | None
    failed: list[SeqFailure] = field(default_factory=list)


def execute_isolated(runner, sched: SchedulerOutput) -> StepResult:
    """Run ``sched`` on ``runner`` (a ``ModelRunner``); if the batch raises, run each
    sequence alone (module docstring). Never raises for a forward error."""
    try:
        ordered, logits = runner.execute(sched)
        return StepResult(ordered, logits)
    except Exception as exc:  # noqa: BLE001 - isolated below
        if len(sched.scheduled) == 1:
            return StepResult([], None, [SeqFailure(sched.scheduled[0].seq, "forward", exc)])
        logger.warning("batched forward of %d sequences raised (%s: %s); running each alone",
                       len(sched.scheduled), type(exc).__name__, exc)
    ordered: list[ScheduledSeq] = []
    rows: list[torch.Tensor] = []
    failed: list[SeqFailure] = []
    for item in sched.scheduled:
        try:
            done, logits = runner.execute(_alone(sched, item))
        except Exception as exc:  # noqa: BLE001 - this sequence fails alone
            logger.error("forward of %s raised alone (%s: %s); failing it",
                         item.seq.request_id, type(exc).__name__, exc)
            failed.append(SeqFailure(item.seq, "forward", exc))
            continue
        ordered += done
        rows.append(logits)
    logits = torch.cat(rows) if rows else None
    return StepResult(ordered, logits, failed)


def _alone(sched: SchedulerOutput, item: ScheduledSeq) -> SchedulerOutput:
    """The part of ``sched`` that concerns ``item`` alone."""
    table = set(item.seq.block_table)
    rid = item.seq.request_id
    return SchedulerOutput(
        scheduled=[item],
        blocks_to_copy=[(s, d) for s, d in sched.blocks_to_copy if d in table],
        num_external_tokens={rid: sched.num_external_tokens[rid]}
        if rid in sched.num_external_tokens else {})

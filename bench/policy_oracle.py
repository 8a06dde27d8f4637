"""An admission filter that knows the future: a bound on what admission alone can add.

``ReuseOracle`` admits a chunk into a full tier only if a later row of the trace reads it
again (whatever the victim). It is not a policy anyone can run; replayed in front of a real
policy (``python -m bench.policy_sim --admission oracle``: curves ``POLICY+oracle``) it
splits a policy's distance from Belady's bound into the part that comes from storing chunks
that are never read again (what perfect admission removes) and the part that comes from the
policy's order (what is left). A refusal ends the row, as any filter's does
(``bench.policy_replay``); a chunk never read again has no descendant read again either (a
row that reads a chunk reads its parent first), so the oracle loses no hit by that.

It takes the filters' calls (``kvstore.eviction.admission.TinyLFU``): ``record`` /
``record_many`` once per access in trace order (the replay does so at the start of each
row: that is how the oracle knows the row being served), ``fit`` and ``admit``.
"""
from __future__ import annotations

from collections.abc import Iterable

from bench.policy_trace import ChunkTrace

#: the admission name that selects ``ReuseOracle`` (``PolicyReplay``, ``bench.policy_sim``)
ORACLE = "oracle"


class ReuseOracle:
    """Admit ``candidate`` iff a row after the current one reads it (see the module docstring).

    Args:
        trace: the trace being replayed, whose accesses are recorded in order.
    """

    def __init__(self, trace: ChunkTrace) -> None:
        self._last_row: dict[int, int] = {}
        start = trace.start
        keys = trace.keys
        for r in range(trace.num_rows):
            self._last_row.update(dict.fromkeys(keys[start[r]:start[r + 1]], r))
        self._row_ends = start[1:]
        self._recorded = 0  # accesses recorded so far
        self._row = -1  # the row of the last access recorded

    def _advance(self) -> None:
        ends, row = self._row_ends, self._row
        while row + 1 < len(ends) and (row < 0 or ends[row] < self._recorded):
            row += 1
        self._row = row

    def record(self, key: int) -> None:
        """One access, in trace order."""
        self._recorded += 1
        self._advance()

    def record_many(self, keys: Iterable[int]) -> None:
        """Accesses in trace order (a row's chunks)."""
        self._recorded += len(keys) if hasattr(keys, "__len__") else sum(1 for _ in keys)
        self._advance()

    def fit(self, num_keys: int) -> None:
        """Nothing to size (the filters' call)."""

    def admit(self, candidate: int, victim: int) -> bool:
        """Whether a later row reads ``candidate`` (``victim`` is not consulted)."""
        return self._last_row.get(candidate, -1) > self._row

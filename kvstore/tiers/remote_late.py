"""Keys of the remote tier lost to a node's lateness: a node whose answers were not in by a
call's deadline (``kvstore.tiers.redis_nodes.RedisNodes.run``) costs misses for its keys. That
is counted per key (``kvstore_remote_late_total{op}``, ``late`` in the tier's stats) and logged
at WARNING once per node and cause (``kvstore.cause_log.CauseLog``: a lookup's lateness and a
get's are two causes), again only after the node answered a call in time, which is logged once
at INFO. Only the network wait counts against a deadline: decoding and checking values that
came in time runs after it, so a late key is a slow network or a slow Redis, never slow
decoding on this host."""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from kvstore.cause_log import CauseLog
from kvstore.tiers.redis_nodes import RedisNodes
from kvstore.tiers.remote_metrics import RemoteMetrics

#: the operations whose late keys are counted (the ``op`` label of ``late_total``)
LATE_OPS = ("lookup", "get")


class LateNodes:
    """Counts and logs the keys that nodes answered after a call's deadline. Thread-safe.

    Args:
        metrics: the tier's metrics (counter ``late``, label ``op``).
        logger: where the WARNING and INFO lines go.

    Attributes:
        causes: the warnings' ``CauseLog`` (one kind per node).
    """

    def __init__(self, metrics: RemoteMetrics, logger: logging.Logger) -> None:
        self.metrics = metrics
        self.causes = CauseLog(
            logger, "remote tier: node %s answers within the deadline again (%d late calls "
            "since it last did)", " (logged once per node and cause until it answers in time)")

    def run(self, nodes: RedisNodes, op: str, groups: dict, where: Sequence[tuple[str | None, int]],
            deadline_s: float, post: Callable[[str, list], list] | None = None) -> dict:
        """``nodes.run(groups, now + deadline_s, post)``, then ``settle`` its late nodes.

        Returns:
            node -> results or None, as ``RedisNodes.run`` returns them.

        Raises:
            ValueError: ``op`` not one of ``LATE_OPS``.
        """
        late: set[str] = set()
        results = nodes.run(groups, time.monotonic() + deadline_s, post, late=late)
        self.settle(op, results, late, where, deadline_s)
        return results

    def settle(self, op: str, results: dict, late: set[str],
               where: Sequence[tuple[str | None, int]], deadline_s: float) -> None:
        """After one call: count and warn about each ``late`` node's keys, and end the
        lateness of the nodes that answered.

        Args:
            op: ``"lookup"`` or ``"get"``.
            results: node -> results or None, as ``RedisNodes.run`` returned them.
            late: the nodes ``RedisNodes.run`` found late.
            where: per key of the call, ``(node, index)`` (``RemoteTier._group``).
            deadline_s: the call's deadline in seconds (for the line).

        Raises:
            ValueError: ``op`` not one of ``LATE_OPS``.
        """
        if op not in LATE_OPS:
            raise ValueError(f"late keys are counted for {LATE_OPS}, got {op!r}")
        for node in late:
            n = sum(1 for nd, _ in where if nd == node)
            self.metrics.inc("late", n, label=op)
            self.causes.warn(
                node, "remote tier: node %s did not answer a %s of %d keys within its "
                "%.3f s deadline; those keys miss (counted in kvstore_remote_late_total: a slow "
                "network or an overloaded Redis; --remote-timeout-s sets the deadline)",
                node, op, n, deadline_s)
        for node, res in results.items():
            if res is not None and node not in late:
                self.causes.recovered(node)

"""Noticing that a Redis node of the remote tier restarted (and may have come back empty).

Every store writes a chunk to Redis once, when it newly stores it (write-behind). A Redis
node that restarts without its data loses every chunk on it, and nothing writes them again:
the chunks a host still holds locally are served from its own tiers, so they are never newly
stored there, and the other hosts miss them until they recompute them. The hottest chunks (a
shared system prompt) are exactly the ones that stay local forever.

``RestartWatch`` asks each master ``INFO server`` every ``check_s`` seconds (a background
thread) and compares its ``run_id``, which a Redis process draws at start: a new ``run_id``
on a node seen before means a restart, and ``on_restart(node)`` is called (the store then
writes what Redis lacks of what it holds: ``kvstore.republish``). A node that does not answer
is skipped (its breaker and outage log tell that story), as is any error asking it (the watch
never stops on one); a node that answers but refuses ``INFO`` (an ACL, a proxy) or gives no
``run_id`` is named in one WARNING line: its restarts go unnoticed. A master seen for the first
time at the first check (the store opening) is only recorded; one first seen later (it did not
answer before, a replica promoted in a failover, a node replaced at a new address) is handled
as a restart: the store's pass only asks a master that kept or replicated its data. A restart
is noticed only if the watch sees the node on both sides of it or the node is new to it:
within ``check_s`` of the node answering again, not while the store is closed.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from redis.exceptions import ResponseError

log = logging.getLogger("kvstore.tiers.remote")

#: default seconds between two checks of every master's ``run_id``
DEFAULT_CHECK_S = 10.0


class RestartWatch:
    """Calls ``on_restart(node)`` when a master's ``run_id`` changes (module docstring).

    Args:
        primaries: the masters' names now (``RedisNodes.primaries``).
        client: a node's ``redis.Redis`` (``RedisNodes.client``).
        check_s: seconds between checks (> 0, finite); the first check runs at once.
        on_restart: called on the watch's thread, once per restart noticed; its errors are
            logged, never raised.

    Raises:
        ValueError: ``check_s`` not a positive finite number.
    """

    def __init__(self, primaries: Callable[[], list[str]], client: Callable[[str], object],
                 check_s: float, on_restart: Callable[[str], None]) -> None:
        if not 0 < check_s < float("inf"):
            raise ValueError(f"restart check interval must be > 0 seconds, got {check_s!r}")
        self._primaries, self._client, self.check_s = primaries, client, float(check_s)
        self.on_restart = on_restart
        self.run_ids: dict[str, str] = {}  # node -> the run_id last seen
        self._refused: set[str] = set()  # nodes that refused INFO (warned once)
        self._checks = 0  # checks done (with the list of masters)
        self._lock = threading.Lock()  # (one check at a time: the thread's, a caller's)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstore-remote-restart",
                                        daemon=True)
        self._thread.start()

    def check(self) -> list[str]:
        """Ask every master its ``run_id`` now; returns the nodes found restarted (each
        already passed to ``on_restart``)."""
        with self._lock:
            return self._check()

    def _check(self) -> list[str]:
        restarted = []
        try:
            nodes = self._primaries()
        except Exception as e:  # (RedisError; anything else must not end the watch either)
            log.debug("remote tier: restart check: no master list: %r", e)
            return []
        for node in nodes:
            if self._stop.is_set():
                break
            try:
                run_id = str(self._client(node).info("server")["run_id"])
            except (ResponseError, KeyError) as e:  # it answers, but not this: say so once
                if node not in self._refused:
                    self._refused.add(node)
                    log.warning("remote tier: node %s does not tell its run_id (INFO server: "
                                "%r); a restart of it that loses its data goes unnoticed, "
                                "and its chunks come back only as they are stored anew",
                                node, e)
                continue
            except Exception as e:  # down or late (the breaker's business), or a node the
                log.debug("remote tier: restart check of %s: %r", node, e)  # topology lost
                continue
            before = self.run_ids.get(node)
            self.run_ids[node] = run_id
            if before is None and self._checks:  # (not at the first check: the store opens)
                log.info("remote tier: node %s answers for the first time (run_id %s...): "
                         "it may have come back empty", node, run_id[:8])
            elif before is None or before == run_id:
                continue
            else:
                log.info("remote tier: node %s restarted (run_id %s... -> %s...)", node,
                         before[:8], run_id[:8])
            restarted.append(node)
            try:
                self.on_restart(node)
            except Exception:
                log.exception("remote tier: handling the restart of node %s failed", node)
        self._checks += 1
        return restarted

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.check_s)

    def close(self) -> None:
        """Stop the thread (waits for a check in progress)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

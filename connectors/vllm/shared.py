"""What the scheduler side and the worker side of the vLLM connector share: the store with its
per-call deadline, the counters, and the warnings about failing store calls. Importable without
vLLM.

Warnings (``StoreCalls.warn``, ``kvstore.cause_log.CauseLog``) are logged once per kind of
operation (lookup, pin, load, save, demote) *and cause*, and again only after that kind worked
(``StoreCalls.recovered``: one INFO line then); each failure is counted in the connector's
counters (``lookup_errors``, ``load_errors``, ``save_errors``...). A call the daemon's circuit
breaker skipped (``RemoteSkipped``) is counted, not logged: the breaker logged the failure that
opened it.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from kvstore.api import KVStoreBase
from kvstore.cause_log import CauseLog
from kvstore.circuit_store import RemoteSkipped

log = logging.getLogger("kvstore.connectors.vllm")

#: Counters of a connector (``KVStoreConnector.stats``), all starting at 0.
COUNTER_NAMES = (
    "lookups", "lookup_errors", "hit_tokens", "local_tokens", "external_tokens", "loads",
    "loaded_chunks", "loaded_tokens", "load_errors", "load_s", "saved_chunks", "save_errors",
    "dropped_saves", "save_copy_s", "save_s", "loaded_tail_chunks", "saved_tail_chunks",
    "demoted_tail_chunks", "demote_errors", "refused_chunks")


class Counters:
    """Named counters (tokens, chunks, errors, seconds) added to from several threads.

    Attributes:
        values: name -> value; read it directly for a quick look, ``snapshot`` for a
            consistent copy.
    """

    def __init__(self) -> None:
        self.values: dict[str, float] = {k: 0 for k in COUNTER_NAMES}
        self._lock = threading.Lock()

    def add(self, **kw: float) -> None:
        """Add each given amount to its counter.

        Raises:
            KeyError: an unknown counter name.
        """
        with self._lock:
            for k, v in kw.items():
                self.values[k] += v

    def snapshot(self) -> dict[str, float]:
        """A copy of every counter, taken at once."""
        with self._lock:
            return dict(self.values)


class StoreCalls:
    """The connector's store and how to call it before or during a forward pass.

    Args:
        store: the store.
        remote: ``store`` is the daemon's client: each call gets ``timeout_s=timeout_s``.
        timeout_s: deadline of each call (s).
    """

    def __init__(self, store: KVStoreBase, remote: bool, timeout_s: float) -> None:
        self.store, self.remote, self.timeout_s = store, remote, timeout_s
        self._causes = CauseLog(log, "kvstore connector: %s works again (%d failures since "
                                     "it last worked)")

    def warn(self, kind: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at WARNING unless this ``kind`` already logged the same cause
        (the first exception in ``args``) and has not recovered since (module docstring); a
        ``RemoteSkipped`` is only counted. Returns whether it logged."""
        cause = next((a for a in args if isinstance(a, BaseException)), None)
        if isinstance(cause, RemoteSkipped):   # the breaker logged why it is open
            self._causes.failed(kind)
            return False
        return self._causes.warn(kind, msg, *args, cause=cause)

    def recovered(self, kind: str) -> None:
        """A ``kind`` call succeeded: its causes may be logged again (one INFO line when one
        had been)."""
        self._causes.recovered(kind)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, with the deadline when the store is remote. Raises what ``fn``
        raises."""
        if self.remote:
            return fn(*args, timeout_s=self.timeout_s)
        return fn(*args)

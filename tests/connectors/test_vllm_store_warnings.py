"""The vLLM connector's store-call warnings (``connectors.vllm.shared.StoreCalls.warn``): once
per kind and cause, a breaker's skipped call counted and never logged, logged anew after the
kind worked again. Needs no vLLM."""
from __future__ import annotations

import logging

from connectors.vllm.shared import StoreCalls
from kvstore.circuit_store import CircuitBreakerStore, RemoteSkipped
from kvstore.errors import RemoteError, StoreUnavailable

LOGGER = "kvstore.connectors.vllm"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Hung:
    """A daemon client whose lookups time out until ``up`` is set."""

    url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.up, self.calls = False, 0

    def lookup_keys(self, ns, keys):
        self.calls += 1
        if not self.up:
            raise StoreUnavailable("POST /v1/lookup: no answer within 2.0 s")
        return "answer"

    def close(self) -> None:
        pass


def _lookup(calls: StoreCalls) -> str | None:
    """What the scheduler side does: a call, a warning on failure, recovered on success."""
    try:
        out = calls(calls.store.lookup_keys, None, [])
    except Exception as e:  # noqa: BLE001
        calls.warn("lookup", "kvstore lookup failed (%r); prefilling", e)
        return None
    calls.recovered("lookup")
    return out


def _lines(caplog, level=logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_a_hung_daemon_is_warned_once_and_its_skipped_calls_only_counted(caplog):
    clock, remote = Clock(), Hung()
    breaker = CircuitBreakerStore(remote, clock=clock)
    calls = StoreCalls(breaker, remote=False, timeout_s=2.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert [_lookup(calls) for _ in range(5)] == [None] * 5
        assert remote.calls == 1 and breaker.skipped_calls == 4   # one timeout, then skipped
        lines = _lines(caplog)
        assert len(lines) == 1 and "StoreUnavailable" in lines[0], lines
        clock.t += 2.5                      # the cool-down ended: a probe, the daemon is back
        remote.up = True
        assert _lookup(calls) == "answer" and remote.calls == 2
        assert _lines(caplog, logging.INFO) == [
            "kvstore connector: lookup works again (5 failures since it last worked)"]
        remote.up = False   # the same cause soon after a recovery: held back (relog_interval_s)
        assert _lookup(calls) is None
        assert len(_lines(caplog)) == 1
        calls.warn("lookup", "kvstore lookup failed (%r)", RemoteError(503, "draining"))
    assert len(_lines(caplog)) == 2                 # a new cause is never held back


def test_each_kind_and_cause_is_warned_once():
    calls = StoreCalls(object(), remote=False, timeout_s=1.0)
    refused = ConnectionRefusedError("connection refused")
    assert calls.warn("save", "put failed (%r)", refused)
    assert not calls.warn("save", "put failed (%r)", ConnectionRefusedError("connection refused"))
    assert calls.warn("load", "load failed (%r)", refused)          # another kind
    assert calls.warn("save", "put failed (%r)", RemoteError(500, "disk full"))   # another cause
    assert not calls.warn("save", "put failed (%r)", RemoteSkipped("skipped"))    # counted only

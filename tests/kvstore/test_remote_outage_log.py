"""A dead Redis node of the remote tier is logged when its circuit breaker opens, then at most
once per ``down_relog_s`` (10 min) while its trial calls keep failing (each failed trial, one
per ``breaker_reset_s`` = 5 s, reopens the breaker and used to log a WARNING), and once at INFO
when it answers again; the same scheme as ``CircuitBreakerStore`` for a dead daemon. The tier
starts against a real ``redis-server`` (it refuses to start without one), which is then killed
(its port closed, nobody listening) and later started again on the same port; the breakers'
clock is the test's."""
import logging
import re

import pytest

from kvstore.cause_log import OutageLog
from kvstore.tiers.remote import RemoteTier
from tests.kvstore.remote_helpers import NS, count, prompt
from tests.redis_fixtures import redis_server  # noqa: F401

LOGGER = "kvstore.tiers.remote"


def _lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_a_dead_node_logs_once_then_every_10_minutes_then_once_when_back(redis_server, caplog):
    now = [1000.0]
    tier = RemoteTier(redis_server.url, timeout_s=2.0, breaker_threshold=3,
                      breaker_reset_s=5.0, clock=lambda: now[0])
    node = f"127.0.0.1:{redis_server.port}"
    keys, _ = prompt(NS, 0, 1)
    try:
        assert tier.lookup(keys) == [False]                  # it answers: breaker closed
        with caplog.at_level(logging.INFO, logger=LOGGER):
            redis_server.kill()                              # the port is closed now
            for _ in range(25 * 60):                         # a lookup per second, 25 minutes
                assert tier.lookup(keys) == [False]
                now[0] += 1.0
            warn = _lines(caplog, logging.WARNING)
            # opened at t=1002 (3rd failure), then a failed trial every 5 s until t=2497
            assert count(tier, "breaker_opens", node) == 300
            assert len(warn) == 3, warn[:5]                  # down; still down at 10 and 20 min
            assert re.fullmatch(
                rf"remote tier: node {node} is down \(3 calls failed in a row, the last: "
                rf"ConnectionError: .+\); its keys miss, and one call every 5\.0 s tries it "
                rf"\(circuit breaker open; logged again at most every 600 s while it stays "
                rf"down\)", warn[0]), warn[0]
            assert [re.sub(r"the last: .*\)", "the last: X)", w) for w in warn[1:]] == [
                f"remote tier: node {node} still down after 600 s (123 failed calls, the last: "
                f"X); its keys miss",
                f"remote tier: node {node} still down after 1200 s (243 failed calls, the "
                f"last: X); its keys miss"]
            assert _lines(caplog, logging.INFO) == []

            redis_server.restart()                           # same port, answers again
            now[0] += 5.0                                    # past the pause: a trial call
            assert tier.lookup(keys) == [False]
            assert tier.nodes.breaker_states() == {node: "closed"}
            assert tier.lookup(keys) == [False]
            assert _lines(caplog, logging.INFO) == [
                f"remote tier: node {node} answers again (down 1503.0 s, 302 failed calls; "
                f"circuit breaker closed)"]
            assert len(_lines(caplog, logging.WARNING)) == 3

            redis_server.kill()                              # a new outage is logged at once
            for _ in range(3):
                assert tier.lookup(keys) == [False]
                now[0] += 1.0
            warn = _lines(caplog, logging.WARNING)
            assert len(warn) == 4 and warn[3].startswith(f"remote tier: node {node} is down "
                                                         f"(3 calls failed in a row")
    finally:
        tier.close(flush_timeout=1.0)


def test_outage_log_says_which_line_each_failure_and_the_recovery_log():
    now = [0.0]
    out = OutageLog(relog_s=600.0, clock=lambda: now[0])
    assert out.recovered() is None and not out.down          # no outage: nothing to log
    lines = []
    for t in range(0, 1300, 5):                              # a failure every 5 s
        now[0] = float(t)
        lines.append((t, out.failed()))
    assert [(t, x) for t, x in lines if x is not None] == [(0, "down"), (600, (600.0, 121)),
                                                           (1200, (1200.0, 241))]
    now[0] = 1210.0
    assert out.failed(failures=500) is None                  # the caller's own count
    now[0] = 1300.0
    assert out.down and out.recovered() == (1300.0, 500) and not out.down
    assert out.recovered() is None
    now[0] = 1301.0
    assert out.failed() == "down"                            # a new outage, at once
    with pytest.raises(ValueError, match="relog_s > 0"):
        OutageLog(relog_s=0)

"""A dead daemon behind ``CircuitBreakerStore`` is logged when the breaker opens, then at most
once per ``down_relog_s`` (10 min) while its probes keep failing (each failed probe, one per
cool-down of up to 30 s, used to log a WARNING), and once at INFO when it answers again. A
real client against a closed port, then a real server on that port; the breaker's clock is
the test's."""
import logging
import re
import socket

import pytest

from kvstore.daemon.client import KVStoreClient, StoreUnavailable
from kvstore.daemon.server import ServerLimits, ThreadedServer, create_app
from kvstore.layered import CircuitBreakerStore
from tests.kvstore.daemon.server_helpers import KEYS, NS, chunk, make_store


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvstore.layered" and r.levelno == level]


def _down_for(br: CircuitBreakerStore, now: list, seconds: float, step: float = 10.0) -> None:
    """A call every ``step`` s of the breaker's clock: skipped, or a probe that is refused."""
    for _ in range(int(seconds / step)):
        with pytest.raises(StoreUnavailable):
            br.exists(NS, KEYS[:1])
        now[0] += step


def _breaker_on_a_closed_port() -> tuple[int, str, list, CircuitBreakerStore]:
    """(port, url, the breaker's clock as ``[now]``, the breaker) of a client of a port
    nobody listens on."""
    port = _closed_port()
    url = f"http://127.0.0.1:{port}"
    now = [1000.0]
    client = KVStoreClient(url, timeout_s=2.0, same_host=False)
    return port, url, now, CircuitBreakerStore(client, cooldown_s=2.0, max_cooldown_s=30.0,
                                               clock=lambda: now[0])


def test_a_dead_daemon_logs_once_then_every_10_minutes_then_once_when_back(caplog):
    port, url, now, br = _breaker_on_a_closed_port()
    srv = None
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.layered"):
            _down_for(br, now, 25 * 60)          # 25 minutes down
            warn = _lines(caplog, logging.WARNING)
            assert br.trips >= 45                # one failed probe per cool-down (<= 30 s)
            assert len(warn) == 3, warn          # it went down; still down at 10 and 20 min
            assert warn[0].startswith(f"remote store {url} exists failed (StoreUnavailable: ")
            assert "skipping it for 2.0 s, then probing it (a failed probe is logged at " \
                   "most every 600 s)" in warn[0]
            downs = [re.match(rf"remote store {re.escape(url)} still down after (\d+) s \((\d+) "
                              rf"failed calls since the first; the last, exists: "
                              rf"StoreUnavailable: .*\); skipping it for 30.0 s$", w)
                     for w in warn[1:]]
            assert all(downs), warn
            secs = [int(m.group(1)) for m in downs]
            assert 600 <= secs[0] <= 640 and 1200 <= secs[1] <= 1240, secs
            assert _lines(caplog, logging.INFO) == []

            srv = ThreadedServer(create_app(make_store(), ServerLimits()), port=port)
            now[0] += 30.0                        # past the cool-down: the probe succeeds
            assert br.exists(NS, KEYS[:1]) == [False] and not br.is_open
            assert br.put_chunks(NS, KEYS[:1], [chunk(0)]) == 1
            info = _lines(caplog, logging.INFO)
            assert len(info) == 1, info
            m = re.fullmatch(rf"remote store {re.escape(url)} answers again \(down (\d+)\.\d "
                             rf"s, (\d+) failed calls\)", info[0])
            assert m and 1530 <= int(m.group(1)) <= 1560 and int(m.group(2)) == br.trips
            assert len(_lines(caplog, logging.WARNING)) == 3

            srv.stop()                            # a new outage is logged at once
            srv = None
            _down_for(br, now, 60)
            warn = _lines(caplog, logging.WARNING)
            assert len(warn) == 4 and warn[3].startswith(f"remote store {url} exists failed")
    finally:
        if srv is not None:
            srv.stop()
        br.close()


def test_outage_log_names_a_new_cause_early_at_most_once_a_minute():
    from kvstore.cause_log import CAUSE_RELOG_S, OutageLog
    now = [0.0]
    log = OutageLog(600.0, clock=lambda: now[0])
    assert log.failed(cause="ConnectionError") == "down"
    now[0] = 30.0
    assert log.failed(cause="ConnectionError") is None
    assert log.failed(cause="AuthenticationError") is None  # changed, but within a minute
    now[0] = CAUSE_RELOG_S
    assert log.failed(cause="AuthenticationError") == (CAUSE_RELOG_S, 4)  # named early
    now[0] = 100.0
    assert log.failed(cause="AuthenticationError") is None  # the same cause: the 10 min rule
    assert log.failed() is None                              # no cause told: never early
    now[0] = 200.0
    assert log.failed(cause="ConnectionError") == (200.0, 7)  # back to the first: changed
    now[0] = 799.0
    assert log.failed(cause="ConnectionError") is None
    now[0] = 800.0
    assert log.failed(cause="ConnectionError") == (800.0, 9)
    assert log.recovered() == (800.0, 9)


def test_a_daemon_that_comes_back_answering_503_is_logged_again_with_the_new_cause(caplog):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Busy(BaseHTTPRequestHandler):
        def _busy(self):
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            body = b'{"error": "overloaded"}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _busy

        def log_message(self, *args):
            pass

    port, url, now, br = _breaker_on_a_closed_port()
    srv = None
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.layered"):
            _down_for(br, now, 120)                 # refused for 2 minutes: one line
            assert len(_lines(caplog, logging.WARNING)) == 1
            srv = ThreadingHTTPServer(("127.0.0.1", port), Busy)  # now it answers, 503
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            _down_for(br, now, 120)
            warn = _lines(caplog, logging.WARNING)
            assert len(warn) == 2, warn             # the new cause, long before 10 minutes
            assert warn[1].startswith(f"remote store {url} still down after ")
            assert "no answer within" in warn[1] and "overloaded" in warn[1]
            _down_for(br, now, 300)                 # the same 503s: nothing more
            assert len(_lines(caplog, logging.WARNING)) == 2
    finally:
        if srv is not None:
            srv.shutdown()
            srv.server_close()

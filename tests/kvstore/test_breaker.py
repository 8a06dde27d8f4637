"""``CircuitBreaker`` (one per Redis node): closed -> open after ``failure_threshold``
consecutive failures -> half-open after ``reset_s`` (one trial) -> closed on success or open
again on failure. Driven by a fake clock, so every transition happens at an exact time."""
import threading

import pytest

from kvstore.tiers.breaker import CLOSED, HALF_OPEN, OPEN, STATE_VALUE, CircuitBreaker


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def changes():
    return []


@pytest.fixture
def breaker(clock, changes):
    return CircuitBreaker(failure_threshold=3, reset_s=5.0, on_change=changes.append, clock=clock)


def test_opens_after_exactly_threshold_consecutive_failures(breaker, changes):
    breaker.failure()
    breaker.failure()
    assert breaker.state == CLOSED and breaker.allow() and changes == []
    breaker.failure()
    assert breaker.state == OPEN and changes == [OPEN] and breaker.opens == 1
    assert breaker.allow() is False


def test_a_success_resets_the_consecutive_count(breaker, changes):
    for _ in range(2):
        breaker.failure()
    breaker.success()
    breaker.failure()
    breaker.failure()
    assert breaker.state == CLOSED and changes == []  # 2 consecutive, not 4
    breaker.failure()
    assert breaker.state == OPEN


def test_open_refuses_until_the_pause_is_over(breaker, clock, changes):
    for _ in range(3):
        breaker.failure()
    clock.t += 4.999
    assert breaker.allow() is False and breaker.state == OPEN
    clock.t += 0.001  # exactly reset_s after opening
    assert breaker.state == HALF_OPEN
    assert changes == [OPEN]  # reading the state changes nothing


def test_half_open_lets_one_trial_through_and_success_closes(breaker, clock, changes):
    for _ in range(3):
        breaker.failure()
    clock.t += 5.0
    assert breaker.allow() is True
    assert changes == [OPEN, HALF_OPEN]
    assert [breaker.allow() for _ in range(3)] == [False, False, False]  # one trial only
    breaker.success()
    assert breaker.state == CLOSED and changes == [OPEN, HALF_OPEN, CLOSED]
    assert breaker.allow() and breaker.allow()
    breaker.failure()
    breaker.failure()
    assert breaker.state == CLOSED  # the count restarted at 0 on closing


def test_half_open_failure_reopens_at_once_for_a_full_pause(breaker, clock, changes):
    for _ in range(3):
        breaker.failure()
    clock.t += 5.0
    assert breaker.allow()
    clock.t += 1.0
    breaker.failure()  # the trial failed: one failure is enough
    assert breaker.state == OPEN and breaker.opens == 2
    assert changes == [OPEN, HALF_OPEN, OPEN]
    clock.t += 4.9
    assert breaker.allow() is False
    clock.t += 0.1
    assert breaker.allow() is True  # the pause counts from the re-opening


def test_success_while_closed_calls_nothing(breaker, changes):
    breaker.success()
    breaker.success()
    assert changes == [] and breaker.state == CLOSED


def test_only_one_thread_gets_the_half_open_trial(clock):
    b = CircuitBreaker(failure_threshold=1, reset_s=1.0, clock=clock)
    b.failure()
    clock.t += 1.0
    results = []
    start = threading.Barrier(8)

    def ask():
        start.wait()
        results.append(b.allow())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]


@pytest.mark.parametrize("threshold, reset_s", [(0, 1.0), (-1, 1.0), (1, 0.0), (1, -2.0),
                                                (1, float("nan"))])
def test_bad_settings_raise(threshold, reset_s):
    with pytest.raises(ValueError, match="failure_threshold >= 1 and reset_s > 0"):
        CircuitBreaker(failure_threshold=threshold, reset_s=reset_s)


def test_gauge_values_of_states():
    assert STATE_VALUE == {CLOSED: 0, OPEN: 1, HALF_OPEN: 2}

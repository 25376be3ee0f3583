"""The retry policy: delays, backoff, deadline-bounded attempts, call_with_retry."""

from __future__ import annotations

import threading
import time

import pytest

from refstream.errors import ConfigError, TransientError
from refstream.retry import FailureStreak, RetryPolicy, call_with_retry
from tests.timing import bound


def test_delays_grow_and_are_capped():
    p = RetryPolicy(attempts=6, initial=1.0, maximum=5.0, multiplier=2.0)
    assert p.delays() == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert [p.delay(n) for n in (1, 2, 3, 10)] == [1.0, 2.0, 4.0, 5.0]
    assert RetryPolicy(attempts=1).delays() == []


def test_backoff_is_the_delay_spread_by_the_jitter():
    p = RetryPolicy(initial=10.0, maximum=100.0, jitter=0.2)
    got = [p.backoff(2) for _ in range(200)]
    assert all(16.0 <= d <= 24.0 for d in got)
    assert len(set(got)) > 1
    assert RetryPolicy(initial=3.0, jitter=0.0).backoff(1) == 3.0


def test_until_tries_at_once_then_after_each_delay_until_the_deadline():
    started = time.monotonic()
    attempts = list(RetryPolicy.every(0.05).until(0.2))
    took = time.monotonic() - started
    assert attempts == list(range(1, len(attempts) + 1))
    # At once, then one after each delay: never more than the deadline allows; on a starved machine
    # the sleeps overshoot and fewer fit, but one always follows the first.
    assert 2 <= len(attempts) <= 6
    assert 0.2 <= took < 5.0


def test_until_ends_on_success_or_when_stop_is_set():
    for n in RetryPolicy.every(0.01).until(10):
        if n == 3:
            break
    assert n == 3
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    assert list(RetryPolicy.every(0.02).until(30, stop=stop))
    assert time.monotonic() - started < bound(5)


def test_until_makes_one_attempt_when_the_deadline_has_passed():
    assert list(RetryPolicy.every(1.0).until(0)) == [1]


def test_call_with_retry_retries_transient_errors_only():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientError("down")
        return "ok"

    fast = RetryPolicy(attempts=3, initial=0.01, maximum=0.01)
    assert call_with_retry(flaky, what="flaky", policy=fast) == "ok" and len(calls) == 3
    calls.clear()

    def down():
        calls.append(1)
        raise TransientError("still down")

    with pytest.raises(TransientError, match="still down"):
        call_with_retry(down, what="down", policy=fast)
    assert len(calls) == 3
    calls.clear()

    def bad():
        calls.append(1)
        raise ConfigError("bad")

    with pytest.raises(ConfigError):
        call_with_retry(bad, what="bad", policy=fast)
    assert len(calls) == 1


def test_a_failure_streak_ends_when_progress_was_made_between_two_failures():
    streak = FailureStreak(RetryPolicy(attempts=3))
    assert [streak.failed(0), streak.failed(0)] == [1, 2] and not streak.exhausted
    # progress (batches written) since the last failure: this one is the first of a new streak
    assert streak.failed(5) == 1
    assert [streak.failed(5), streak.failed(5)] == [2, 3] and streak.exhausted
    # many failures, each after some progress, never exhaust the policy
    weeks = FailureStreak(RetryPolicy(attempts=2))
    assert [weeks.failed(n) for n in range(1, 50)] == [1] * 49 and not weeks.exhausted

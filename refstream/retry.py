"""Retry and backoff: one policy object for every wait-and-try-again loop.

- :func:`call_with_retry`: call a function, retrying transient errors a bounded number of times.
- :meth:`RetryPolicy.backoff`: the wait before retry number ``n`` (for loops that schedule the
  retry themselves, e.g. the refresher daemon).
- :meth:`RetryPolicy.until`: the attempts of a loop bounded by a deadline instead of a count
  (waiting for a topic, a schema record, a broker that is starting).
- :class:`FailureStreak`: the failures in a row of something that runs for good (a streaming
  query), counted again from one once it made progress.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from refstream.errors import TransientError

__all__ = ["FailureStreak", "RetryPolicy", "call_with_retry"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a transient failure.

    The n-th wait is ``initial * multiplier ** (n - 1)``, capped at ``maximum``; :meth:`backoff` and
    :func:`call_with_retry` spread it by ``jitter`` (0.2: +-20 %) so that clients that failed
    together do not retry together."""

    attempts: int = 5
    initial: float = 1.0
    maximum: float = 60.0
    multiplier: float = 2.0
    jitter: float = 0.2

    @classmethod
    def every(cls, seconds: float) -> RetryPolicy:
        """A fixed wait (polling), for :meth:`until`."""
        return cls(initial=seconds, maximum=seconds, multiplier=1.0, jitter=0.0)

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` consecutive failures (1 = the first), without jitter."""
        return min(self.maximum, self.initial * self.multiplier ** max(0, failures - 1))

    def delays(self) -> list[float]:
        """The waits between the ``attempts`` tries, without jitter."""
        return [self.delay(n) for n in range(1, self.attempts)]

    def backoff(self, failures: int) -> float:
        """:meth:`delay` with jitter."""
        return self.spread(self.delay(failures))

    def spread(self, delay: float) -> float:
        return delay * (1.0 - self.jitter + 2 * self.jitter * random.random())

    def until(self, timeout: float, *, stop: threading.Event | None = None) -> Iterator[int]:
        """Attempt numbers 1, 2, ... of a loop bounded by ``timeout`` seconds rather than by
        ``attempts``: the first at once, each next one after the next :meth:`delay` (no jitter). Ends
        once the deadline has passed after an attempt, or when ``stop`` is set while waiting; the
        caller breaks out on success, so code after the loop is where it gives up::

            for _ in RetryPolicy.every(0.2).until(30):
                if ready():
                    break
            else:
                raise TimeoutError(...)
        """
        deadline = time.monotonic() + timeout
        attempt = 1
        while True:
            yield attempt
            if time.monotonic() > deadline:
                return
            wait = self.delay(attempt)
            if stop is not None:
                if stop.wait(wait):
                    return
            else:
                time.sleep(wait)
            attempt += 1


@dataclass
class FailureStreak:
    """Failures in a row of a long-running thing restarted after each, by a progress count.

    A failure after the progress count moved since the previous failure (or the start) begins a new
    streak: failures spread over weeks of work each count as the first, and only ``attempts`` in a
    row without progress between them exhaust the policy."""

    policy: RetryPolicy
    failures: int = 0
    _progress: int = field(default=0, init=False)

    def failed(self, progress: int) -> int:
        """Count a failure seen with the progress count at ``progress``; its number in the streak."""
        if progress != self._progress:
            self.failures, self._progress = 0, progress
        self.failures += 1
        return self.failures

    @property
    def exhausted(self) -> bool:
        return self.failures >= self.policy.attempts


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy = RetryPolicy(),
    transient: tuple[type[BaseException], ...] = (TransientError,),
    stop: threading.Event | None = None,
) -> T:
    """Call ``fn``; on a ``transient`` error wait and try again, logging each attempt.

    Terminal errors propagate at once. The last transient error propagates when attempts run out
    or ``stop`` is set while waiting.
    """
    delays = policy.delays()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except transient as exc:
            if attempt > len(delays):
                log.error("%s failed after %d attempts: %s", what, attempt, exc)
                raise
            delay = policy.spread(delays[attempt - 1])
            log.warning("%s failed (attempt %d/%d): %s; retrying in %.1fs", what, attempt,
                        policy.attempts, exc, delay)
            if stop is not None:
                if stop.wait(delay):
                    raise
            else:
                time.sleep(delay)

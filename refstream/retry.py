"""Retry with exponential backoff for transient errors only."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from refstream.errors import TransientError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry a transient failure."""

    attempts: int = 5
    initial: float = 1.0
    maximum: float = 60.0
    multiplier: float = 2.0

    def delays(self) -> list[float]:
        d, out = self.initial, []
        for _ in range(max(0, self.attempts - 1)):
            out.append(min(d, self.maximum))
            d *= self.multiplier
        return out


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
            delay = delays[attempt - 1] * (0.8 + 0.4 * random.random())
            log.warning("%s failed (attempt %d/%d): %s; retrying in %.1fs", what, attempt,
                        policy.attempts, exc, delay)
            if stop is not None:
                if stop.wait(delay):
                    raise
            else:
                time.sleep(delay)

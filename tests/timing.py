"""Bounds on the tests' waits, scaled to the machine that runs them.

A test waits on a condition (a process's exit, a record in a topic, a row in a table), never on the
clock; what bounds the wait is there to turn a hang into a failure, not to time the code. Each bound
in a test is written for a quiet machine of the reference speed; ``bound(seconds)`` stretches it by
``slowdown()``, measured once at the start of the run (``measure``, tests/conftest.py) and inherited
by pytest-xdist's workers and the processes the tests start:

- how much slower than ``REFERENCE_RATE`` a plain Python loop runs here (a slower machine), times
- how much of the machine other processes took while it was measured (a busy one: with one of two
  cores kept busy, the suite gets half the machine and every bound doubles).

A wall-clock upper bound that a behaviour promises (a read cut by a 1 s timeout ends within seconds,
not minutes) goes through ``bound`` too: what it tells apart is orders of magnitude, which a busier
machine does not blur, and the factor is capped at ``MAX_SLOWDOWN``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Millions of iterations per second of the reference loop on the machines the bounds were set on.
REFERENCE_RATE = 35.0
#: The most a bound is stretched: beyond it the machine is too slow for this suite.
MAX_SLOWDOWN = 4.0
ENV = "REFSTREAM_TEST_SLOWDOWN"


def reference_loop_rate() -> float:
    """Millions of iterations per second of a plain Python loop, the best of three rounds."""
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        total = 0
        for i in range(1_000_000):
            total += i
        best = min(best, time.process_time() - t)
    return 1.0 / best if best > 0 else 0.0


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of every CPU since boot (Linux), or None."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_share(span: float = 0.5) -> float:
    """The share of the machine's CPU that other processes used over ``span`` seconds (0 to 1)."""
    before = _cpu_times()
    time.sleep(span)
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    return max(0.0, min(1.0, (after[0] - before[0]) / (after[1] - before[1])))


def measure() -> float:
    """This machine's slowdown against the reference, published in the environment for the run's
    workers and children."""
    rate = reference_loop_rate()
    speed = max(1.0, REFERENCE_RATE / rate) if rate > 0 else MAX_SLOWDOWN
    load = 1.0 / max(1.0 - busy_share(), 1.0 / MAX_SLOWDOWN)
    factor = min(MAX_SLOWDOWN, speed * load)
    os.environ[ENV] = f"{factor:.2f}"
    return factor


def slowdown() -> float:
    """The run's slowdown (1 on a quiet reference machine); measured here if the run did not."""
    value = os.environ.get(ENV)
    if value is None:
        return measure()
    try:
        return min(MAX_SLOWDOWN, max(1.0, float(value)))
    except ValueError:
        return 1.0


def bound(seconds: float) -> float:
    """``seconds``, a bound set on a quiet reference machine, for this one."""
    return seconds * slowdown()

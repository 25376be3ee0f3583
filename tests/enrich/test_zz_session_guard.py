"""The shared test session survives a test interrupted inside a JVM call (tests/enrich/conftest.py).

Named to run after every other test of the shared session: it drops its py4j connection on purpose."""

from __future__ import annotations

import signal
from types import FrameType

import pytest
from pyspark.sql import SparkSession


class _Interrupted(BaseException):
    pass


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise _Interrupted


def test_a_call_interrupted_by_a_base_exception_does_not_shift_later_answers(spark: SparkSession) -> None:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        # Holding the exception keeps the call's frames, and so its connection, alive: pytest does
        # the same for a failed test (sys.last_traceback).
        with pytest.raises(_Interrupted) as interrupted:
            jvm.java.lang.Thread.sleep(2000)  # its answer arrives after the interruption
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # Without the guard this call would read the sleep's (void) answer, the next one this one's.
    assert jvm.java.lang.Math.addExact(40, 2) == 42
    assert jvm.java.lang.Integer.toString(1234) == "1234"
    assert spark.range(7).count() == 7
    assert interrupted.traceback

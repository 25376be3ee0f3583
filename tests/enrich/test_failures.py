"""Reading a task's error out of Spark's exception of a failed job (enrich.failures)."""

from __future__ import annotations

from enrich.failures import root_cause, transient_cause
from refstream.errors import TransientError

SPARK = ("[PYTHON_EXCEPTION] An exception was thrown from the Python worker.\nTraceback (most recent call last):\n"
         '  File "tasks.py", line 9, in write\n{}\n\tat org.apache.spark.api.python...')


def test_the_transient_error_a_task_raised_is_read_from_sparks_exception() -> None:
    exc = RuntimeError(SPARK.format("refstream.errors.TransientError: batch 3: broker away\nmore"))
    found = transient_cause(exc)
    assert isinstance(found, TransientError) and str(found) == "batch 3: broker away"
    assert transient_cause(RuntimeError(SPARK.format("refstream.errors.DataError: bad row"))) is None
    assert root_cause(RuntimeError(SPARK.format("refstream.errors.DataError: bad row"))) == "bad row"
    assert root_cause(RuntimeError("first line\nsecond")) == "RuntimeError: first line"

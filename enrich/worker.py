"""Housekeeping of the Python workers Spark runs the job's code in.

PySpark's daemon runs ``gc.collect()`` in a reused worker after every task (``pyspark/daemon.py``):
a full collection walks every tracked object, and a worker that imported pyspark, pandas, pyarrow
and confluent-kafka holds ~100k of them that live as long as the process. :func:`settle` moves the
objects alive at a worker's first task into the permanent generation (``gc.freeze``), so those
collections walk only what later tasks allocate. Objects that become garbage later are still freed
by reference counting; only a reference cycle among the frozen objects would stay (as it would
have until the next full collection anyway, at most once per process).
"""

from __future__ import annotations

import gc

_settled = False


def settle() -> None:
    """Once per process, inside a Spark task only (not on the driver, not in tests): collect, then
    freeze what survived."""
    global _settled
    if _settled:
        return
    from pyspark import TaskContext

    if TaskContext.get() is None:
        return
    _settled = True
    gc.collect()
    gc.freeze()

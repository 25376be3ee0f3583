"""Housekeeping of the Python workers Spark runs the job's code in.

PySpark's daemon runs ``gc.collect()`` in a reused worker after every task (``pyspark/daemon.py``):
a full collection walks every tracked object, and a worker that imported pyspark, pandas, pyarrow
and confluent-kafka holds ~100k of them that live as long as the process (a collection took 40-90 ms
here, several times per batch). :func:`settle`, at the start of each task, moves the objects alive
then into the permanent generation (``gc.freeze``), so those collections walk only what the task
allocates. At every task, not once: a worker's first task may be of another kind than its next
(a ``mapInArrow``, then the state step's pandas), and what the later kind imports and caches would
be walked after every task again. What is alive at a task's start survived the collection after the
previous one. Objects that become garbage later are still freed by reference counting; only a
reference cycle among frozen objects stays.
"""

from __future__ import annotations

import gc

_settled = False


def settle() -> None:
    """Inside a Spark task only (not on the driver, not in tests): freeze what is alive, after a
    first collection in the process."""
    global _settled
    from pyspark import TaskContext

    if TaskContext.get() is None:
        return
    if not _settled:
        _settled = True
        gc.collect()
    gc.freeze()

"""Housekeeping of the Python workers Spark runs the job's code in.

PySpark's daemon runs ``gc.collect()`` in a reused worker after every task (``pyspark/daemon.py``):
a full collection walks every tracked object, and a worker that imported pyspark, pandas, pyarrow
and confluent-kafka holds ~100k of them that live as long as the process (a collection took 40-90 ms
here, several times per batch). :func:`settle`, at the start of each task, moves the objects alive
then into the permanent generation (``gc.freeze``), so those collections walk only what the task
allocates. At every task, not once: a worker's first task may be of another kind than its next
(a ``mapInArrow``, then the state step's pandas), and what the later kind imports and caches would
be walked after every task again. What is alive at a task's start survived the collection after the
previous one. Objects that become garbage later are still freed by reference counting; a reference
cycle among frozen objects (a cached object let go later) would stay, so every
:data:`REFREEZE_EVERY` tasks the worker thaws everything and collects it once before freezing again.
"""

from __future__ import annotations

import gc

#: Tasks between two full collections of a worker's frozen objects (one costs tens of milliseconds).
REFREEZE_EVERY = 200

_tasks = 0   # the Spark tasks this process has started


def settle() -> None:
    """Inside a Spark task only (not on the driver, not in tests): freeze what is alive, after a
    full collection at the process's first task and every :data:`REFREEZE_EVERY` tasks."""
    global _tasks
    from pyspark import TaskContext

    if TaskContext.get() is None:
        return
    _tasks += 1
    if _tasks == 1 or _tasks % REFREEZE_EVERY == 0:
        gc.unfreeze()
        gc.collect()
    gc.freeze()

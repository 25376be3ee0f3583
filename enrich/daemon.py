"""The Python daemon of the job's executors (``spark.python.daemon.module``): PySpark's own
(``pyspark.daemon``), with the modules the job's tasks run loaded once, before it forks a worker
per task slot and Python step.

PySpark's daemon imports nothing before it forks: each worker then imports pandas, pyarrow and the
job's executor modules itself, about a second of CPU per worker, and a stateful batch runs three
Python workers per task (state step, join pass, writer). Here the daemon imports them first, and
the workers start with them loaded (shared with the daemon until written to).

PySpark forks late because importing pandas and pyarrow starts threads (numpy's OpenBLAS pool,
pyarrow's jemalloc background thread), and a fork copies a held lock but not the thread holding it.
So the daemon turns both off (:data:`QUIET`, for its workers too) unless the environment already
sets them, and if any thread is running all the same (another build, another library), it does not
fork from this process: it becomes PySpark's plain daemon instead. Importing the ``enrich`` package
(before this module runs) imports none of them.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import signal
import sys

#: The modules a job's tasks import, loaded before the first fork. One that is not installed (an
#: extra left out: the database sink's drivers, the calls' client) is skipped; its tasks import it
#: themselves, and fail there with their own message.
PRELOAD = (
    "numpy", "pandas", "pyarrow", "pyarrow.compute", "pyarrow.ipc", "confluent_kafka",
    "pyspark.worker", "pyspark.sql.pandas.serializers", "pyspark.sql.streaming.stateful_processor",
    "enrich.source.kafka", "enrich.events.fastparse", "enrich.joins", "enrich.state.processor",
    "enrich.sinks.kafka.tasks", "enrich.sinks.parquet", "enrich.sinks.database.sink", "enrich.calls.step",
)


def threads() -> int:
    """The threads of this process (Linux; 1 where it cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


#: The settings that keep numpy's and pyarrow's threads from starting, read when they are imported.
QUIET = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}


def preload() -> bool:
    """Import :data:`PRELOAD`; whether this process is still single-threaded (safe to fork from)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    gc.collect()
    gc.freeze()  # the workers' collections then leave the shared pages alone
    return threads() == 1


def _argv0() -> str:
    # The interpreter as Spark named it (e.g. ``./env/bin/python``, a shipped venv): a process list shows
    # the same command after the exec.
    return sys.orig_argv[0] if sys.orig_argv else sys.executable


def main() -> None:
    for key, value in QUIET.items():  # read by numpy and pyarrow at preload's imports; the workers inherit them
        os.environ.setdefault(key, value)
    if not preload():
        # A thread runs all the same (started before this module, or by an import that ignores the
        # settings), and forking from a process with threads can hang a worker on a lock copied
        # held: be PySpark's daemon.
        os.execv(sys.executable, [_argv0(), "-m", "pyspark.daemon", *sys.argv[1:]])
    # `kill -USR2 <worker>` prints a stuck worker's Python stacks to the executor's stderr (the workers
    # inherit the handler across the fork).
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    from pyspark.daemon import manager

    manager()


if __name__ == "__main__":
    main()

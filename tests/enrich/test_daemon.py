"""enrich.daemon: the executors' Python daemon forks its workers with the job's modules loaded, from a
single-threaded process, and Spark runs the job's tasks in its workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from enrich.daemon import QUIET

ROOT = Path(__file__).resolve().parents[2]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.integration  # a process of its own
def test_the_daemon_starts_again_with_the_threads_off_and_waits_single_threaded_with_the_modules_loaded() -> None:
    env = {k: v for k, v in os.environ.items() if k not in QUIET}
    python = "./" + os.path.relpath(sys.executable, ROOT)  # named relative to its directory, as Spark may
    proc = subprocess.Popen([python, "-m", "enrich.daemon", "pyspark.worker"], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = proc.stdout.read(4)  # PySpark's daemon writes its port once it listens
        assert len(port) == 4, proc.wait(10)
        # The same process (execve keeps the pid), now with the settings, one thread, pyarrow mapped.
        assert {k: _environ(proc.pid).get(k) for k in QUIET} == QUIET
        assert len(os.listdir(f"/proc/{proc.pid}/task")) == 1
        # Started again as it was named: the same argv[0] (Spark's spark.pyspark.python, e.g. ./env/bin/python).
        assert Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[:4] == [
            python.encode(), b"-m", b"enrich.daemon", b"pyspark.worker"]
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libarrow" in maps and "pandas" in maps
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the daemon stops when its stdin closes
        proc.wait(30)


def test_the_jobs_python_tasks_run_in_workers_of_the_jobs_daemon(spark: SparkSession) -> None:
    def where(rows):  # type: ignore[no-untyped-def]
        import os

        import pandas as pd

        parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        for _ in rows:
            pass
        yield pd.DataFrame({"parent": [parent], "blas": [os.environ.get("OPENBLAS_NUM_THREADS", "")]})

    got = spark.range(4).repartition(2).mapInPandas(where, "parent STRING, blas STRING").collect()
    assert got and all("-m enrich.daemon" in r.parent and r.blas == "1" for r in got), got

"""enrich.daemon: the executors' Python daemon forks its workers with the job's modules loaded, from a
single-threaded process, and Spark runs the job's tasks in its workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import enrich
import enrich.config
from enrich.daemon import QUIET
from tests.timing import bound

ROOT = Path(__file__).resolve().parents[2]


def _start(python: str, *argv: str) -> tuple[subprocess.Popen[bytes], str]:
    """A daemon started as Spark starts it, once it listens (PySpark's daemon writes its port then)."""
    env = {k: v for k, v in os.environ.items() if k not in QUIET}
    proc = subprocess.Popen([python, *argv], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    port = proc.stdout.read(4)
    assert len(port) == 4, proc.wait(bound(10))
    return proc, Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()  # the daemon stops when its stdin closes
    proc.wait(bound(30))


# Named relative to its directory, as Spark may name it (spark.pyspark.python, e.g. ./env/bin/python).
PYTHON = "./" + os.path.relpath(sys.executable, ROOT)


@pytest.mark.integration  # a process of its own
def test_the_daemon_waits_single_threaded_with_the_modules_loaded() -> None:
    proc, cmdline = _start(PYTHON, "-m", "enrich.daemon", "pyspark.worker")
    try:
        assert cmdline.split("\0")[:4] == [PYTHON, "-m", "enrich.daemon", "pyspark.worker"]
        assert len(os.listdir(f"/proc/{proc.pid}/task")) == 1  # numpy's and pyarrow's threads are off
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libarrow" in maps and "pandas" in maps
    finally:
        _stop(proc)


@pytest.mark.integration  # a process of its own
def test_a_daemon_with_a_thread_running_before_it_preloads_becomes_pysparks_daemon() -> None:
    # A thread started before the daemon module runs, as a sitecustomize could.
    code = ("import runpy, sys, threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
            "sys.argv = ['enrich.daemon', 'pyspark.worker']; runpy.run_module('enrich.daemon', run_name='__main__')")
    proc, cmdline = _start(PYTHON, "-c", code)
    try:
        assert cmdline.split("\0")[:4] == [PYTHON, "-m", "pyspark.daemon", "pyspark.worker"]
    finally:
        _stop(proc)


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


@pytest.mark.integration  # a process of its own
def test_importing_the_enrich_package_imports_neither_pyarrow_nor_numpy_nor_pyspark() -> None:
    """The package is imported before any of its modules in every Python process Spark starts for the
    job (the daemon, the source's runners, the state step's planner): what it imports, each of them
    imports. pyarrow or numpy there would also start their threads before the daemon can turn them off."""
    code = "import sys, enrich; print(sorted({m.split('.')[0] for m in sys.modules} & {'pyarrow', 'numpy', 'pyspark', 'pandas'}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert enrich.load_config is enrich.config.load_config and enrich.EnrichConfig is enrich.config.EnrichConfig


@pytest.mark.parametrize(("module", "unwanted"), [
    # The source's planners and runner (one each per query start): not the job's config and its
    # contract (pyarrow.compute), nor the calls' HTTP client.
    ("enrich.source.kafka", {"enrich.config", "refstream.contract", "pyarrow.compute", "aiohttp"}),
    # The state step's planner and workers, with or without calls configured.
    ("enrich.state.processor", {"aiohttp"}),
    # Loading a config (the CLI, the Python API): no Kafka client, no Spark.
    ("enrich.config", {"confluent_kafka", "pyspark", "aiohttp"}),
])
def test_the_modules_spark_starts_processes_for_import_only_what_they_run(module: str, unwanted: set[str]) -> None:
    code = f"import sys, {module}; print(sorted(set(sys.modules).intersection({sorted(unwanted)!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

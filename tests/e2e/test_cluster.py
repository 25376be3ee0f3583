"""The same job on a real standalone Spark cluster: a master and two workers started with pyspark's
``bin/spark-class``, the job submitted with ``--master spark://...``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from refstream.contract import Column, DatasetSchema
from tests.conftest import spark_defaults_less
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.enrich.process import start_job, write_config
from tests.enrich.spark_cluster import Cluster, both_executors
from tests.timing import bound

SCHEMA = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))

pytestmark = pytest.mark.integration  # submits to the `cluster` fixture's master and workers


def driver_jvm_args(pid: int, timeout: float = 300) -> list[str]:
    """The command line of the JVM the job's process ``pid`` started (its driver)."""
    deadline = time.monotonic() + bound(timeout)
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                args = [a.decode() for a in (stat.parent / "cmdline").read_bytes().split(b"\0") if a]
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid and args and args[0].endswith("java"):
                return args
        time.sleep(0.2)
    raise AssertionError(f"process {pid} started no JVM in {timeout}s")


def test_job_on_a_two_worker_standalone_cluster(cluster: Cluster, kafka: dict[str, str],
                                                unique: Callable[[str], str], tmp_path: Path) -> None:
    """The output is produced by the executors' Python workers, and no task sends event rows to the
    driver: every task's result (Spark's event log, ``Result Size``) is a row of counts."""
    config = tmp_path / "enrich.yaml"
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    total = 4000
    cfg = write_config(config, kafka, unique, spark={"spark.executor.memory": "512m", **both_executors(),
                                                     "spark.driver.memory": "1g", "spark.driver.host": "127.0.0.1",
                                                     "spark.sql.shuffle.partitions": "2",
                                                     "spark.eventLog.enabled": "true",
                                                     "spark.eventLog.dir": events_dir.as_uri(),
                                                     "spark.eventLog.compress": "false",
                                                     "spark.eventLog.rolling.enabled": "false"})
    publish(kafka, cfg["joins"][0]["topic"], changelog(SCHEMA, [{"device_id": f"d{i}", "owner": f"o{i}"}
                                                                for i in range(5)]))
    produce_events(kafka, cfg["events"]["topic"], [{"device_id": f"d{i % 6}", "n": i} for i in range(total)],
                   partitions=2)
    log = tmp_path / "job.log"
    # The tests' spark-defaults.conf gives every driver C1 only: this one must get it from the job
    # (DRIVER_JIT), so it runs with that file less that line.
    env = spark_defaults_less("spark.driver.defaultJavaOptions", tmp_path / "spark-defaults.conf")
    earlier = {a["id"] for a in cluster.apps()}  # the cluster is the session's: other tests' jobs ran on it
    proc = start_job(config, log, "--available-now", master=cluster.master, env=env)
    jvm = driver_jvm_args(proc.pid)
    rc = proc.wait(bound(600))  # a standalone cluster on a loaded 2-core machine
    assert "-XX:TieredStopAtLevel=1" in jvm, jvm  # enrich.session.DRIVER_JIT
    assert rc == 0, log.read_text()[-4000:]
    rows = [json.loads(m.value()) for m in read_all(kafka, cfg["output"]["kafka"]["topic"])]
    assert sorted(r["n"] for r in rows) == list(range(total))
    assert all(r["owner"] == f"o{r['n'] % 6}" for r in rows if r["n"] % 6 < 5)
    assert all(r["_devices_matched"] is False for r in rows if r["n"] % 6 == 5)
    apps = [a for a in cluster.apps() if a["id"] not in earlier]
    assert [a["name"] for a in apps] == ["refstream-enrich"], "the job did not run on the cluster"
    app = apps[0]["id"]
    for i in range(2):  # each worker launched an executor for the job
        assert cluster.executor_logs(i, app), f"worker {i} ran no executor"

    # Who wrote: every task reports its Python worker (host:pid:working directory); on a cluster the
    # working directory is its executor's, under a worker's work dir.
    writers = [w for line in log.read_text().splitlines() if "writers: " in line
               for w in line.split("writers: ", 1)[1].split(", ")]
    assert len(writers) >= 4, log.read_text()[-3000:]  # 4 batches of 1000 events, 2 tasks each
    dirs = {w.split(" in ", 1)[1].split(":", 2)[2] for w in writers}
    assert all(Path(d).parent.parent.name in ("work0", "work1") and Path(d).parent.name == app for d in dirs), dirs
    assert {Path(d).parent.parent.name for d in dirs} == {"work0", "work1"}, "both executors write"
    assert str(proc.pid) not in {w.split(" in ", 1)[1].split(":")[1] for w in writers}

    # What reached the driver: Spark records every task's serialized result size. Event rows of a
    # 1000-event batch are tens of kilobytes; a row of counts is a few hundred bytes plus metrics.
    ends = [json.loads(line) for f in events_dir.rglob("*") if f.is_file() for line in f.read_text().splitlines()
            if '"SparkListenerTaskEnd"' in line]
    sizes = [e["Task Metrics"]["Result Size"] for e in ends if e.get("Task Metrics")]
    assert len(sizes) >= 8 and max(sizes) < 8_000, sorted(sizes)[-5:]

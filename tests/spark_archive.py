"""The class-data-sharing (AppCDS) archive the tests' Spark drivers read their classes from
(tests/conftest.py: ``spark_defaults``), made in the background at the start of a run.

``python -m tests.spark_archive RUN DEFAULTS OUT`` (the run's directory, the tests' Spark defaults,
the run's copy of them to replace) makes it in two stages, each a JVM that writes an archive of the
classes it loaded when it exits, then replaces ``OUT`` with a copy of ``DEFAULTS`` naming that
archive, in one rename, so that every driver started after that reads it:

- ``quick``: a session doing what every test's Spark does at its start (a streaming query, Arrow to
  Python and back, a shuffle): ready soon, while the run's first tests start their drivers;
- ``job``: a job of the tests' kind on an embedded broker (a join, per-device state, a rollup, gaps,
  a dead letter, Parquet written and read), whose archive replaces the first: it holds the classes
  a test's job loads, about 3,400 more than the first (Parquet's, the state store's, the code
  generator's). A test with two job starts (the gaps' SIGKILL test) took 50 CPU seconds with it,
  61 with the quick one (two rounds each).

A stage that fails leaves the earlier archive in place; ``archive.log`` in the run's directory says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from refstream.kafka import SERIAL_TXN_ENDS_ENV, SERIAL_TXNS_ENV

ROOT = Path(__file__).resolve().parents[1]
STAGE_TIMEOUT_S = 900

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def submit_args(defaults: Path, *more: str) -> str:
    """``PYSPARK_SUBMIT_ARGS`` giving a driver ``defaults`` as its Spark defaults (``more``: other options)."""
    return " ".join(["--properties-file", str(defaults), *more, "pyspark-shell"])


def with_tests_importable(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the repository first on ``PYTHONPATH``, for a process running ``tests.*`` modules."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}


def main(run: Path, defaults: Path, out: Path) -> int:
    for stage in ("quick", "job"):
        jsa = run / f"spark-{stage}.jsa"
        tmp = jsa.with_suffix(".tmp")
        # Its broker's transaction locks (demo.broker) of its own, not the pytest-xdist worker's.
        env = with_tests_importable({
            **os.environ, SERIAL_TXN_ENDS_ENV: str(run / "archive-txn-ends.lock"),
            SERIAL_TXNS_ENV: str(run / "archive-txns.lock"),
            "PYSPARK_SUBMIT_ARGS": submit_args(defaults, "--driver-java-options", f"-XX:ArchiveClassesAtExit={tmp}")})
        try:  # a stage stuck on a starved machine would only take CPU from the tests
            code = subprocess.call([sys.executable, "-m", "tests.spark_archive", "--stage", stage, str(run)],
                                   env=env, cwd=run, timeout=STAGE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -1
        if code != 0 or not tmp.exists():
            print(f"stage {stage}: exit code {code}, {'an' if tmp.exists() else 'no'} archive", flush=True)
            return 1
        tmp.rename(jsa)
        lines = [line + f" -XX:SharedArchiveFile={jsa}" if line.startswith("spark.driver.defaultJavaOptions")
                 else line for line in defaults.read_text().splitlines()]
        staged = out.with_suffix(".tmp")
        staged.write_text("\n".join(lines) + "\n")
        staged.rename(out)
        print(f"stage {stage}: {jsa.stat().st_size >> 20} MB", flush=True)
    return 0


def stage(name: str, run: Path) -> None:
    """One stage's session, in a process of its own: its JVM writes the archive as it exits."""
    from enrich.session import build_session

    spark = build_session("local[2]", f"refstream-tests-cds-{name}",
                          {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"})

    def same(batches):  # type: ignore[no-untyped-def]
        yield from batches

    spark.range(1000).repartition(2).mapInArrow(same, "id long").selectExpr("id % 7 as k").groupBy("k").count().collect()
    if name == "quick":
        q = (spark.readStream.format("rate").option("rowsPerSecond", 100).load()
             .mapInArrow(same, "timestamp timestamp, value long").writeStream.format("noop")
             .trigger(processingTime="200 milliseconds").option("checkpointLocation", str(run / "cds")).start())
        deadline = time.monotonic() + 120
        while len(q.recentProgress) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        q.stop()
    else:
        _job(spark, run)
    gateway = spark.sparkContext._gateway
    spark.stop()
    proc = gateway.proc
    proc.stdin.close()  # the JVM exits when its stdin closes, and writes the archive as it does
    proc.wait(600)  # a larger archive written on a loaded machine


def _job(spark: SparkSession, run: Path) -> None:
    from datetime import UTC, datetime, timedelta

    from demo.broker import EmbeddedBroker
    from enrich import config
    from enrich.job import EnrichJob
    from refstream.contract import Column, DatasetSchema
    from tests.enrich.helpers import changelog, produce_events, publish

    devices = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("site", "string"),
                                                        Column("report_s", "int64")))
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    work = run / "cds-job"
    work.mkdir(parents=True, exist_ok=True)
    with EmbeddedBroker(log_path=work / "broker.log") as broker:
        assert broker.proc is not None  # a process group of its own: the run's end kills it by this
        (run / "archive-broker.pid").write_text(str(broker.proc.pid))
        kafka = {"bootstrap.servers": broker.bootstrap}
        data = {
            "kafka": {"bootstrap_servers": broker.bootstrap},
            "events": {"topic": "events", "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE",
                       "starting_offsets": "earliest"},
            "joins": [{"dataset": "devices", "topic": "ref.devices", "on": "device_id"}],
            "output": {"parquet": {"path": str(work / "events")}},
            "dead_letter_topic": "dlq",
            "checkpoint": str(work / "checkpoint"),
            "max_events_per_batch": 10,
            "state": {"key": "device_id", "timestamp": "ts", "ttl": "1h", "watermark": "1m", "buckets": 4,
                      "aggregates": {"temp": ["max"]}},
            "gaps": {"expected_every": "report_s", "after": 3, "output": {"kafka": {"topic": "gaps"}}},
            "rollups": [{"name": "device_10s", "by": ["device_id"], "window": "10s", "fill": True,
                         "metrics": {"temp": ["count", "mean"]},
                         "output": {"parquet": {"path": str(work / "device_10s")}, "kafka": {"topic": "rollups"}}}],
        }
        publish(kafka, "ref.devices", changelog(devices, [{"device_id": d, "site": f"s-{d}", "report_s": 10}
                                                          for d in "ab"]))
        events: list[dict[str, object] | bytes] = [
            {"device_id": d, "ts": (t0 + timedelta(seconds=s)).isoformat(), "temp": float(s)}
            for s in range(0, 120, 5) for d in ("ab" if s < 30 or s > 90 else "a")]
        produce_events(kafka, "events", [*events[:5], b"not json", *events[5:]])
        EnrichJob(config.parse(data, "archive.yaml"), available_now=True).run(spark)
    spark.read.parquet(str(work / "events")).count()


if __name__ == "__main__":
    if sys.argv[1] == "--stage":
        stage(sys.argv[2], Path(sys.argv[3]))
    else:
        sys.exit(main(*(Path(a).resolve() for a in sys.argv[1:4])))

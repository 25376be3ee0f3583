"""Gaps in the running job (enrich.gaps, the state step's part in enrich/state/processor.py, the
driver's in enrich/sinks/gaps.py), on real Spark (local), the real broker and MariaDB: a silent
device's gap opened against its partition's time, retracted by its late readings, opened again and
closed, across a restart after a rescale and a fork from a savepoint onto more buckets, each record written once
to the topic and the table."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import yaml
from pyspark.sql import SparkSession

from enrich import config
from enrich.gaps.engine import gap_id
from enrich.job import EnrichJob
from enrich.ops.rescale import rescale
from enrich.ops.savepoint import take
from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.enrich.process import start_job
from tests.timing import bound

pytestmark = pytest.mark.integration

DEVICES = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("site", "string"),
                                                   Column("report_s", "int64")))
T0 = datetime(2026, 1, 1, tzinfo=UTC)
S = 1_000_000


def ev(device: str, seconds: float) -> dict[str, Any]:
    return {"device_id": device, "ts": (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}


def seconds(t: Any) -> float:
    """A Parquet time (naive: UTC) as seconds after T0."""
    t = pd.Timestamp(t)
    return ((t if t.tzinfo is not None else t.tz_localize("UTC")) - T0).total_seconds()


def iso(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# Six events a batch, one partition; a, b and c report every 10 s (a gap: 3 x 10 s of silence), d has no interval.
FIRST = [ev("a", 0), ev("b", 0), ev("c", 0), ev("a", 10), ev("b", 10), ev("c", 10),
         ev("a", 20), ev("b", 20), ev("d", 20), ev("a", 30), ev("b", 30), ev("a", 35),
         ev("a", 45), ev("b", 45), ev("b", 46)]           # the partition passes c's threshold (40)
THEN = [ev("a", 50), ev("b", 50), ev("a", 55),
        ev("c", 25), ev("c", 28), ev("a", 60),            # c was not silent from 10: retracted; silent from 28
        ev("a", 70), ev("b", 70), ev("c", 90)]            # c's second gap closes at 90


def make_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, db_url: str) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP",
                   "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"parquet": {"path": str(tmp_path / "events")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
        "max_events_per_batch": 6,
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "1h", "watermark": "1m", "buckets": 4},
        "gaps": {"expected_every": "report_s", "after": 3,
                 "output": {"kafka": {"topic": unique("gaps")}, "database": {"url": db_url, "table": unique("gaps")}}},
        # A per-device rollup with fill marks the empty windows inside a gap of its device.
        "rollups": [{"name": "device_10s", "by": ["device_id"], "window": "10s", "fill": True,
                     "metrics": {"ts": ["count"]}, "output": {"parquet": {"path": str(tmp_path / "device_10s")}}}],
    }


def seed_devices(kafka: dict[str, str], data: dict[str, Any]) -> None:
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [
        {"device_id": d, "site": f"s-{d}", "report_s": 10} for d in "abc"] + [
        {"device_id": "d", "site": "s-d", "report_s": None}]))


def test_a_silent_devices_gap_opens_is_retracted_opens_again_and_closes_once_each(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        mysql_url: str, caplog: pytest.LogCaptureFixture) -> None:
    data = make_config(kafka, unique, tmp_path, mysql_url)
    seed_devices(kafka, data)
    cfg = config.parse(data, "test.yaml")
    produce_events(kafka, data["events"]["topic"], FIRST)
    with caplog.at_level(logging.INFO, logger="enrich.sinks.gaps"):
        EnrichJob(cfg, available_now=True).run(spark)
        first = read_all(kafka, data["gaps"]["output"]["kafka"]["topic"])
        assert [json.loads(m.value())["kind"] for m in first] == ["opened"]
        take(cfg, tmp_path / "savepoint", spark=spark)
        assert rescale(cfg, 4, spark=spark).after == 4  # the gap tables move with the state step's partitions
        produce_events(kafka, data["events"]["topic"], THEN)
        EnrichJob(cfg, available_now=True).run(spark)  # a restart: the gaps and the partitions' times kept
    # A fork of the savepoint onto 8 buckets (4 before) writes the same records after it, to its own topic.
    fork = {**data, "checkpoint": str(tmp_path / "fork"), "output": {"parquet": {"path": str(tmp_path / "fork-out")}},
            "state": {**data["state"], "buckets": 8}, "gaps": {**data["gaps"], "output": {"kafka": {
                "topic": unique("fork-gaps")}}}}
    EnrichJob(config.parse(fork, "fork.yaml"), available_now=True, from_savepoint=tmp_path / "savepoint").run(spark)
    forked = [json.loads(m.value()) for m in read_all(kafka, fork["gaps"]["output"]["kafka"]["topic"])]

    values = check_records(kafka, data)
    rows = pq.read_table(tmp_path / "device_10s").to_pandas()
    latest = rows.sort_values("_revision").groupby(["device_id", "window_start"]).tail(1)
    c = latest[latest["device_id"] == "c"].sort_values("window_start")
    # c: events in windows 0, 10 and 20 (25, 28), silent from 28 to 90: windows 30 to 80 in the gap.
    assert [(int(seconds(w)), n, g) for w, n, g in zip(c["window_start"], c["_events"], c["_gap"],
                                                                     strict=True)] == [
        (0, 1, False), (10, 1, False), (20, 2, False), *[(s, 0, True) for s in range(30, 90, 10)], (90, 1, False)]
    assert not latest[latest["device_id"] != "c"]["_gap"].any()
    assert forked == values[1:]  # the retraction names the gap the savepoint's job opened
    logged = [r.getMessage() for r in caplog.records if "gap records" in r.getMessage()]
    assert sum(int(n) for line in logged for n in re.findall(r"[a-z_]+ (\d+)", line.split("gap records")[1])) == 4, \
        logged  # each record in the line of the batch that wrote it, none twice


def check_records(kafka: dict[str, str], data: dict[str, Any]) -> list[dict[str, Any]]:
    """The expected records, once each, in the topic and the table; returns the topic's."""
    records = read_all(kafka, data["gaps"]["output"]["kafka"]["topic"])
    values = [json.loads(m.value()) for m in records]
    assert [m.key().decode() for m in records] == [v["gap_id"] for v in values]
    t0 = int(T0.timestamp()) * S
    one, two = gap_id("c", t0 + 10 * S), gap_id("c", t0 + 28 * S)
    assert [(v["kind"], v["gap_id"]) for v in values] == [("opened", one), ("retracted", one), ("opened", two),
                                                         ("closed", two)], values
    opened, _, again, closed = values
    assert (opened["device_id"], opened["last_seen"], opened["opened_at"], opened["expected_every_s"],
            opened["site"], opened["partition"]) == ("c", iso(10), iso(40), 10.0, "s-c", 0)
    assert (again["last_seen"], again["opened_at"]) == (iso(28), iso(58))
    assert (closed["start"], closed["end"], closed["duration_s"]) == (iso(28), iso(90), 62.0)

    # The table holds the same records, one row each by (gap_id, kind).
    db = data["gaps"]["output"]["database"]
    engine = sa.create_engine(db["url"])
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT gap_id, kind, device_id, duration_s FROM {db['table']}")).all()
    engine.dispose()
    assert sorted((r[0], r[1], r[2], r[3]) for r in rows) == sorted(
        (v["gap_id"], v["kind"], "c", v.get("duration_s")) for v in values)
    return values


def test_a_sigkill_after_a_batchs_gap_records_are_written_writes_none_again(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, pg_url: str) -> None:
    """Killed once the batch that retracts c's first gap has written its records (the topic and its
    ledger, the table and its fence, gaps.json), before Spark commits it: the restart replays the
    batch against the partition times it first had, and writes none of its records again."""
    data = make_config(kafka, unique, tmp_path, pg_url)
    seed_devices(kafka, data)
    produce_events(kafka, data["events"]["topic"], FIRST + THEN)
    config_path = tmp_path / "enrich.yaml"
    config_path.write_text(yaml.safe_dump({**data, "spark": {"spark.sql.shuffle.partitions": "2"}}))
    flag, log = tmp_path / "killed", tmp_path / "job.log"
    proc = start_job(config_path, log, "--available-now", kill=f"gaps:retracted:{flag}")
    assert proc.wait(bound(300)) != 0, log.read_text()[-3000:]
    assert flag.exists(), log.read_text()[-3000:]
    batch = int(flag.read_text())
    proc = start_job(config_path, log, "--available-now")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert re.search(rf"batch {batch} already committed to gaps_\w+ \(last {batch}\): skipped", text), text[-3000:]
    assert re.search(rf"batch {batch} slot 0: committed to gaps_\w+ before; skipped", text), text[-3000:]
    check_records(kafka, data)

"""``output.database`` with ``write: state`` in the running job, on real Spark, the real broker and
the local PostgreSQL and MariaDB: after each run the table holds one row per device in state, equal
to its state (and the join columns of its latest event); devices whose state expired are deleted."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from enrich.ops.device import device_state
from enrich.ops.state_db import device_state_from_database
from enrich.sinks.database.connect import connect
from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.timing import bound

pytestmark = pytest.mark.integration

DEVICES = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
T0 = datetime(2026, 1, 1, tzinfo=UTC)
NO_DATA_BATCHES = "spark.sql.streaming.noDataMicroBatches.enabled"


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def iso(minutes: float) -> str:
    return at(minutes).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def db_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, url: str, write: str = "state",
              **output: Any) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, n INT",
                   "starting_offsets": "earliest", "required": ["n"]},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"database": {"url": url, "table": unique("state"), "write": write}, **output},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
        "max_events_per_batch": 4,
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "10m", "watermark": "1m", "buckets": 4,
                  "aggregates": {"temp": ["last", "max", "mean"]}},
    }


def run(spark: SparkSession, data: dict[str, Any]) -> None:
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)


def table(url: str, name: str, order: str = "device_id") -> dict[Any, dict[str, Any]]:
    dialect = "postgresql" if url.startswith("postgresql") else "mysql"
    conn = connect(url, dialect)  # type: ignore[arg-type]
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT * FROM {name}")
            names = [d[0] for d in cur.description]
            rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        conn.close()
    for r in rows:
        for k, v in r.items():
            if isinstance(v, datetime) and v.tzinfo is None:  # MariaDB's DATETIME: UTC
                r[k] = v.replace(tzinfo=UTC)
    return {r[order]: r for r in rows}


@pytest.mark.parametrize("db", ["pg_url", "mysql_url"])
def test_state_rows_equal_the_devices_state(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str],
                                            tmp_path: Path, request: pytest.FixtureRequest, db: str) -> None:
    url = request.getfixturevalue(db)
    data = db_config(kafka, unique, tmp_path, url)
    name = data["output"]["database"]["table"]
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
    events = data["events"]["topic"]
    produce_events(kafka, events, [
        {"device_id": "a", "ts": iso(0), "temp": 10.0, "n": 1},
        {"device_id": "b", "ts": iso(1), "temp": None, "n": 2},
        {"device_id": "a", "ts": iso(2), "temp": 30.0, "n": 3},
        {"device_id": "a", "ts": iso(3), "temp": None, "n": 4},
        # second batch: the watermark is 3m - 1m = 2m
        {"device_id": "b", "ts": iso(4), "temp": 5.0, "n": 5},
        {"device_id": "c", "ts": iso(5), "temp": 1.0, "n": 6},
        {"device_id": "a", "ts": iso(1.5), "temp": 20.0, "n": 7},     # late: not applied
        {"device_id": "c", "ts": iso(6), "temp": 3.0, "n": 8},
    ])
    run(spark, data)
    rows = table(url, name)
    assert sorted(rows) == ["a", "b", "c"]
    assert {k: (r["events"], r["first_seen"], r["last_seen"], r["temp_last"], r["temp_max"], r["temp_mean"])
            for k, r in rows.items()} == {
        "a": (3, at(0), at(3), 30.0, 30.0, 20.0),
        "b": (2, at(1), at(4), 5.0, 5.0, 5.0),
        "c": (2, at(5), at(6), 3.0, 3.0, 2.0)}
    assert {k: (r["owner"], bool(r["_devices_matched"])) for k, r in rows.items()} == {
        "a": ("ann", True), "b": (None, False), "c": (None, False)}
    assert "n" not in rows["a"] and "temp" not in rows["a"]     # the events' own columns are not state

    # enrich lookup --state answers from the table what the checkpoint answers, without Spark.
    cfg = config.parse(data, "test.yaml")
    started = time.monotonic()
    answer = device_state_from_database(cfg, "a")
    assert time.monotonic() - started < bound(1.0)
    assert answer == {**device_state(cfg, "a", spark=spark).to_json(), "source": "database"}
    assert answer["state"]["events"] == 3 and answer["batch_id"] is not None
    absent = device_state_from_database(cfg, "zz")
    assert (absent["found"], absent["state"], absent["source"]) == ("absent", None, "database")

    # A later run: its events move the watermark (33m - 1m) past a's and b's last_seen + 10m: their
    # state is dropped (in the batch Spark runs without data to move the watermark on), and so are
    # their rows; d is new, c goes on.
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "d", "owner": "dan"}]))
    produce_events(kafka, events, [{"device_id": "d", "ts": iso(32), "temp": 7.0, "n": 9},
                                   {"device_id": None, "ts": iso(32), "temp": 1.0, "n": 11},   # a dead letter
                                   {"device_id": "c", "ts": iso(33), "temp": None, "n": 10}])
    run(spark, data)
    rows = table(url, name)
    assert sorted(rows) == ["c", "d"]
    assert (rows["c"]["events"], rows["c"]["last_seen"], rows["c"]["temp_mean"]) == (3, at(33), 2.0)
    assert (rows["d"]["events"], rows["d"]["owner"]) == (1, "dan")
    # The tasks hand the dead letters back; the driver writes them to their topic.
    dead = [(json.loads(m.value())["n"], dict(m.headers())["error"]) for m in read_all(kafka, data["dead_letter_topic"])]
    assert dead == [(11, b"state.key device_id is null")]


def test_state_rows_hold_the_devices_call_results(spark: SparkSession, kafka: dict[str, str],
                                                  unique: Callable[[str], str], tmp_path: Path, pg_url: str) -> None:
    """A call's results sit in the state struct (``state.risk_score``), so ``write: state`` keeps
    them as the device row's columns, as the device's last event carries them."""
    from tests.enrich.calls.server import serve

    with serve() as service:
        data = db_config(kafka, unique, tmp_path, pg_url)
        data["calls"] = [{"name": "risk", "url": service.url("/score"), "refresh": "every event",
                          "body": {"device": "{device_id}", "mean": "{state.temp_mean}", "events": "{state.events}"},
                          "response": {"score": "DOUBLE", "level": "STRING"}}]
        data["output"]["kafka"] = {"topic": unique("enriched")}
        publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
        produce_events(kafka, data["events"]["topic"], [
            {"device_id": "a", "ts": iso(0), "temp": 10.0, "n": 1},
            {"device_id": "b", "ts": iso(1), "temp": 4.0, "n": 2},
            {"device_id": "a", "ts": iso(2), "temp": 30.0, "n": 3},
            {"device_id": "a", "ts": iso(3), "temp": None, "n": 4},
            {"device_id": "b", "ts": iso(4), "temp": 6.0, "n": 5}])
        run(spark, data)
    rows = table(pg_url, data["output"]["database"]["table"])
    last = {}
    for m in read_all(kafka, data["output"]["kafka"]["topic"]):
        e = json.loads(m.value())
        if e["n"] > last.get(e["device_id"], {}).get("n", 0):
            last[e["device_id"]] = e
    # /score answers events * 10 + mean: a after 3 events (mean 20), b after 2 (mean 5).
    assert {k: (r["risk_score"], r["risk_level"]) for k, r in rows.items()} == {"a": (50.0, "low"), "b": (25.0, "low")}
    assert {k: (e["state"]["risk_score"], e["state"]["risk_level"]) for k, e in last.items()} == \
        {k: (r["risk_score"], r["risk_level"]) for k, r in rows.items()}


def test_a_fork_deletes_the_rows_of_the_devices_its_watermark_floor_expired(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        pg_url: str) -> None:
    """A fork that takes the original job's table over (the original stopped): in its first batch it
    deletes the rows of the devices the savepoint's watermark (its floor) expired, as its state step
    drops them, though its own watermark has not started."""
    from enrich.ops import savepoint

    data = db_config(kafka, unique, tmp_path, pg_url)
    data["joins"] = []
    data["state"]["ttl"] = "5m"
    events, name = data["events"]["topic"], data["output"]["database"]["table"]
    produce_events(kafka, events, [{"device_id": f"d{n % 10}", "ts": iso(n), "temp": float(n), "n": n}
                                   for n in range(30)])
    # The original stops right after a batch with events (as a stop between two triggers leaves it),
    # not after the batch without events that Spark runs to move the watermark on.
    spark.conf.set(NO_DATA_BATCHES, "false")
    try:
        run(spark, data)
    finally:
        spark.conf.unset(NO_DATA_BATCHES)
    # Its last batch ran with the watermark of the one before (minute 26): d2 and d3, last seen at
    # minutes 22 and 23, keep their rows, though the savepoint's watermark (28) expired them.
    assert sorted(table(pg_url, name)) == [f"d{i}" for i in range(2, 10)]
    point = tmp_path / "savepoint"
    savepoint.take(config.parse(data, "test.yaml"), point, spark=spark)
    produce_events(kafka, events, [{"device_id": "d9", "ts": iso(28.5), "temp": 1.0, "n": 100}])
    forked = {**data, "checkpoint": str(tmp_path / "fork")}
    EnrichJob(config.parse(forked, "test.yaml"), available_now=True, from_savepoint=point).run(spark)
    rows = table(pg_url, name)
    assert sorted(rows) == [f"d{i}" for i in range(4, 10)]
    # d9's state went on from the savepoint's (its events ten minutes apart, each one started afresh by the TTL).
    assert (rows["d9"]["events"], rows["d9"]["first_seen"], rows["d9"]["last_seen"]) == (2, at(28.5), at(29))


def test_a_database_still_starting_when_the_job_starts_is_waited_for(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        mysql_url: str) -> None:
    """The output's database refuses connections when the job starts (a relay in front of
    MariaDB, opened once the job has logged its first retry): the start waits for it, as a batch's
    write does, instead of failing on the refused connection."""
    import logging
    from urllib.parse import urlsplit, urlunsplit

    from tests.netproxy import TcpRelay

    parts = urlsplit(mysql_url)
    relay = TcpRelay((parts.hostname or "127.0.0.1", parts.port or 3306))  # not started: refused
    url = urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{relay.port}"))
    data = db_config(kafka, unique, tmp_path, url)
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
    produce_events(kafka, data["events"]["topic"], [{"device_id": "a", "ts": iso(0), "temp": 1.0, "n": 1}])
    retries: list[str] = []

    class OpenOnRetry(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("opening the output failed (attempt 1/"):
                retries.append(record.getMessage())
                relay.start()

    retry_log = logging.getLogger("refstream.retry")
    handler = OpenOnRetry(logging.WARNING)
    retry_log.addHandler(handler)
    try:
        run(spark, data)
    finally:
        retry_log.removeHandler(handler)
        relay.stop()
    assert len(retries) == 1 and "Connection refused" in retries[0], retries
    rows = table(mysql_url, data["output"]["database"]["table"])
    assert (rows["a"]["events"], rows["a"]["owner"]) == (1, "ann")

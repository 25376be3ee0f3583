"""Rows a database would refuse, in the running job (real Spark, the real broker, the local
PostgreSQL and MariaDB): each such event is a dead letter naming the column and the reason, written
by the executor tasks, and is in neither output (not in the table, not in the Kafka output beside
it); the batch commits instead of failing on every restart. A ``%`` in a column name is written."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from tests.enrich.helpers import produce_events, read_all
from tests.enrich.sinks.test_database_state import db_config, iso, table

pytestmark = pytest.mark.integration


def dead_letters(kafka: dict[str, str], topic: str) -> dict[int, str]:
    """n -> the error header of each dead letter, by its source offset (event n is at offset n - 1)."""
    out = {}
    for m in read_all(kafka, topic):
        headers = {k: v.decode() for k, v in m.headers()}
        out[int(headers["source.offset"]) + 1] = headers["error"]
    return out


def test_postgresql_refusals_are_dead_letters_in_neither_output(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, pg_url: str) -> None:
    """NUL in a string (text), NaN inside a nested value (JSONB); with output.kafka beside."""
    data = {**db_config(kafka, unique, tmp_path, pg_url, write="events"), "joins": [], "max_events_per_batch": 100}
    del data["state"]
    data["output"]["kafka"] = {"topic": unique("enriched")}
    data["events"]["schema"] = "device_id STRING, ts TIMESTAMP, note STRING, vals ARRAY<DOUBLE>, n INT"
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": "a", "ts": iso(0), "note": "ok", "vals": [1.0], "n": 1},
        {"device_id": "a", "ts": iso(0), "note": "a\u0000b", "vals": [1.0], "n": 2},
        {"device_id": "b", "ts": iso(0), "note": "ok", "vals": [1.0, math.nan], "n": 3},
        {"device_id": "b", "ts": iso(0), "note": "ok", "vals": [2.0], "n": 4}])
    job = EnrichJob(config.parse(data, "test.yaml"), available_now=True)
    job.run(spark)
    assert sorted(table(pg_url, data["output"]["database"]["table"], order="n")) == [1, 4]
    assert sorted(json.loads(m.value())["n"] for m in read_all(kafka, data["output"]["kafka"]["topic"])) == [1, 4]
    dead = dead_letters(kafka, data["dead_letter_topic"])
    assert sorted(dead) == [2, 3]
    assert "column 'note' holds a NUL character" in dead[2]
    assert "column 'vals' holds NaN or Infinity in a nested value" in dead[3]


def test_mariadb_refusals_are_dead_letters_written_by_the_tasks(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        mysql_url: str) -> None:
    """A key longer than the key column; a column named ``load%_max``; +-Infinity readings, which the
    state's aggregates ignore, so no row of the state holds one."""
    data = {**db_config(kafka, unique, tmp_path, mysql_url), "joins": [], "max_events_per_batch": 100}
    data["events"]["schema"] = "device_id STRING, ts TIMESTAMP, temp DOUBLE, `load%` DOUBLE, n INT"
    data["state"]["aggregates"] = {"temp": ["last"], "load%": ["max"]}
    long_key = "x" * 300
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": "a", "ts": iso(0), "temp": 1.0, "load%": 0.5, "n": 1},
        {"device_id": "b", "ts": iso(0), "temp": math.inf, "load%": 0.5, "n": 2},
        {"device_id": long_key, "ts": iso(0), "temp": 1.0, "load%": 0.5, "n": 3},
        {"device_id": "c", "ts": iso(0), "temp": -math.inf, "load%": 0.5, "n": 4},
        {"device_id": "d", "ts": iso(0), "temp": 2.0, "load%": 0.7, "n": 5}])
    job = EnrichJob(config.parse(data, "test.yaml"), available_now=True)
    job.run(spark)
    rows = table(mysql_url, data["output"]["database"]["table"])
    # The state's aggregates ignore +-Infinity as they ignore NaN (enrich.state.engine): b's and c's
    # rows hold no temperature, and nothing refuses them.
    assert {k: (r["temp_last"], r["load%_max"]) for k, r in rows.items()} == {
        "a": (1.0, 0.5), "b": (None, 0.5), "c": (None, 0.5), "d": (2.0, 0.7)}
    dead = dead_letters(kafka, data["dead_letter_topic"])
    assert sorted(dead) == [3]
    assert "column 'device_id' is the key and longer than its 255 characters" in dead[3]
    # The tasks wrote them (no dead-letter writer on the driver) and counted them.
    assert job.started.dead is None and job.started.sink.counted.dead_letters is not None


def test_mariadb_events_with_nan_or_infinity_are_dead_letters(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        mysql_url: str) -> None:
    """``write: events`` keeps each reading as sent, and a MariaDB DOUBLE holds no NaN or +-Infinity:
    those events are dead letters naming the column, and the others are written."""
    data = {**db_config(kafka, unique, tmp_path, mysql_url, write="events"), "joins": [], "max_events_per_batch": 100}
    del data["state"]
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": "a", "ts": iso(0), "temp": 1.0, "n": 1},
        {"device_id": "a", "ts": iso(0), "temp": math.inf, "n": 2},
        {"device_id": "b", "ts": iso(0), "temp": -math.inf, "n": 3},
        {"device_id": "b", "ts": iso(0), "temp": math.nan, "n": 4},
        {"device_id": "c", "ts": iso(0), "temp": 2.5, "n": 5}])
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)
    rows = table(mysql_url, data["output"]["database"]["table"], order="n")
    assert sorted(rows) == [1, 5] and rows[5]["temp"] == 2.5
    dead = dead_letters(kafka, data["dead_letter_topic"])
    assert sorted(dead) == [2, 3, 4]
    assert all("column 'temp' holds NaN or Infinity" in why for why in dead.values()), dead

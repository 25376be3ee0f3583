"""As-of joins end to end: the real refresher publishes a diff-mode and an incremental-mode dataset
from MariaDB, the rows change, and only then does the job (real Spark, the real broker) enrich
events from before and after the change. Every event gets the row valid at its time, by broadcast
and by partitioned joins; a second job with a new checkpoint over the same events, after the rows
changed once more, writes the same reference columns (a deterministic backfill)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from enrich.ops.status import status
from refresh.config import load_config
from refresh.runner import Refresher
from refstream.contract import parse_time
from refstream.errors import ConfigError
from tests.enrich.helpers import produce_events, read_all

pytestmark = pytest.mark.integration


def execute(url: str, *statements: str, params: dict[str, Any] | None = None) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for s in statements:
            conn.execute(sa.text(s), params or {})
    engine.dispose()


def db_clock(url: str) -> datetime:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        got = conn.execute(sa.text("SELECT UTC_TIMESTAMP(6)")).scalar()
    engine.dispose()
    return got.replace(tzinfo=UTC)


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def job_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, topics: dict[str, str],
               strategy: str, name: str) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": topics["events"], "schema": "device_id BIGINT, ts TIMESTAMP, n INT",
                   "starting_offsets": "earliest"},
        "joins": [{"dataset": "dd", "topic": topics["dd"], "on": "device_id", "columns": ["owner"], "prefix": "d_",
                   "as_of": True, "strategy": strategy},
                  {"dataset": "di", "topic": topics["di"], "on": "device_id", "columns": ["owner"], "prefix": "i_",
                   "as_of": True, "history": "30d", "strategy": strategy}],
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / name),
        "state": {"key": "device_id", "timestamp": "ts", "watermark": "1d", "buckets": 4},
    }


def run_job(spark: SparkSession, kafka: dict[str, str], data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)
    rows = [json.loads(m.value()) for m in read_all(kafka, data["output"]["kafka"]["topic"])]
    by_n = {r["n"]: r for r in rows}
    assert len(by_n) == len(rows), "an event was written twice"
    return by_n


REFERENCE = ("d_owner", "_d_dd_matched", "i_owner", "_i_di_matched", "_as_of_clipped")


@pytest.mark.parametrize("strategy", ["broadcast", "partitioned"])
def test_events_get_the_row_valid_at_their_time_and_a_backfill_writes_the_same(
        spark: SparkSession, kafka: dict[str, str], mysql_url: str, unique: Callable[[str], str], tmp_path: Path,
        strategy: str) -> None:
    t_diff, t_inc = unique("asof_diff"), unique("asof_inc")
    topics = {"events": unique("events"), "dd": unique("ref.dd"), "di": unique("ref.di")}
    start = db_clock(mysql_url)
    cursor1 = start - timedelta(hours=2)
    execute(mysql_url, f"CREATE TABLE {t_diff} (id INT PRIMARY KEY, owner VARCHAR(10))",
            f"INSERT INTO {t_diff} VALUES (1, 'd1'), (2, 'd2')",
            f"CREATE TABLE {t_inc} (id INT PRIMARY KEY, owner VARCHAR(10), last_update DATETIME(6))",
            f"INSERT INTO {t_inc} VALUES (1, 'i1', :c), (2, 'i2', :c)", params={"c": cursor1.replace(tzinfo=None)})
    path = tmp_path / "refresh.yaml"
    path.write_text(yaml.safe_dump({
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]}, "state_dir": str(tmp_path / "state"),
        "datasets": {
            "dd": {"source": {"url": mysql_url, "table": t_diff}, "key": "id", "topic": topics["dd"],
                   "max_delete_fraction": 1},
            "di": {"source": {"url": mysql_url, "table": t_inc}, "key": "id", "topic": topics["di"],
                   "mode": "incremental", "incremental": {"column": "last_update", "lag": "1s"}}}}))
    refresher = Refresher(load_config(path), progress=False)

    before1 = datetime.now(UTC)
    refresher.run("dd")
    refresher.run("di")  # the first run reads everything: valid from the cursor, cursor1
    time.sleep(0.2)
    mid = datetime.now(UTC)  # after the first rows, before any change
    time.sleep(0.2)
    cursor2 = db_clock(mysql_url)
    execute(mysql_url, f"UPDATE {t_diff} SET owner = 'd1-new' WHERE id = 1", f"DELETE FROM {t_diff} WHERE id = 2",
            f"UPDATE {t_inc} SET owner = CONCAT(owner, '-new'), last_update = :c",
            params={"c": cursor2.replace(tzinfo=None)})
    time.sleep(1.2)  # past the incremental lag, so that the second run's window holds cursor2
    before2 = datetime.now(UTC)
    refresher.run("dd")
    assert refresher.run("di").updates == 2
    after = datetime.now(UTC) + timedelta(seconds=1)

    produce_events(kafka, topics["events"], [
        {"device_id": 1, "ts": iso(before1 - timedelta(hours=3)), "n": 1},  # older than every version: clipped
        {"device_id": 1, "ts": iso(cursor1 + timedelta(minutes=30)), "n": 2},  # di's first row; dd's clipped
        {"device_id": 1, "ts": iso(mid), "n": 3},    # both first rows, though both changed since
        {"device_id": 1, "ts": iso(after), "n": 4},  # both new rows
        {"device_id": 2, "ts": iso(mid), "n": 5},    # dd's row before its delete
        {"device_id": 2, "ts": iso(after), "n": 6},  # dd deleted by then: no match
        {"device_id": 3, "ts": iso(mid), "n": 7},    # in neither
    ])
    live_config = job_config(kafka, unique, tmp_path, topics, strategy, "live")
    live = run_job(spark, kafka, live_config)
    got = {n: tuple(r[c] for c in REFERENCE) for n, r in live.items()}
    assert got == {
        1: ("d1", True, "i1", True, True),
        2: ("d1", True, "i1", True, True),
        3: ("d1", True, "i1", True, False),
        4: ("d1-new", True, "i1-new", True, False),
        5: ("d2", True, "i2", True, False),
        6: (None, False, "i2-new", True, False),
        7: (None, False, None, False, False),
    }

    if strategy == "broadcast":  # the driver's copies: complete as of the second runs (status --json)
        complete = {d.dataset: d.complete_as_of for d in status(config.parse(live_config, "test.yaml")).dimensions}
        for ds in ("dd", "di"):  # dd: its read's start; di: the database clock at its read's start less the lag
            at = parse_time(complete[ds] or "")
            assert before2 - timedelta(seconds=1.5) <= at <= after, (ds, at, before2, after)

    # The rows change again; a backfill over the same events with a new checkpoint writes what the live job wrote.
    execute(mysql_url, f"UPDATE {t_diff} SET owner = 'd1-newer' WHERE id = 1",
            f"UPDATE {t_inc} SET owner = 'newer', last_update = UTC_TIMESTAMP(6)")
    time.sleep(1.2)
    refresher.run("dd")
    assert refresher.run("di").updates == 2
    backfill = run_job(spark, kafka, {**job_config(kafka, unique, tmp_path, topics, strategy, "backfill")})
    assert {n: tuple(r[c] for c in REFERENCE) for n, r in backfill.items()} == got

    if strategy == "partitioned":  # the buckets of a checkpoint hold versions: as_of cannot be turned off
        latest = job_config(kafka, unique, tmp_path, topics, strategy, "live")
        latest["joins"] = [{**{k: v for k, v in j.items() if k != "history"}, "as_of": False} for j in latest["joins"]]
        with pytest.raises(ConfigError, match=r"the partitioned joins \(datasets, topics, selected columns\) changed"):
            run_job(spark, kafka, latest)

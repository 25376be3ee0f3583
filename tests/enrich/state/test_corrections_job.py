"""Corrections end to end: the real refresher publishes a dataset from MariaDB, the job (real Spark,
the real broker, the state step) writes events with it, then a change backdated by its
``last_update`` reaches the changelog; the job's next batch writes a correction of every event the
change concerns, and the output with its corrections applied equals what a fresh job (a new
checkpoint) writes over the same events."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from enrich.ops.rescale import rescale
from enrich.ops.savepoint import take
from refresh.config import load_config
from refresh.runner import Refresher
from tests.enrich.calls.server import Service, serve
from tests.enrich.helpers import produce_events, read_all
from tests.enrich.joins.test_asof_job import db_clock, execute, iso
from tests.timing import bound

pytestmark = pytest.mark.integration

REFERENCE = ("site", "_devices_matched")


def job_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, topics: dict[str, str],
               name: str, output: dict[str, Any]) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": topics["events"], "schema": "device_id BIGINT, ts TIMESTAMP, n INT",
                   "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": topics["devices"], "on": "device_id", "columns": ["site"],
                   "as_of": True, "corrections": {"horizon": "24h"}}],
        "output": output,
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / name),
        "state": {"key": "device_id", "timestamp": "ts", "watermark": "1d", "buckets": 4},
    }


def per_device(topic: str) -> dict[str, Any]:
    """A rollup by the events' own columns (what a corrected join adds runs after the rollup step)."""
    return {"name": "device_1m", "by": ["device_id"], "window": "1m", "metrics": {"n": ["count", "sum"]},
            "output": {"kafka": {"topic": topic}}}


def latest_windows(rows: list[dict[str, Any]]) -> dict[tuple[int, str], tuple[int, int | None]]:
    """Each rollup window's latest row, as (events, sum of n)."""
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for r in rows:
        at = (r["device_id"], r["window_start"])
        if at not in out or r["_revision"] > out[at]["_revision"]:
            out[at] = r
    return {at: (r["_events"], r["n_sum"]) for at, r in out.items()}


def outputs(kafka: dict[str, str], topic: str) -> list[dict[str, Any]]:
    return [json.loads(m.value()) for m in read_all(kafka, topic)]


def latest(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Every event's latest record (an upsert by its identity, the greatest revision winning)."""
    out: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in records:
        ident = (r["_topic"], r["_partition"], r["_offset"])
        if ident not in out or r["_revision"] > out[ident]["_revision"]:
            out[ident] = r
    return {r["n"]: r for r in out.values()}


def parquet_records(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows = [r for f in sorted(path.glob("batch_id=*/*.parquet")) for r in pq.read_table(f).to_pylist()]
    for r in rows:  # as the JSON has them (Spark's Parquet timestamps are UTC, read back without a zone)
        if r["_cause"] is not None:
            vf = r["_cause"]["valid_from"]
            r["_cause"]["valid_from"] = iso(vf if vf.tzinfo is not None else vf.replace(tzinfo=UTC))
    return rows


def table_records(url: str, table: str) -> list[dict[str, Any]]:
    """The write: events table's rows as records (a correction replaced its event's row)."""
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(url, row_factory=dict_row) as conn:
        rows = conn.execute(f'SELECT * FROM "{table}"').fetchall()
    for r in rows:  # as the JSON has them: the cause's time in ISO form, UTC
        r["ts"] = iso(r["ts"])
        if r["_cause"] is not None:
            r["_cause"]["valid_from"] = iso(datetime.fromisoformat(r["_cause"]["valid_from"]))
    return rows


def forget_last_batch(checkpoint: Path) -> int:
    """Make Spark run the last committed batch again, as after a crash before its commit was recorded
    (a batch planned after it goes too: Spark would run that one instead)."""
    commits, offsets = checkpoint / "spark" / "commits", checkpoint / "spark" / "offsets"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    gone = [commits / str(last)] + [p for p in offsets.iterdir() if p.name.isdigit() and int(p.name) > last]
    for f in gone:
        f.unlink()
        (f.parent / f".{f.name}.crc").unlink(missing_ok=True)
    return last


def fork_goes_on_correcting(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str],
                            tmp_path: Path, devices: Devices, live: dict[str, Any],
                            records: Callable[[], list[dict[str, Any]]]) -> None:
    """A savepoint of ``live`` (its events 2 and 3 corrected once, in buckets it rescaled), a second
    backdated move and a later event, then a job forked from the savepoint onto 8 buckets where
    the original had 4: it writes what the original wrote after the savepoint, the second
    correction of event 3 (revision 2: the savepoint held its revision) and event 7. Its dimension
    starts at the savepoint's positions; the move reaches its first batch as a change."""
    point = tmp_path / "savepoint"
    take(config.parse(live, "test.yaml"), point, spark=spark)
    before = records()
    devices.move("s-7", devices.t0 + timedelta(minutes=15))
    produce_events(kafka, devices.topics["events"], [{"device_id": 2, "ts": iso(devices.t0 + timedelta(minutes=26)),
                                                      "n": 7}])
    EnrichJob(config.parse(live, "test.yaml"), available_now=True).run(spark)

    def order(r: dict[str, Any]) -> tuple[int, int]:
        return r["n"], r["_revision"]

    after = sorted((r for r in records() if r not in before), key=order)
    assert [(r["n"], r["_kind"], r["_revision"], r["site"]) for r in after] == [
        (3, "correction", 2, "s-7"), (7, "event", 0, "s-2")]
    fork = job_config(kafka, unique, tmp_path, devices.topics, "fork",
                      {"parquet": {"path": str(tmp_path / "fork_out")}})
    fork["state"]["buckets"] = 8
    EnrichJob(config.parse(fork, "test.yaml"), available_now=True, from_savepoint=point).run(spark)
    assert sorted(parquet_records(tmp_path / "fork_out"), key=order) == after


@dataclass
class Devices:
    """The devices table in MariaDB (devices 1 and 2 at s-2 since ``t0``, half an hour ago by the
    database's clock), published by the real refresher (``incremental`` on ``last_update``)."""

    mysql_url: str
    table: str
    topics: dict[str, str]
    t0: datetime
    refresher: Refresher

    @classmethod
    def published(cls, kafka: dict[str, str], mysql_url: str, unique: Callable[[str], str],
                  tmp_path: Path) -> Devices:
        table = unique("corr_devices")
        topics = {"events": unique("events"), "devices": unique("ref.devices")}
        t0 = db_clock(mysql_url) - timedelta(minutes=30)
        execute(mysql_url, f"CREATE TABLE {table} (id INT PRIMARY KEY, site VARCHAR(10), last_update DATETIME(6))",
                f"INSERT INTO {table} VALUES (1, 's-2', :t), (2, 's-2', :t)", params={"t": t0.replace(tzinfo=None)})
        path = tmp_path / "refresh.yaml"
        path.write_text(yaml.safe_dump({
            "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]}, "state_dir": str(tmp_path / "state"),
            "datasets": {"devices": {"source": {"url": mysql_url, "table": table}, "key": "id",
                                     "topic": topics["devices"], "mode": "incremental",
                                     "incremental": {"column": "last_update", "lag": "1h"}}}}))
        refresher = Refresher(load_config(path), progress=False)
        refresher.run("devices")
        return cls(mysql_url, table, topics, t0, refresher)

    def move(self, site: str, at: datetime, device: int = 1) -> None:
        """A device moved to ``site`` as of ``at``, learnt only now: backdated, then published."""
        execute(self.mysql_url, f"UPDATE {self.table} SET site = :site, last_update = :t WHERE id = :id",
                params={"site": site, "t": at.replace(tzinfo=None), "id": device})
        time.sleep(1.2)  # the refresher's next run reads past its last one
        assert self.refresher.run("devices").updates == 1


@pytest.mark.parametrize("sink", ["kafka", "parquet", "postgresql"])
def test_a_backdated_change_corrects_the_events_written_before_it_and_equals_a_fresh_job(
        spark: SparkSession, kafka: dict[str, str], mysql_url: str, pg_url: str, unique: Callable[[str], str],
        tmp_path: Path, sink: str) -> None:
    devices = Devices.published(kafka, mysql_url, unique, tmp_path)
    topics, t0 = devices.topics, devices.t0

    minute = timedelta(minutes=1)
    produce_events(kafka, topics["events"], [
        {"device_id": 1, "ts": iso(t0 + 5 * minute), "n": 1},    # before the move: stays s-2
        {"device_id": 1, "ts": iso(t0 + 10 * minute), "n": 2},   # after it: corrected to s-6
        {"device_id": 1, "ts": iso(t0 + 20 * minute), "n": 3},   # after it: corrected to s-6
        {"device_id": 2, "ts": iso(t0 + 10 * minute), "n": 4},   # another device: not corrected
        {"device_id": 3, "ts": iso(t0 + 10 * minute), "n": 5},   # no row at all
    ])
    out_topic, out_dir, out_table = unique("enriched"), tmp_path / "out", unique("events")
    output = {"kafka": {"kafka": {"topic": out_topic}}, "parquet": {"parquet": {"path": str(out_dir)}},
              "postgresql": {"database": {"url": pg_url, "table": out_table, "write": "events"}}}[sink]
    live = job_config(kafka, unique, tmp_path, topics, "live", output)
    if sink == "kafka":  # beside a rollup, which the corrections leave alone: it holds no column they correct
        live["rollups"] = [per_device(unique("rollup"))]

    def records() -> list[dict[str, Any]]:
        if sink == "kafka":
            return outputs(kafka, out_topic)
        return parquet_records(out_dir) if sink == "parquet" else table_records(pg_url, out_table)

    EnrichJob(config.parse(live, "test.yaml"), available_now=True).run(spark)
    first = records()
    assert sorted(r["n"] for r in first) == [1, 2, 3, 4, 5]
    assert {r["_kind"] for r in first} == {"event"} and {r["_revision"] for r in first} == {0}
    assert {r["n"]: r["site"] for r in first} == {1: "s-2", 2: "s-2", 3: "s-2", 4: "s-2", 5: None}
    if sink == "parquet":  # the buckets' written events move with them to other state partitions
        moved = rescale(config.parse(live, "test.yaml"), 3, spark=spark)
        assert (moved.before, moved.after) == (2, 3) and moved.batch_id is not None

    # Device 1 moved to s-6 eight minutes after t0; the database learns it only now.
    moved = t0 + 8 * minute
    devices.move("s-6", moved)
    produce_events(kafka, topics["events"], [{"device_id": 2, "ts": iso(t0 + 25 * minute), "n": 6}])
    EnrichJob(config.parse(live, "test.yaml"), available_now=True).run(spark)
    got = records()
    corrections = [r for r in got if r["_kind"] == "correction"]
    assert sorted(r["n"] for r in corrections) == [2, 3]
    if sink == "postgresql":  # updated in place: one row per event
        assert sorted(r["n"] for r in got) == [1, 2, 3, 4, 5, 6]
    for r in corrections:
        assert (r["site"], r["_devices_matched"], r["_revision"], r["_retracted"]) == ("s-6", True, 1, False)
        cause = r["_cause"]
        assert (cause["dataset"], json.loads(cause["key"])) == ("devices", {"id": 1})
        assert cause["valid_from"] == iso(moved)
        assert cause["partition"] == 0 and isinstance(cause["offset"], int)
        # The event's shape as written, its identity and state included.
        event = next(e for e in first if e["n"] == r["n"])
        assert {k: v for k, v in r.items() if k not in ("site", "_kind", "_revision", "_cause")} == \
            {k: v for k, v in event.items() if k not in ("site", "_kind", "_revision", "_cause")}
    if sink == "kafka":  # keyed like the event it corrects: the same partition
        placed = {}
        for m in read_all(kafka, out_topic):
            assert placed.setdefault(m.key(), m.partition()) == m.partition()

    corrected = {n: tuple(r[c] for c in REFERENCE) for n, r in latest(got).items()}
    if sink != "kafka":  # the oracle's answer (below, with Kafka), which every output must give
        assert corrected == {1: ("s-2", True), 2: ("s-6", True), 3: ("s-6", True), 4: ("s-2", True),
                             5: (None, False), 6: ("s-2", True)}
        if sink == "parquet":
            fork_goes_on_correcting(spark, kafka, unique, tmp_path, devices, live, records)
        return
    # The oracle: a fresh job over the same events, after the change, writes what the corrected output says.
    fresh_topic = unique("fresh")
    fresh = job_config(kafka, unique, tmp_path, topics, "fresh", {"kafka": {"topic": fresh_topic}})
    fresh["rollups"] = [per_device(unique("rollup"))]
    EnrichJob(config.parse(fresh, "test.yaml"), available_now=True).run(spark)
    want = {r["n"]: tuple(r[c] for c in REFERENCE) for r in outputs(kafka, fresh_topic)}
    assert corrected == want
    assert want[2] == ("s-6", True) and want[1] == ("s-2", True)
    # The rollup counts each event once, corrections none: its latest rows are the fresh job's.
    rolled = latest_windows(outputs(kafka, live["rollups"][0]["output"]["kafka"]["topic"]))
    assert rolled == latest_windows(outputs(kafka, fresh["rollups"][0]["output"]["kafka"]["topic"]))
    assert sorted((d, n) for (d, _), (n, _) in rolled.items()) == [(1, 1), (1, 1), (1, 1), (2, 1), (2, 1), (3, 1)]

    # The last batch again (its commit lost): the same corrections, written once.
    forget_last_batch(tmp_path / "live")
    EnrichJob(config.parse(live, "test.yaml"), available_now=True).run(spark)
    again = records()
    assert sorted((r["n"], r["_revision"]) for r in again) == sorted((r["n"], r["_revision"]) for r in got)
    # A second late move, to s-7 from fifteen minutes after t0: event 3 again (revision 2), event 2 not.
    devices.move("s-7", t0 + 15 * minute)
    produce_events(kafka, topics["events"], [{"device_id": 2, "ts": iso(t0 + 26 * minute), "n": 7}])
    EnrichJob(config.parse(live, "test.yaml"), available_now=True).run(spark)
    second = [r for r in records() if r["_kind"] == "correction" and r["_revision"] == 2]
    assert [(r["n"], r["site"], r["_cause"]["valid_from"]) for r in second] == [(3, "s-7", iso(t0 + 15 * minute))]
    assert latest(records())[2]["site"] == "s-6"
    rolled = latest_windows(outputs(kafka, live["rollups"][0]["output"]["kafka"]["topic"]))
    assert sum(n for n, _ in rolled.values()) == 7, rolled


def test_write_state_rows_take_the_correction_of_the_event_each_device_row_holds(
        spark: SparkSession, kafka: dict[str, str], mysql_url: str, unique: Callable[[str], str],
        tmp_path: Path) -> None:
    """output.database with write: state (MariaDB): a late version corrects the event device 1's row
    holds, and the row takes the correction; device 2's row moved on to a later event in the same
    batch and stays; the rows equal a fresh job's."""
    import sqlalchemy as sa

    devices = Devices.published(kafka, mysql_url, unique, tmp_path)
    topics, t0 = devices.topics, devices.t0
    minute = timedelta(minutes=1)
    produce_events(kafka, topics["events"], [
        {"device_id": 1, "ts": iso(t0 + 5 * minute), "n": 1}, {"device_id": 1, "ts": iso(t0 + 10 * minute), "n": 2},
        {"device_id": 2, "ts": iso(t0 + 10 * minute), "n": 3}, {"device_id": 3, "ts": iso(t0 + 10 * minute), "n": 4}])

    def rows(table: str) -> dict[int, tuple]:
        engine = sa.create_engine(mysql_url)
        with engine.connect() as conn:
            got = conn.execute(sa.text(f"SELECT device_id, events, site, _offset, _kind, _revision, _cause "
                                       f"FROM {table}")).all()
        engine.dispose()
        return {r[0]: (r[1], r[2], r[3], r[4], r[5], None if r[6] is None else iso(datetime.fromisoformat(json.loads(r[6])["valid_from"])))
                for r in got}

    table = unique("state")
    live = job_config(kafka, unique, tmp_path, topics, "live",
                      {"database": {"url": mysql_url, "table": table, "write": "state"}})
    EnrichJob(config.parse(live, "test.yaml"), available_now=True).run(spark)
    first = rows(table)
    assert {d: (n, site, kind) for d, (n, site, _, kind, _, _) in first.items()} == {
        1: (2, "s-2", "event"), 2: (1, "s-2", "event"), 3: (1, None, "event")}

    moved = t0 + 8 * minute  # device 1 moved to s-6 then, learnt only now: its event n=2 is corrected
    devices.move("s-6", moved)
    produce_events(kafka, topics["events"], [{"device_id": 2, "ts": iso(t0 + 25 * minute), "n": 5}])
    EnrichJob(config.parse(live, "test.yaml"), available_now=True).run(spark)
    got = rows(table)
    assert got[1] == (2, "s-6", first[1][2], "correction", 1, iso(moved))
    assert got[2][:2] == (2, "s-2") and got[2][3:5] == ("event", 0) and got[3] == first[3]

    fresh_table = unique("fresh")
    fresh = job_config(kafka, unique, tmp_path, topics, "fresh",
                       {"database": {"url": mysql_url, "table": fresh_table, "write": "state"}})
    EnrichJob(config.parse(fresh, "test.yaml"), available_now=True).run(spark)
    assert {d: r[:3] for d, r in rows(fresh_table).items()} == {d: r[:3] for d, r in got.items()}


def test_a_sigkill_after_the_changes_are_recorded_and_a_task_killed_in_the_replay_write_each_correction_once(
        spark: SparkSession, kafka: dict[str, str], mysql_url: str, unique: Callable[[str], str],
        tmp_path: Path) -> None:
    """The job is killed once the driver has recorded the correcting batch's changes, before its
    tasks run; the restart replays the batch with the same changes, and a task of the replay is
    killed inside its transaction (Spark runs it again): each correction is written once, with
    revision 1, and the output corrected as a fresh job writes it."""
    from tests.enrich.process import start_job

    devices = Devices.published(kafka, mysql_url, unique, tmp_path)
    topics, t0 = devices.topics, devices.t0
    minute = timedelta(minutes=1)
    produce_events(kafka, topics["events"], [{"device_id": 1, "ts": iso(t0 + m * minute), "n": n}
                                             for n, m in ((1, 5), (2, 10), (3, 20))])
    out_topic = unique("enriched")
    data = job_config(kafka, unique, tmp_path, topics, "live", {"kafka": {"topic": out_topic}})
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)
    assert sorted(r["n"] for r in outputs(kafka, out_topic)) == [1, 2, 3]

    devices.move("s-6", t0 + 8 * minute)
    produce_events(kafka, topics["events"], [{"device_id": 2, "ts": iso(t0 + 25 * minute), "n": 4}])
    config_path, log = tmp_path / "enrich.yaml", tmp_path / "job.log"
    config_path.write_text(yaml.safe_dump({**data, "spark": {"spark.sql.shuffle.partitions": "2"}}))
    recorded, task = tmp_path / "killed-after-record", tmp_path / "killed-task"
    proc = start_job(config_path, log, "--available-now", kill=f"corrections:{recorded}")
    assert proc.wait(bound(300)) != 0, log.read_text()[-3000:]
    assert recorded.exists(), log.read_text()[-3000:]
    batch = int(recorded.read_text())
    assert (tmp_path / "live" / "refstream" / "corrections" / f"{batch}.devices.arrow").exists()
    assert sorted(r["n"] for r in outputs(kafka, out_topic)) == [1, 2, 3]  # nothing of the batch written

    proc = start_job(config_path, log, "--available-now", master="local[2,4]", kill=f"{batch}:*:{task}")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    assert task.exists(), "the hook did not fire"
    assert "recorded for it are missing" not in log.read_text()
    got = outputs(kafka, out_topic)
    written = sorted((r["n"], r["_kind"], r["_revision"]) for r in got)
    assert written == [(1, "event", 0), (2, "correction", 1), (2, "event", 0), (3, "correction", 1),
                       (3, "event", 0), (4, "event", 0)], written
    assert {n: r["site"] for n, r in latest(got).items()} == {1: "s-2", 2: "s-6", 3: "s-6", 4: "s-2"}


def test_corrections_on_a_join_the_state_needs_are_refused_naming_it(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, spark: SparkSession) -> None:
    from enrich.pipeline import Pipeline
    from refstream.contract import Column, DatasetSchema
    from refstream.errors import ConfigError

    topics = {"events": unique("events"), "devices": unique("ref.devices")}
    data = job_config(kafka, unique, tmp_path, topics, "x", {"kafka": {"topic": unique("out")}})
    data["state"]["aggregates"] = {"site": ["last"]}  # folded again by a correction
    schema = DatasetSchema("devices", ("id",), (Column("id", "int64"), Column("site", "string"),
                                                Column("every", "int64")))
    data["joins"][0]["columns"] = ["site", "every"]
    built = Pipeline.build(config.parse(data, "test.yaml"), {"devices": schema})
    assert built.state is not None and [c.dataset for c in built.corrected] == ["devices"]
    # A gap's expected interval from the join: what the gaps made of it would stay as first made.
    data["gaps"] = {"expected_every": "every", "output": {"kafka": {"topic": unique("gaps")}}}
    with pytest.raises(ConfigError, match=r"joins\[0\].corrections: column\(s\) \['every'\] of this join \(or a join "
                                          r"before the state step on them\) are used by gaps:"):
        Pipeline.build(config.parse(data, "test.yaml"), {"devices": schema})
    # Partitioned: corrected in its buckets, the same.
    data["joins"][0]["strategy"] = "partitioned"
    with pytest.raises(ConfigError, match=r"joins\[0\].corrections: column\(s\) \['every'\] of this partitioned join "
                                          r"are used by gaps:"):
        Pipeline.build(config.parse(data, "test.yaml"), {"devices": schema})
    del data["gaps"]
    data["joins"][0]["columns"] = ["site"]
    schema = DatasetSchema("devices", ("id",), (Column("id", "int64"), Column("site", "string")))
    del data["state"]["aggregates"]
    data["rollups"] = [{"name": "by_site", "by": ["site"], "window": "1m", "metrics": {"n": ["count"]},
                        "output": {"kafka": {"topic": unique("r")}}},
                       {"name": "by_device", "by": ["device_id"], "window": "1m", "metrics": {"n": ["count"]},
                        "output": {"kafka": {"topic": unique("r")}}}]
    built = Pipeline.build(config.parse(data, "test.yaml"), {"devices": schema})
    assert [c.dim for c in built.corrected] == [0]
    assert built.state is not None and [r.moves for r in built.state.rollups] == [True, False]
    data["joins"][0]["how"] = "inner"  # a correction may retract an event: every rollup moves
    built = Pipeline.build(config.parse(data, "test.yaml"), {"devices": schema})
    assert built.state is not None and [r.moves for r in built.state.rollups] == [True, True]


def test_an_inner_join_of_the_pass_with_write_state_and_corrections_is_refused_naming_it(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, spark: SparkSession) -> None:
    from enrich.pipeline import Pipeline
    from refstream.contract import Column, DatasetSchema
    from refstream.errors import ConfigError

    topics = {"events": unique("events"), "devices": unique("ref.devices")}
    data = job_config(kafka, unique, tmp_path, topics, "x",
                      {"database": {"url": "postgresql://u@h/db", "table": "t", "write": "state"}})
    schema = DatasetSchema("devices", ("id",), (Column("id", "int64"), Column("site", "string")))
    Pipeline.build(config.parse(data, "test.yaml"), {"devices": schema})  # left: taken
    data["joins"][0]["how"] = "inner"
    with pytest.raises(ConfigError, match=r"joins\[0\]\.how: inner with corrections and output.database write: state"):
        Pipeline.build(config.parse(data, "test.yaml"), {"devices": schema})



@pytest.fixture
def service() -> Iterator[Service]:
    """A real HTTP service on 127.0.0.1 the job's call goes to."""
    with serve() as svc:
        yield svc


@pytest.mark.parametrize("strategy", ["partitioned", "broadcast"])
def test_a_join_in_the_state_step_corrects_within_its_horizon_moves_rollup_events_and_counts_the_rest(
        spark: SparkSession, kafka: dict[str, str], mysql_url: str, unique: Callable[[str], str],
        tmp_path: Path, caplog: pytest.LogCaptureFixture, strategy: str, service: Service) -> None:
    """A join whose columns a rollup groups by: ``strategy: partitioned`` (the buckets hold the key's
    versions and its events, and find the late versions themselves) or broadcast (it runs before the
    state step; the driver finds the late versions, the buckets join the corrected events again with
    the batch's pinned versions). With a 15-minute horizon (a watermark 1 minute behind the events),
    device 1 moves to s-6 and device 2 to s-7, the latter as of before the horizon's start: the
    events within the horizon are corrected, with their cause, the version reaching further back
    counts as ``beyond_horizon`` and is logged once naming its key. A rollup by the site moves the
    events between its windows (a final window: a correction naming the change), and a call whose
    request names the site is made again at the device's next event. The corrected output and the
    rollup's latest rows are what the events and versions now say (windows left empty say 0 events),
    as a fresh job writes them (the partitioned run; the broadcast one checks the same values)."""
    devices = Devices.published(kafka, mysql_url, unique, tmp_path)
    topics, t0 = devices.topics, devices.t0
    minute = timedelta(minutes=1)
    produce_events(kafka, topics["events"], [
        {"device_id": 1, "ts": iso(t0 + 5 * minute), "n": 1}, {"device_id": 1, "ts": iso(t0 + 10 * minute), "n": 2},
        {"device_id": 1, "ts": iso(t0 + 20 * minute), "n": 3}, {"device_id": 2, "ts": iso(t0 + 10 * minute), "n": 4},
        {"device_id": 3, "ts": iso(t0 + 10 * minute), "n": 5}])

    def partitioned(name: str, topic: str) -> dict[str, Any]:
        data = job_config(kafka, unique, tmp_path, topics, name, {"kafka": {"topic": topic}})
        data["joins"][0].update({"strategy": strategy, "corrections": {"horizon": "15m"}})
        data["state"]["watermark"] = "1m"
        data["state"]["aggregates"] = {"site": ["last"]}  # folded again by a correction
        data["metrics"] = {"port": 0}
        data["rollups"] = [{"name": "by_site", "by": ["site"], "window": "1m", "metrics": {"n": ["count", "sum", "max"]},
                            "output": {"kafka": {"topic": unique("sites")}}}]
        # A call made once per device, whose request names the site: made again after a correction.
        data["calls"] = [{"name": "risk", "url": service.url("/score"), "refresh": "once",
                          "body": {"device": "{device_id}", "site": "{site}"}, "response": {"score": "DOUBLE"}}]
        return data

    def windows(data: dict[str, Any]) -> dict[tuple[Any, str], dict[str, Any]]:
        out: dict[tuple[Any, str], dict[str, Any]] = {}
        for r in outputs(kafka, data["rollups"][0]["output"]["kafka"]["topic"]):
            at = (r["site"], r["window_start"])
            assert at not in out or r["_revision"] > out[at]["_revision"], r
            out[at] = r
        return out

    out_topic = unique("enriched")
    live = partitioned("live", out_topic)
    EnrichJob(config.parse(live, "test.yaml"), available_now=True).run(spark)
    first = outputs(kafka, out_topic)
    assert {r["n"]: (r["site"], r["_kind"]) for r in first} == {
        1: ("s-2", "event"), 2: ("s-2", "event"), 3: ("s-2", "event"), 4: ("s-2", "event"), 5: (None, "event")}

    # The watermark is t0 + 19m: the horizon starts at t0 + 4m. Device 1 moved as of t0 + 8m (events 2
    # and 3 corrected), device 2 as of t0 + 2m, before it (event 4 corrected, the version counted beyond it).
    devices.move("s-6", t0 + 8 * minute)
    devices.move("s-7", t0 + 2 * minute, device=2)
    produce_events(kafka, topics["events"], [{"device_id": 2, "ts": iso(t0 + 25 * minute), "n": 6}])
    job = EnrichJob(config.parse(live, "test.yaml"), available_now=True)
    with caplog.at_level("WARNING", logger="enrich.dimension.corrections"):
        job.run(spark)
    assert job.started.pipeline.state is not None and job.started.pipeline.state.rollups[0].moves
    # Device 2's call named s-2; its events were corrected to s-7 and its next event (n 6) made it again.
    assert [b["site"] for _, b in service.bodies if str(b["device"]) == "2"] == ["s-2", "s-7"]
    assert [b["site"] for _, b in service.bodies if str(b["device"]) == "1"] == ["s-2"]  # no event since
    assert len({k.split("-2-risk")[0] for k in service.keys if "-2-risk" in k}) == 2  # two batches' keys
    got = outputs(kafka, out_topic)
    fixed = sorted((r for r in got if r["_kind"] == "correction"), key=lambda r: r["n"])
    assert [(r["n"], r["site"], r["_devices_matched"], r["_revision"], r["_retracted"]) for r in fixed] == [
        (2, "s-6", True, 1, False), (3, "s-6", True, 1, False), (4, "s-7", True, 1, False)]
    assert [(json.loads(r["_cause"]["key"]), r["_cause"]["valid_from"]) for r in fixed] == [
        ({"id": 1}, iso(t0 + 8 * minute)), ({"id": 1}, iso(t0 + 8 * minute)), ({"id": 2}, iso(t0 + 2 * minute))]
    for r in fixed:  # the event as written, but for what the change corrects, and the state made of it
        event = next(e for e in first if e["n"] == r["n"])
        assert {k: v for k, v in r.items() if k not in ("site", "_kind", "_revision", "_cause", "state")} == \
            {k: v for k, v in event.items() if k not in ("site", "_kind", "_revision", "_cause", "state")}
        assert r["state"] == {**event["state"], "site_last": r["site"]}
    assert job.started.metrics is not None
    value = job.started.metrics.registry.get_sample_value
    assert value("refstream_enrich_corrections_total", {"dataset": "devices", "result": "beyond_horizon"}) == 1
    assert value("refstream_enrich_corrections_total", {"dataset": "devices", "result": "corrected"}) == 1
    warned = [r.getMessage() for r in caplog.records if "before the corrections' horizon" in r.getMessage()]
    assert len(warned) == 1 and '{"id":2}' in warned[0].replace(" ", ""), warned

    # The rollup: the window of events 2 and 4 (final when the versions came) lost both at s-2 (a
    # correction) and gained one each at s-6 and s-7 (new windows the watermark has passed: final at
    # once), each naming the change.
    rolled = windows(live)
    at = next(r["window_start"] for r in rolled.values() if r["_kind"] == "correction")
    moved = [rolled[(site, at)] for site in ("s-2", "s-6", "s-7")]
    assert [(r["_kind"], r["_revision"], r["_events"], r["n_sum"]) for r in moved] == [
        ("correction", 3, 0, None), ("final", 1, 1, 2), ("final", 1, 1, 4)]  # s-2: provisional, final, moved
    cause = json.loads(moved[0]["_cause"])
    assert (cause["dataset"], json.loads(cause["key"]), cause["valid_from"]) == ("devices", {"id": 1}, iso(t0 + 8 * minute))
    assert [r["_cause"] for r in moved[1:]] == [None, None]

    # Every event's latest record and every window's latest row, as the events and versions now say.
    assert {n: tuple(r[c] for c in REFERENCE) for n, r in latest(got).items()} == {
        1: ("s-2", True), 2: ("s-6", True), 3: ("s-6", True), 4: ("s-7", True), 5: (None, False), 6: ("s-7", True)}
    floor = t0.replace(second=0, microsecond=0)

    def metrics(rows: dict[tuple[Any, str], dict[str, Any]]) -> dict[tuple[Any, int], tuple[int, int, int]]:
        """(site, minute after t0's) -> (events, sum, max) of the windows holding events."""
        return {(site, int((datetime.fromisoformat(ws.replace("Z", "+00:00")) - floor) / minute)):
                (r["_events"], r["n_sum"], r["n_max"]) for (site, ws), r in rows.items() if r["_events"]}

    assert metrics(rolled) == {("s-2", 5): (1, 1, 1), ("s-6", 10): (1, 2, 2), ("s-7", 10): (1, 4, 4),
                               ("s-6", 20): (1, 3, 3), (None, 10): (1, 5, 5), ("s-7", 25): (1, 6, 6)}
    states = {n: r["state"]["site_last"] for n, r in latest(got).items()}
    assert states == {1: "s-2", 2: "s-6", 3: "s-6", 4: "s-7", 5: None, 6: "s-7"}
    if strategy == "broadcast":
        return
    # The oracle: a fresh job over the same events now writes the same.
    fresh_topic = unique("fresh")
    fresh = partitioned("fresh", fresh_topic)
    EnrichJob(config.parse(fresh, "test.yaml"), available_now=True).run(spark)
    assert {r["n"]: (*[r[c] for c in REFERENCE], r["state"]["site_last"]) for r in outputs(kafka, fresh_topic)} == \
        {n: (*[r[c] for c in REFERENCE], r["state"]["site_last"]) for n, r in latest(got).items()}
    assert metrics(rolled) == metrics(windows(fresh))
    # A fork from a savepoint keeps each window's parts: device 1 moved again, to s-9 as of t0 + 15m,
    # and the fork moves event 3 out of the window the savepoint held at s-6.
    point = tmp_path / "savepoint"
    take(config.parse(live, "test.yaml"), point, spark=spark)
    devices.move("s-9", t0 + 15 * minute)
    forked = partitioned("fork", unique("fork_out"))
    EnrichJob(config.parse(forked, "test.yaml"), available_now=True, from_savepoint=point).run(spark)
    event_3 = t0 + 20 * minute

    def window_of(rows: dict[tuple[Any, str], dict[str, Any]], site: str) -> dict[str, Any]:
        return next(r for (at_site, ws), r in rows.items() if at_site == site
                    and datetime.fromisoformat(ws.replace("Z", "+00:00")) <= event_3 < datetime.fromisoformat(
                        r["window_end"].replace("Z", "+00:00")))

    got_fork = windows(forked)
    left, joined = window_of(got_fork, "s-6"), window_of(got_fork, "s-9")
    assert (left["_kind"], left["_events"], json.loads(left["_cause"])["valid_from"]) == (
        "correction", 0, iso(t0 + 15 * minute))
    assert left["_revision"] > window_of(rolled, "s-6")["_revision"]
    # New at s-9: final at once (the window ends before the savepoint's watermark, the fork's floor).
    assert (joined["_kind"], joined["_revision"], joined["_events"], joined["n_sum"]) == ("final", 1, 1, 3)

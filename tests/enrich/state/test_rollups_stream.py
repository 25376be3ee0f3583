"""Rollups in the running job (enrich/state/rollups.py), on real Spark (local) and the real broker:
provisional, final and corrected rows over micro-batches, the events beyond the horizon
dead-lettered, and the latest rows equal to a batch recompute of the counted events."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import yaml
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from enrich.ops.batches import Checkpoint
from enrich.ops.device import device_state
from enrich.ops.rescale import rescale
from enrich.ops.savepoint import take
from enrich.state.layout import partitions_of
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.enrich.process import start_job
from tests.timing import bound

pytestmark = pytest.mark.integration

DEVICES = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("site", "string")))
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


EVENTS = [
    # batch 0 (no watermark yet): windows 0 and 1 of a and b
    {"device_id": "a", "ts": at(0.1), "temp": 10.0, "n": 1},
    {"device_id": "a", "ts": at(0.5), "temp": 20.0, "n": 2},
    {"device_id": "b", "ts": at(0.2), "temp": 5.0, "n": 3},
    {"device_id": "a", "ts": at(1.2), "temp": 30.0, "n": 4},
    # batch 1 (watermark 0.2m): time moves to 6m; window 0 is not reached yet
    {"device_id": "a", "ts": at(6.0), "temp": 1.0, "n": 5},
    {"device_id": "b", "ts": at(6.5), "temp": 2.0, "n": 6},
    {"device_id": "b", "ts": at(3.0), "temp": 4.0, "n": 7},
    {"device_id": "a", "ts": at(6.1), "temp": 3.0, "n": 8},
    # batch 2 (watermark 5.5m): device_1m's windows up to 5m and site_5m's window 0 turn final
    {"device_id": "a", "ts": at(1.9), "temp": 99.0, "n": 9},     # device_1m: 2m + 3m <= 5.5m, beyond
    {"device_id": "b", "ts": at(4.5), "temp": 7.0, "n": 10},     # b's window 4: all late, final at once
    {"device_id": "a", "ts": at(7.0), "temp": 8.0, "n": 11},
    {"device_id": "b", "ts": at(7.5), "temp": 9.0, "n": 12},
    # batch 3 (watermark 6.5m): corrections of windows made final in batch 2
    {"device_id": "b", "ts": at(3.5), "temp": 11.0, "n": 13},    # b's window 3 (final, 4m + 3m > 6.5m)
    {"device_id": "b", "ts": at(4.8), "temp": 12.0, "n": 14},    # b's window 4 (written final in batch 2)
    {"device_id": "a", "ts": at(4.9), "temp": 13.0, "n": 15},    # site_5m's window 0 (final in batch 2)
    {"device_id": "a", "ts": at(8.0), "temp": 14.0, "n": 16},
]


def make_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, db_url: str) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, n INT",
                   "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"parquet": {"path": str(tmp_path / "events")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
        "max_events_per_batch": 4,
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "10m", "watermark": "1m", "buckets": 4},
        "rollups": [
            {"name": "device_1m", "by": ["device_id"], "window": "1m", "correct_for": "3m", "fill": True,
             "metrics": {"temp": ["count", "min", "max", "mean", "sum", "p95", "last"]},
             "output": {"parquet": {"path": str(tmp_path / "device_1m")}, "kafka": {"topic": unique("device_1m")}}},
            {"name": "site_5m", "by": ["site"], "window": "5m", "correct_for": "10m",
             "metrics": {"temp": ["mean"], "device_id": ["count_distinct"]},
             "output": {"parquet": {"path": str(tmp_path / "site_5m")},
                        "database": {"url": db_url, "table": unique("site_5m")}}},
        ],
    }


def rows_of(path: Path) -> pd.DataFrame:
    if not any(path.glob("batch_id=*")):
        return pd.DataFrame()
    rows = pq.read_table(path, partitioning="hive").to_pandas()
    return rows.assign(batch_id=rows["batch_id"].astype(int))


def latest(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    return rows.sort_values("_revision").groupby([*keys, "window_start"], dropna=False).tail(1)


def test_rollups_are_provisional_then_final_then_corrected_and_equal_a_recompute(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture, mysql_url: str) -> None:
    data = make_config(kafka, unique, tmp_path, mysql_url)
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "site": "s1"},
                                                                  {"device_id": "b", "site": "s1"}]))
    produce_events(kafka, data["events"]["topic"], EVENTS)
    with caplog.at_level(logging.INFO, logger="enrich.job"):
        EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)
    # Every event is counted once per rollup: into an open window, as a correction, or beyond the horizon.
    counts: Counter[tuple[str, str]] = Counter()
    for line in (r.getMessage() for r in caplog.records if ": rollup events " in r.getMessage()):
        for part in line.split(": rollup events ")[1].split(", "):
            rollup, result, n = part.split(" ")
            counts[(rollup, result)] += int(n)
    # device_1m fills its empty windows: a's window 4 is there (empty, then final) when n=15 comes.
    assert counts == {("device_1m", "counted"): 12, ("device_1m", "corrected"): 3,   # n=13, 14 and 15
                      ("device_1m", "beyond_horizon"): 1,                            # n=9
                      ("site_5m", "counted"): 13, ("site_5m", "corrected"): 3}, counts  # n=13, 14, 15
    # Late for the device state (behind its 1m watermark), counted by the job (Parquet counts none).
    assert late_per_batch("\n".join(r.getMessage() for r in caplog.records)) == {2: 2, 3: 3}  # n=9, 10; n=13-15

    check_outputs(kafka, data, tmp_path)


def late_per_batch(log: str) -> dict[int, int]:
    """The late events the job's log counts per batch (a replayed batch's last line), batches with none left out."""
    got = {int(b): int(n) for b, n in re.findall(r"batch (\d+): (\d+) late event\(s\) written with a null state", log)}
    return {b: n for b, n in got.items() if n}


def check_outputs(kafka: dict[str, str], data: dict[str, Any], tmp_path: Path) -> None:
    """Each window's revisions once each, in order; the dead letter once; the latest rows equal to a
    pandas recompute of the events each rollup counted."""
    dev = rows_of(tmp_path / "device_1m")
    site = rows_of(tmp_path / "site_5m")
    # The Kafka topic holds the same rows, once each, keyed by the keys and window_start.
    records = read_all(kafka, data["rollups"][0]["output"]["kafka"]["topic"])
    values = [json.loads(m.value()) for m in records]
    assert [json.loads(m.key()) for m in records] == [{"device_id": v["device_id"], "window_start": v["window_start"]}
                                                      for v in values]
    assert sorted((v["device_id"], v["window_start"], v["_revision"], v["_kind"], v["temp_mean"]) for v in values) == \
        sorted((r["device_id"], r["window_start"].strftime("%Y-%m-%dT%H:%M:%S.%fZ"), r["_revision"], r["_kind"],
                None if pd.isna(r["temp_mean"]) else r["temp_mean"]) for r in dev.to_dict("records"))
    assert set(dev["_kind"]) >= {"provisional", "final", "correction"}, dev
    # The last batch reads no event: its rows are windows made final by their buckets' timers.
    quiet = dev[dev["batch_id"] == dev["batch_id"].max()]
    assert not quiet.empty and set(quiet["_kind"]) == {"final"}, dev
    assert not set(map(tuple, quiet[["device_id", "window_start"]].values)) & set(
        map(tuple, dev[dev["batch_id"] < quiet["batch_id"].iloc[0]].query("_kind == 'final'")[
            ["device_id", "window_start"]].values))
    # Revisions strictly increase per window, exactly one final row per window, corrections after it.
    for _, g in dev.sort_values(["batch_id", "_revision"]).groupby(["device_id", "window_start"]):
        assert list(g["_revision"]) == list(range(1, len(g) + 1)), g
        kinds = list(g["_kind"])
        assert kinds.count("final") <= 1, g
        if "final" in kinds:
            after = kinds[kinds.index("final") + 1:]
            assert after == ["correction"] * len(after), g
    # The dead letters: n=9 beyond device_1m's horizon only (one dead letter naming it).
    dead = [m for m in read_all(kafka, data["dead_letter_topic"])
            if dict(m.headers() or [])["error"].decode().startswith("beyond the rollup horizon")]
    assert [dict(m.headers() or [])["error"].decode() for m in dead] == ["beyond the rollup horizon: device_1m"]
    assert json.loads(dead[0].value())["n"] == 9
    equal_recompute(dev, site)
    # The database table holds each window's latest revision, one row per (site, window_start).
    db = data["rollups"][1]["output"]["database"]
    engine = sa.create_engine(db["url"])
    try:
        table = pd.read_sql(f"SELECT site, window_start, temp_mean, _revision, _kind FROM {db['table']}", engine)
    finally:
        engine.dispose()
    want_rows = latest(site, ["site"])
    assert sorted((r["site"], pd.Timestamp(r["window_start"]).tz_localize(None), r["_revision"], r["_kind"])
                  for r in table.to_dict("records")) == \
        sorted((r["site"], pd.Timestamp(r["window_start"]).tz_localize(None), r["_revision"], r["_kind"])
               for r in want_rows.to_dict("records"))


def equal_recompute(dev: pd.DataFrame, site: pd.DataFrame) -> None:
    """The latest rows of device_1m and site_5m equal a pandas recompute of the events each counted."""
    ev = pd.DataFrame(EVENTS)
    ev["ts"] = pd.to_datetime(ev["ts"], utc=True)
    ev["site"] = "s1"
    counted = ev[ev["n"] != 9]
    by_time = counted.sort_values("ts")
    want = by_time.assign(window_start=by_time["ts"].dt.floor("1min")).groupby(["device_id", "window_start"]).agg(
        temp_count=("temp", "count"), temp_min=("temp", "min"), temp_max=("temp", "max"),
        temp_sum=("temp", "sum"), temp_p95=("temp", lambda v: np.quantile(v, 0.95, method="inverted_cdf")),
        temp_last=("temp", "last"), _events=("n", "count")).reset_index()
    # fill: every device has a row for each window from its first to its last, count 0 where empty.
    full = [(d, w) for d, g in want.groupby("device_id")
            for w in pd.date_range(g["window_start"].min(), g["window_start"].max(), freq="1min")]
    want = want.set_index(["device_id", "window_start"]).reindex(pd.MultiIndex.from_tuples(
        full, names=["device_id", "window_start"])).reset_index()
    want[["temp_count", "_events"]] = want[["temp_count", "_events"]].fillna(0)
    assert (want["_events"] == 0).sum() >= 4, want     # a and b have empty windows between their events
    got = latest(dev, ["device_id"])[["device_id", "window_start", "temp_count", "temp_min", "temp_max",
                                      "temp_sum", "temp_p95", "temp_last", "_events"]]
    got = got.assign(window_start=pd.to_datetime(got["window_start"], utc=True))
    pd.testing.assert_frame_equal(got.sort_values(["device_id", "window_start"]).reset_index(drop=True),
                                  want.sort_values(["device_id", "window_start"]).reset_index(drop=True),
                                  check_dtype=False)
    want_site = ev.assign(window_start=ev["ts"].dt.floor("5min")).groupby(["site", "window_start"]).agg(
        temp_mean=("temp", "mean"), device_id_count_distinct=("device_id", "nunique"),
        _events=("n", "count")).reset_index()
    got_site = latest(site, ["site"])[["site", "window_start", "temp_mean", "device_id_count_distinct", "_events"]]
    got_site = got_site.assign(window_start=pd.to_datetime(got_site["window_start"], utc=True))
    pd.testing.assert_frame_equal(got_site.sort_values("window_start").reset_index(drop=True),
                                  want_site.sort_values("window_start").reset_index(drop=True), check_dtype=False)


def test_sigkills_while_a_batchs_rollups_are_written_write_each_revision_once(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, pg_url: str) -> None:
    """Killed twice in batch 2, with a Kafka event output whose tasks write a dead letter: first once
    device_1m's Parquet rows of batch 2 are in place, before its Kafka rows, site_5m's and Spark's
    commit (``rollup``): the restart replays batch 2 and writes the rest, not those again; then, in
    that replay, once every rollup output of batch 2 is written (``rollups``: Parquet, the topic and
    its ledger, the table and its fence): the next restart replays batch 2 again and writes none of
    them again. (Both kills in one job: each run costs the suite a job's start.)"""
    data = make_config(kafka, unique, tmp_path, pg_url)
    data["output"] = {"kafka": {"topic": unique("enriched")}}
    # Last, alone in a batch of its own: batches 0-3 stay as they were.
    events = [*EVENTS, {"device_id": "a", "ts": at(8.5), "temp": "not a number", "n": 17}]
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "site": "s1"},
                                                                  {"device_id": "b", "site": "s1"}]))
    produce_events(kafka, data["events"]["topic"], events)
    config_path = tmp_path / "enrich.yaml"
    config_path.write_text(yaml.safe_dump({**data, "spark": {"spark.sql.shuffle.partitions": "2"}}))
    log = tmp_path / "job.log"
    for point in ("rollup", "rollups"):
        flag = tmp_path / f"killed-{point}"
        proc = start_job(config_path, log, "--available-now", kill=f"{point}:2:{flag}")
        assert proc.wait(bound(300)) != 0, log.read_text()[-3000:]
        assert flag.exists(), log.read_text()[-3000:]
        assert (tmp_path / "device_1m" / "batch_id=2").exists()
        assert (tmp_path / "site_5m" / "batch_id=2").exists() == (point == "rollups")
    after = log.stat().st_size
    proc = start_job(config_path, log, "--available-now")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "batch_id=2 exists (a replay)" in text
    last = text[after:]  # the topic's ledger and the table's fence held batch 2
    assert re.search(r"batch 2 already committed to device_1m_\w+ \(last 2\): skipped", last), last[-3000:]
    assert re.search(r"batch 2 slot 0: committed to site_5m_\w+ before; skipped", last), last[-3000:]
    errors = [dict(m.headers() or [])["error"].decode() for m in read_all(kafka, data["dead_letter_topic"])]
    assert len(errors) == 2 and sum(e.startswith("beyond the rollup horizon") for e in errors) == 1, errors
    # Counted by the Kafka output's tasks as they write, with no job of the driver's own: the last
    # replay of batch 2 wrote none (its slots had committed it before the kill).
    assert late_per_batch(text) == {3: 3}, text[-3000:]
    check_outputs(kafka, data, tmp_path)


def test_a_quiet_stream_finalizes_its_open_windows_by_wall_clock_and_later_events_correct_them(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """idle_finalize: no event for 4 s (wall clock) makes the open windows final, _finalized_by idle,
    although the watermark never reached them; an event that comes later for one is a correction."""
    data = make_config(kafka, unique, tmp_path, "unused")
    data["rollups"] = [{"name": "device_1m", "by": ["device_id"], "window": "1m", "idle_finalize": "4s",
                        "metrics": {"temp": ["count", "max"]}, "output": {"parquet": {"path": str(tmp_path / "d")}}}]
    data["trigger"] = "500ms"
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "site": "s1"}]))
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": "a", "ts": at(0.1), "temp": 1.0, "n": 1}, {"device_id": "a", "ts": at(1.1), "temp": 2.0, "n": 2}])
    job = EnrichJob(config.parse(data, "test.yaml"))
    runner = threading.Thread(target=job.run, args=(spark,), daemon=True)
    runner.start()

    def kinds() -> list[tuple[str, str, int]]:
        rows = rows_of(tmp_path / "d")
        return [] if rows.empty else sorted(
            (str(r["window_start"])[11:16], r["_finalized_by"] if isinstance(r["_finalized_by"], str) else "-",
             r["_revision"]) for r in rows.to_dict("records") if r["_kind"] != "provisional")

    try:
        deadline = time.monotonic() + bound(120)
        while kinds() != [("00:00", "idle", 2), ("00:01", "idle", 2)]:
            assert runner.is_alive() and time.monotonic() < deadline, kinds()
            time.sleep(0.5)
        produce_events(kafka, data["events"]["topic"], [{"device_id": "a", "ts": at(0.5), "temp": 9.0, "n": 3}])
        while len(kinds()) < 3:
            assert runner.is_alive() and time.monotonic() < deadline, kinds()
            time.sleep(0.5)
    finally:
        job.stop()
        runner.join(bound(60))
    rows = latest(rows_of(tmp_path / "d"), ["device_id"]).sort_values("window_start")
    assert [(r["_kind"], r["_revision"], r["temp_count"], r["temp_max"],
             r["_cause"] if isinstance(r["_cause"], str) else None) for r in rows.to_dict("records")] \
        == [("correction", 3, 2, 9.0, "late event"), ("final", 2, 1, 2.0, None)], rows


def test_downtime_counts_as_idle_time_and_the_restarts_first_batch_finalizes(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """A job stopped with windows open and started again after longer than idle_finalize, with no
    event since: the restart's first batch writes them final (_finalized_by idle). The quiet time
    before the stop and the downtime count; a restart does not start the idle clock again."""
    data = make_config(kafka, unique, tmp_path, "unused")
    # Longer than the first run's batches take apart, on any machine: that run must not go idle itself.
    idle = round(bound(10))
    data["rollups"] = [{"name": "device_1m", "by": ["device_id"], "window": "1m", "idle_finalize": f"{idle}s",
                        "metrics": {"temp": ["count"]}, "output": {"parquet": {"path": str(tmp_path / "d")}}}]
    data["trigger"] = "500ms"
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "site": "s1"}]))
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": "a", "ts": at(0.1), "temp": 1.0, "n": 1}, {"device_id": "a", "ts": at(1.1), "temp": 2.0, "n": 2}])
    cfg = config.parse(data, "test.yaml")
    EnrichJob(cfg, available_now=True).run(spark)
    first = rows_of(tmp_path / "d")
    assert sorted(first["_kind"]) == ["provisional", "provisional"], first
    last = Checkpoint(tmp_path / "checkpoint").last_committed()
    assert last is not None
    read_at = time.monotonic()
    time.sleep(idle + 1)  # the stream's quiet time is all downtime: longer than idle_finalize

    job = EnrichJob(cfg)
    runner = threading.Thread(target=job.run, args=(spark,), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + bound(120)
        while len(final := [r for r in rows_of(tmp_path / "d").to_dict("records") if r["_kind"] == "final"]) < 2:
            assert runner.is_alive() and time.monotonic() < deadline, rows_of(tmp_path / "d")
            time.sleep(0.5)
    finally:
        job.stop()
        runner.join(bound(60))
    # Both written by the restart's first batch, which the restart's own wall-clock time alone (a
    # batch after its start) could not have made idle.
    assert sorted((str(r["window_start"])[11:16], r["_finalized_by"], r["_revision"], r["batch_id"]) for r in final) \
        == [("00:00", "idle", 2, last + 1), ("00:01", "idle", 2, last + 1)], (final, time.monotonic() - read_at)


def test_a_rollup_row_too_large_for_its_topic_is_a_dead_letter_and_the_batch_commits(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """A rollup row larger than a record may be (``message.max.bytes``: here a ``last`` of a 30 kB
    string) fails no batch: the other rows are in the topic, that row is a dead letter naming the
    rollup (its value cut to fit), and the Parquet output has every row."""
    limit = 20_000
    data = make_config(kafka, unique, tmp_path, "unused")
    data["kafka"]["message.max.bytes"] = limit
    data["events"]["schema"] = "device_id STRING, ts TIMESTAMP, note STRING"
    topic = unique("notes")
    data["rollups"] = [{"name": "notes_1m", "by": ["device_id"], "window": "1m", "metrics": {"note": ["last"]},
                        "output": {"kafka": {"topic": topic}, "parquet": {"path": str(tmp_path / "notes")}}}]
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "site": "s1"}]))
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": "a", "ts": at(0.1), "note": "small"}, {"device_id": "b", "ts": at(0.2), "note": "x" * 30_000},
        {"device_id": "a", "ts": at(1.1), "note": "also small"}])
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)

    written = sorted((json.loads(m.value())["device_id"], json.loads(m.value())["note_last"])
                     for m in read_all(kafka, topic))
    assert written == [("a", "also small"), ("a", "small")], written
    dead = [m for m in read_all(kafka, data["dead_letter_topic"])]
    assert len(dead) == 1, [dict(m.headers()) for m in dead]
    headers = dict(dead[0].headers())
    assert headers["error"].startswith(b"too_large: rollup notes_1m row of "), headers
    assert headers["source.topic"] == topic.encode() and "source.offset" not in headers
    assert headers["reason"] == b"too_large" and int(headers["original.size"]) > 30_000
    assert json.loads(dead[0].key()) == {"device_id": "b", "window_start": "2026-01-01T00:00:00.000000Z"}
    assert dead[0].value().startswith(b'{"device_id":"b"') and len(dead[0].value()) < limit
    assert sorted(rows_of(tmp_path / "notes")["device_id"]) == ["a", "a", "b"]


def test_a_rollup_added_to_a_checkpoint_starts_with_the_next_batch_and_a_removed_one_is_dropped(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture, mysql_url: str) -> None:
    """device_1m runs alone, then beside site_5m (added: no backfill), then site_5m alone (device_1m
    removed: its windows leave the rollup step's state); each run continues the checkpoint."""
    data = make_config(kafka, unique, tmp_path, mysql_url)
    device_1m, site_5m = data["rollups"]
    device_1m["output"] = {"parquet": device_1m["output"]["parquet"]}
    site_5m["output"] = {"parquet": site_5m["output"]["parquet"]}
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "site": "s1"},
                                                                  {"device_id": "b", "site": "s1"}]))

    def run(rollups: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
        produce_events(kafka, data["events"]["topic"], events)
        EnrichJob(config.parse({**data, "rollups": rollups}, "test.yaml"), available_now=True).run(spark)

    def windows(name: str) -> int:  # the rollup step is the query's operator 0 (the state step's is 1)
        return (spark.read.format("statestore").option("path", str(tmp_path / "checkpoint" / "spark"))
                .option("operatorId", 0).option("stateVarName", f"rollup_{name}").load().count())

    run([device_1m], EVENTS[:4])
    assert windows("device_1m") > 0
    with caplog.at_level(logging.INFO, logger="enrich.state.record"):
        run([device_1m, site_5m], EVENTS[4:8])
    assert "rollup site_5m is new against the checkpoint" in caplog.text
    # site_5m counts the events from its first batch on: those of the first run are not backfilled.
    site = latest(rows_of(tmp_path / "site_5m"), ["site"])
    assert site["_events"].sum() == 4 and pd.to_datetime(site["window_start"], utc=True).min() == T0, site
    # device_1m kept its windows: a's first minute went on from revision 1 (provisional) to 2 (final).
    dev = rows_of(tmp_path / "device_1m")
    first = dev[(dev["device_id"] == "a") & (pd.to_datetime(dev["window_start"], utc=True) == T0)]
    assert sorted(zip(first["_revision"], first["_kind"], strict=True)) == [(1, "provisional"), (2, "final")], dev
    written = set(dev["batch_id"])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="enrich.state.record"):
        run([site_5m], EVENTS[8:12])
    assert "rollup device_1m is gone against the checkpoint" in caplog.text
    assert set(rows_of(tmp_path / "device_1m")["batch_id"]) == written
    with pytest.raises(Exception, match="State variable rollup_device_1m is not defined"):
        windows("device_1m")
    site = latest(rows_of(tmp_path / "site_5m"), ["site"])
    assert site["_events"].sum() == 8, site
    # Added back under its name, device_1m would write its windows from revision 1 again: refused.
    with pytest.raises(ConfigError, match="rollup device_1m was removed from the checkpoint"):
        run([site_5m, device_1m], [])


def test_a_rescaled_job_and_a_fork_from_its_savepoint_keep_the_rollups_windows(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        mysql_url: str) -> None:
    """After half the events on 2 state partitions, a savepoint is taken, then the checkpoint is
    rescaled to 4 and the job runs on. ``enrich rescale`` moves the rollup step's windows and timers
    with the state step's (Spark's repartition, every stateful step): every revision once, in order,
    and the latest rows equal the recompute. The savepoint holds the rollup step's windows; a fork
    (16 buckets where the original had 4) re-routes them and goes on: with the original's rows up
    to the savepoint, each window's revisions run 1, 2, ... once, and the latest rows equal the
    recompute of all the events. (One first run for both: each costs the suite a job's start.)"""
    data = {**make_config(kafka, unique, tmp_path, mysql_url), "spark": {"spark.sql.shuffle.partitions": "2"}}
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "site": "s1"},
                                                                  {"device_id": "b", "site": "s1"}]))
    produce_events(kafka, data["events"]["topic"], EVENTS[:8])
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)
    saved = take(config.parse(data, "test.yaml"), tmp_path / "savepoint", spark=spark)
    assert (tmp_path / "savepoint" / "rollups.parquet").is_dir() and saved.devices == 2
    before = {name: rows_of(tmp_path / name) for name in ("device_1m", "site_5m")}  # what the savepoint covers

    got = rescale(config.parse(data, "test.yaml"), 4, spark=spark)
    assert (got.before, got.after) == (2, 4)
    # The rollup step's windows are in the partitions Spark's shuffle puts their buckets in now.
    rows = (spark.read.format("statestore").option("path", str(tmp_path / "checkpoint" / "spark"))
            .option("operatorId", 0).option("stateVarName", "rollup_device_1m").load()
            .select("partition_id", "key._rbucket").collect())
    assert rows and all(r["partition_id"] == partitions_of([r["_rbucket"]], 4)[0] for r in rows), rows
    produce_events(kafka, data["events"]["topic"], EVENTS[8:])
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)
    check_outputs(kafka, data, tmp_path)

    fork = {**data, "checkpoint": str(tmp_path / "fork" / "checkpoint"),
            "output": {"parquet": {"path": str(tmp_path / "fork" / "events")}},
            "state": {**data["state"], "buckets": 16},
            "rollups": [{**r, "output": {"parquet": {"path": str(tmp_path / "fork" / r["name"])}}}
                        for r in data["rollups"]]}
    fork.pop("spark")
    EnrichJob(config.parse(fork, "test.yaml"), available_now=True,
              from_savepoint=tmp_path / "savepoint").run(spark)
    forked = {name: pd.concat([before[name].assign(run=0), rows_of(tmp_path / "fork" / name).assign(run=1)])
              for name in ("device_1m", "site_5m")}
    assert not rows_of(tmp_path / "fork" / "device_1m").empty
    for name, keys in (("device_1m", ["device_id"]), ("site_5m", ["site"])):
        for _, g in forked[name].sort_values(["run", "batch_id", "_revision"]).groupby([*keys, "window_start"]):
            assert list(g["_revision"]) == list(range(1, len(g) + 1)), g
    equal_recompute(forked["device_1m"], forked["site_5m"])


def test_a_fill_by_a_joins_column_writes_every_key_of_the_dimension(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        mysql_url: str) -> None:
    """fill: true by the devices join's site: every site of the devices dimension gets a final row
    with count 0 for each window the watermark passed without its events (s2: no device of it sends),
    and the latest rows equal the recompute with those empty windows."""
    data = make_config(kafka, unique, tmp_path, mysql_url)
    data["rollups"] = [{"name": "site_1m", "by": ["site"], "window": "1m", "correct_for": "10m", "fill": True,
                        "metrics": {"temp": ["count", "mean"]},
                        "output": {"parquet": {"path": str(tmp_path / "site_1m")}}}]
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "site": "s1"},
                                                                  {"device_id": "b", "site": "s1"},
                                                                  {"device_id": "c", "site": "s2"}]))
    produce_events(kafka, data["events"]["topic"], EVENTS)
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)
    # enrich lookup --state reads the state step, not the rollup step (Spark's operator 0 with rollups).
    got = device_state(config.parse(data, "test.yaml"), "a", spark=spark)
    assert got.found == "present" and got.state is not None and got.state["events"] >= 1, got
    rows = rows_of(tmp_path / "site_1m")
    rows = rows.assign(window_start=pd.to_datetime(rows["window_start"], utc=True))
    # The last watermark is 7m (the latest event, 8m, less the 1m delay): s2 has minutes 0 to 6, each
    # written once, final, empty.
    s2 = rows[rows["site"] == "s2"].sort_values("window_start")
    assert list(s2["window_start"]) == [T0 + timedelta(minutes=m) for m in range(7)], s2
    assert set(zip(s2["_kind"], s2["_revision"], s2["_events"], s2["temp_count"], strict=True)) == {("final", 1, 0, 0)}
    assert s2["temp_mean"].isna().all()
    ev = pd.DataFrame(EVENTS)
    ev["ts"] = pd.to_datetime(ev["ts"], utc=True)
    want = ev.assign(window_start=ev["ts"].dt.floor("1min")).groupby("window_start").agg(
        temp_count=("temp", "count"), temp_mean=("temp", "mean"), _events=("n", "count"))
    want = want.reindex(pd.date_range(T0, T0 + timedelta(minutes=8), freq="1min", name="window_start"))
    want[["temp_count", "_events"]] = want[["temp_count", "_events"]].fillna(0)
    got = latest(rows[rows["site"] == "s1"], ["site"]).set_index("window_start").sort_index()
    assert (want["_events"] == 0).sum() == 2     # minutes 2 and 5
    pd.testing.assert_frame_equal(got[["temp_count", "temp_mean", "_events"]], want, check_dtype=False,
                                  check_freq=False, check_index_type=False)


def test_hostile_keys_filled_by_a_joins_column_are_dead_letters_where_an_output_cannot_take_them(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        pg_url: str) -> None:
    """fill by the devices join's site, with sites no event comes from: one holding a NUL (PostgreSQL
    text refuses it) and one of 30 kB (larger than a Kafka record may be). Every output takes what it
    can, Parquet all of it; each row an output could not take is a dead letter naming the rollup and
    that output; the batches commit."""
    nul, huge = "s\x00nul", "x" * 30_000
    data = make_config(kafka, unique, tmp_path, pg_url)
    data["kafka"]["message.max.bytes"] = 20_000
    topic, table = unique("site_1m"), unique("site_1m")
    data["rollups"] = [{"name": "site_1m", "by": ["site"], "window": "1m", "correct_for": "10m", "fill": True,
                        "metrics": {"temp": ["count"]},
                        "output": {"parquet": {"path": str(tmp_path / "site_1m")}, "kafka": {"topic": topic},
                                   "database": {"url": pg_url, "table": table}}}]
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [
        {"device_id": "a", "site": "s1"}, {"device_id": "b", "site": "s1"},
        {"device_id": "c", "site": nul}, {"device_id": "d", "site": huge}]))
    produce_events(kafka, data["events"]["topic"], EVENTS)
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)

    parquet = rows_of(tmp_path / "site_1m")
    windows = {s: len(parquet[parquet["site"] == s]) for s in ("s1", nul, huge)}
    assert windows[nul] == windows[huge] == 7, windows  # minutes 0 to 6, empty and final
    in_topic = Counter(json.loads(m.value())["site"] for m in read_all(kafka, topic))
    assert in_topic[nul] == 7 and in_topic[huge] == 0 and in_topic["s1"] == windows["s1"], in_topic
    engine = sa.create_engine(pg_url)
    with engine.connect() as conn:
        in_table = Counter(r[0] for r in conn.execute(sa.text(f"SELECT site FROM {table}")))
    engine.dispose()
    assert in_table[nul] == 0 and in_table[huge] == 7 and in_table["s1"] > 0, in_table
    dead = [dict(m.headers()) for m in read_all(kafka, data["dead_letter_topic"])]
    why = Counter((h["source.topic"].decode(), h["error"].decode().split(":")[0]) for h in dead
                  if b"rollup site_1m row" in h["error"])
    assert why == {(table, f"rollup site_1m row refused by {table}"): 7, (topic, "too_large"): 7}, why

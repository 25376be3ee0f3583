"""The gaps' driver side (enrich/sinks/gaps.py) without Spark: the partitions' times pinned per batch
(a replay gets what the batch first had), and the source partitions' silences from the offset log."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

from enrich import config
from enrich.checkpoint import CheckpointLayout
from enrich.gaps.config import GapsConfig
from enrich.gaps.engine import GapSpec, gap_id, records
from enrich.ipc import to_ipc
from enrich.sinks.gaps import GapWriter
from tests.enrich.helpers import read_all

SPEC = GapSpec(key="device_id", key_type=pa.string(), after=3.0, topic="events")


def offsets(layout: CheckpointLayout, batch: int, at_ms: int, ends: dict[str, int]) -> None:
    """Spark's offset log entry of ``batch``: its time and the events topic's end offsets."""
    layout.offsets.mkdir(parents=True, exist_ok=True)
    (layout.offsets / str(batch)).write_text(
        f"v1\n{json.dumps({'batchWatermarkMs': 0, 'batchTimestampMs': at_ms})}\n{json.dumps({'events': ends})}\n")


@pytest.fixture
def layout(tmp_path: Path) -> CheckpointLayout:
    out = CheckpointLayout(tmp_path / "ck")
    out.own.mkdir(parents=True)
    return out


def writer(layout: CheckpointLayout) -> GapWriter:
    return GapWriter(SPEC, GapsConfig(every=timedelta(seconds=10), idle_after=timedelta(seconds=2)), layout)


def test_a_quiet_partition_is_source_idle_once_then_resumed_across_a_restart(layout: CheckpointLayout) -> None:
    w = writer(layout)
    offsets(layout, 0, 0, {"0": 5, "1": 3})
    offsets(layout, 1, 1000, {"0": 8, "1": 3})
    offsets(layout, 2, 2500, {"0": 9, "1": 3})   # partition 1 quiet since 0 ms: 2.5 s >= 2 s
    assert w.write(0, {}).kinds == {} and w.write(1, {}).kinds == {}
    got = w.write(2, {})
    assert got.kinds == {"source_idle": 1}
    offsets(layout, 3, 3000, {"0": 10, "1": 3})
    assert writer(layout).write(3, {}).kinds == {}  # a restart does not say it again
    offsets(layout, 4, 9000, {"0": 10, "1": 4})    # partition 0 quiet 6 s; partition 1 moved
    w = writer(layout)
    before = json.loads(layout.gaps.read_text())
    assert w.write(4, {}).kinds == {"source_idle": 1, "source_resumed": 1}
    assert json.loads(layout.gaps.read_text())["before"] == before["after"]
    # A replay of batch 4 writes the same records: it starts from what batch 4 started from.
    again = writer(layout)
    assert again.write(4, {}).kinds == {"source_idle": 1, "source_resumed": 1}


def test_the_records_name_the_partition_and_the_resumed_one_the_idle_ones_id(layout: CheckpointLayout) -> None:
    rows: list[dict[str, Any]] = []

    class Capture(GapWriter):
        def _write(self, batch_id: int, table: pa.Table) -> tuple[int | None, pa.Table]:
            rows.extend(table.to_pylist())
            return table.num_rows, table.slice(0, 0)

    w = Capture(SPEC, GapsConfig(every=timedelta(seconds=10), idle_after=timedelta(seconds=2)), layout)
    offsets(layout, 0, 1000, {"0": 5})
    offsets(layout, 1, 4000, {"0": 5})
    offsets(layout, 2, 5000, {"0": 6})
    for b in range(3):
        w.write(b, {})
    idle, resumed = rows
    assert (idle["kind"], idle["topic"], idle["partition"]) == ("source_idle", "events", 0)
    assert (idle["since"].timestamp(), idle["at"].timestamp()) == (1.0, 4.0)
    assert (resumed["kind"], resumed["gap_id"], resumed["at"].timestamp()) == ("source_resumed", idle["gap_id"], 5.0)
    assert idle["gap_id"] == gap_id(("source", "events", 0), 1000 * 1000)


def test_each_batch_is_pinned_to_the_times_the_batch_before_left_and_a_replay_to_its_own(
        layout: CheckpointLayout) -> None:
    w = writer(layout)
    for b in range(3):
        offsets(layout, b, b * 100, {"0": b, "1": b})
    assert json.loads(w.pin(0)) == {"times": {}, "now_us": 0}
    empty = to_ipc(records(SPEC, []))
    w.write(0, {3: {"records": empty, "no_interval": 2, "times": {0: 50, 1: 7}},
                1: {"records": b"", "no_interval": 1, "times": {0: 60}}})
    assert json.loads(w.pin(1))["times"] == {"0": 60, "1": 7}
    got = w.write(1, {0: {"records": b"", "no_interval": 0, "times": {1: 90}}})
    assert got.no_interval == 0
    assert json.loads(w.pin(1))["times"] == {"0": 60, "1": 7}    # a replay of batch 1
    assert json.loads(w.pin(2)) == {"times": {"0": 60, "1": 90}, "now_us": 200_000}
    bucket = records(SPEC, [{"gap_id": "g", "kind": "opened", "device_id": "d1", "last_seen": 5, "opened_at": 35}])
    assert w.write(2, {5: {"records": to_ipc(bucket), "no_interval": 0, "times": {}}}).kinds == {"opened": 1}


def test_a_forks_first_batch_goes_on_from_the_savepoints_ends_and_silences(layout: CheckpointLayout) -> None:
    """A fork has no offset log entry before its first batch: it compares with the ends the
    savepoint's driver recorded, so a partition idle there and still quiet is not 'resumed'."""
    gid = gap_id(("source", "events", 1), 1_000_000)
    initial = {"times": {"0": 5}, "read_ms": {"0": 1000, "1": 1000}, "idle": {"1": {"id": gid, "since": 1000}},
               "ends": {"0": 7, "1": 3}}
    w = GapWriter(SPEC, GapsConfig(every=timedelta(seconds=10), idle_after=timedelta(seconds=2)), layout,
                  initial=initial)
    assert json.loads(w.pin(0))["times"] == {"0": 5}
    offsets(layout, 0, 9000, {"0": 8, "1": 3})
    assert w.write(0, {}).kinds == {}
    offsets(layout, 1, 9500, {"0": 8, "1": 4})
    assert w.write(1, {}).kinds == {"source_resumed": 1}


def test_records_an_output_cannot_take_are_dead_letters_and_the_others_are_written(
        layout: CheckpointLayout, kafka: dict[str, str], pg_url: str, unique: Any) -> None:
    """A reference column with a NUL (PostgreSQL text refuses it) or of 30 kB (larger than a record
    may be) fails no batch: the output that cannot take the record leaves it out, the other keeps it,
    and each left-out record is a dead letter naming the output; a replay gives the same."""
    from datetime import UTC, datetime

    from enrich.sinks.deadletter import to_records

    spec = GapSpec(key="device_id", key_type=pa.string(), after=3.0, topic="events", refs=(("site", pa.string()),))
    topic, table = unique("gaps"), unique("gaps")
    cfg = config.parse({
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": "events", "schema": "device_id STRING, ts TIMESTAMP"},
        "output": {"console": {}}, "checkpoint": str(layout.root), "dead_letter_topic": unique("dlq"),
        "state": {"key": "device_id", "timestamp": "ts"},
        "gaps": {"expected_every": "10s", "idle_after": "1h",
                 "output": {"kafka": {"topic": topic}, "database": {"url": pg_url, "table": table}}}}, "t.yaml").gaps
    assert cfg is not None
    settings = {**kafka, "message.max.bytes": "20000"}
    t0 = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1e6)
    rows = [{"gap_id": gap_id(d, t0), "kind": "opened", "device_id": d, "last_seen": t0, "opened_at": t0 + 30_000_000,
             "expected_every_s": 10.0, "partition": 0, "site": site}
            for d, site in (("a", "s-a"), ("b", "s-\x00b"), ("c", "x" * 30_000))]
    offsets(layout, 0, 0, {"0": 5})
    w = GapWriter(spec, cfg, layout, settings, {topic: unique("tid")}, "scope")
    try:
        got = w.write(0, {0: {"records": to_ipc(records(spec, rows))}})
        again = w.write(0, {0: {"records": to_ipc(records(spec, rows))}})  # a replay
    finally:
        w.close()
    assert got.written == 2 and again.written is None  # a replay writes nothing
    for batch in (got, again):
        dead = batch.dead.to_pylist()
        assert [(d["_topic"], d["_error"].split(":")[0], d["_key"]) for d in dead] == [
            (table, f"gap record refused by {table}", gap_id("b", t0).encode()),
            (topic, "too_large", gap_id("c", t0).encode())], dead
        assert dead[0]["_partition"] is None and json.loads(dead[0]["_value"])["site"] == "s-\x00b"
        assert "message.max.bytes" in dead[1]["_error"]
    assert [json.loads(m.value())["device_id"] for m in read_all(kafka, topic)] == ["a", "b"]
    engine = sa.create_engine(pg_url)
    with engine.connect() as conn:
        assert sorted(r[0] for r in conn.execute(sa.text(f"SELECT device_id FROM {table}"))) == ["a", "c"]
    engine.dispose()
    assert all(len(r["value"] or b"") < 20_000 for r in to_records(got.dead, 20_000).to_pylist())

"""The job under operational faults, on real Spark (local) and the real broker: a backlog after
downtime, a deleted or recreated events topic, deleted events, an oversized record, a moved
checkpoint, a compacted changelog."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from refstream import contract
from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, produce_events, publish, read_all

DEVICES = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))


def make_config(settings: dict[str, str], unique: Callable[[str], str], checkpoint: Path,
                **extra: Any) -> config.EnrichConfig:
    data: dict[str, Any] = {
        "kafka": {"bootstrap_servers": settings["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, n INT", "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(checkpoint),
        "trigger": "200ms",
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return config.parse(data, "test.yaml")


def seed_devices(kafka: dict[str, str], cfg: config.EnrichConfig) -> None:
    publish(kafka, cfg.joins[0].topic, changelog(DEVICES, [{"device_id": f"d{i}", "owner": f"o{i}"}
                                                           for i in range(10)]))


def run_available_now(spark: SparkSession, cfg: config.EnrichConfig) -> EnrichJob:
    job = EnrichJob(cfg, available_now=True)
    job.run(spark)
    return job


def batch_offsets(checkpoint: Path) -> dict[int, dict[str, dict[str, int]]]:
    """Spark's offset log of the job: batch id -> the events source's end offsets."""
    out = {}
    for f in (checkpoint / "spark" / "offsets").iterdir():
        if f.name.isdigit():
            lines = f.read_text().splitlines()
            out[int(f.name)] = json.loads(lines[2])  # version, metadata, then one line per source
    return out


def produce_fast(kafka: dict[str, str], topic: str, n: int, start: int = 0) -> None:
    p = Producer({**kafka, "linger.ms": 20, "batch.num.messages": 10000})
    for i in range(start, start + n):
        while True:
            try:
                p.produce(topic, b'{"device_id":"d%d","n":%d}' % (i % 10, i), key=b"d%d" % (i % 10))
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(60) == 0


def test_first_batch_after_downtime_is_bounded_by_default(spark: SparkSession, kafka: dict[str, str],
                                                          unique: Callable[[str], str], tmp_path: Path) -> None:
    cfg = make_config(kafka, unique, tmp_path / "cp")
    assert cfg.max_events_per_batch == config.DEFAULT_MAX_EVENTS_PER_BATCH == 100_000
    seed_devices(kafka, cfg)
    produce_events(kafka, cfg.events.topic, [{"device_id": "d1", "n": i} for i in range(5)])
    run_available_now(spark, cfg)
    before = batch_offsets(cfg.checkpoint)
    last = max(before)
    # Downtime: a backlog larger than one batch builds up.
    produce_fast(kafka, cfg.events.topic, 100_050, start=5)
    run_available_now(spark, cfg)
    after = batch_offsets(cfg.checkpoint)
    ends = [sum(after[b][cfg.events.topic].values()) for b in sorted(after)]
    assert ends[0] == 5 and ends[-1] == 100_055
    first_after = after[last + 1][cfg.events.topic]
    assert sum(first_after.values()) - 5 == 100_000


def test_a_record_too_large_for_the_producer_is_dead_lettered_and_the_batch_commits(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    limit = 20_000
    cfg = make_config(kafka, unique, tmp_path / "cp", kafka={"message.max.bytes": limit},
                      events={"schema": "device_id STRING, n INT, note STRING"})
    seed_devices(kafka, cfg)
    huge_note = "x" * 30_000
    produce_events(kafka, cfg.events.topic, [
        {"device_id": "d1", "n": 1, "note": "small"},
        {"device_id": "d2", "n": 2, "note": huge_note},           # enriched: larger than a record may be
        {"device_id": "d3", "n": 3, "note": "small"},
        b"{not json" + b"y" * 30_000,                               # a dead letter larger than a record may be
        {"device_id": "d4", "n": 4, "note": "small"},
    ])
    run_available_now(spark, cfg)
    out = [json.loads(m.value()) for m in read_all(kafka, cfg.output.topic)]
    assert sorted(r["n"] for r in out) == [1, 3, 4]
    dead = {dict(m.headers())["source.offset"]: m for m in read_all(kafka, cfg.dead_letter_topic)}
    assert sorted(dead) == [b"1", b"3"]
    enriched, bad = dead[b"1"], dead[b"3"]
    for m in (enriched, bad):
        headers = dict(m.headers())
        assert headers["reason"] == b"too_large" and headers["error"].startswith(b"too_large: ")
        assert headers["source.topic"] == cfg.events.topic.encode() and headers["source.partition"] == b"0"
        assert len(m.value()) + len(m.key() or b"") < limit
    assert dict(enriched.headers())["error"].startswith(b"too_large: enriched event of ")
    assert enriched.key() == b"d2" and enriched.value().startswith(b'{"device_id":"d2","n":2,"note":"xxx')
    assert bad.value().startswith(b"{not json") and int(dict(bad.headers())["original.size"]) == 30_009
    assert b"malformed" in dict(bad.headers())["error"].lower() or b"json" in dict(bad.headers())["error"].lower()


def test_a_moved_checkpoint_keeps_the_sinks_identity(spark: SparkSession, kafka: dict[str, str],
                                                     unique: Callable[[str], str], tmp_path: Path) -> None:
    import shutil

    from enrich.checkpoint import CheckpointLayout

    old_cp, new_cp = tmp_path / "old" / "cp", tmp_path / "new" / "cp"
    cfg = make_config(kafka, unique, old_cp, max_events_per_batch=10)
    seed_devices(kafka, cfg)
    produce_events(kafka, cfg.events.topic, [{"device_id": f"d{i % 10}", "n": i} for i in range(30)])
    job = run_available_now(spark, cfg)
    tid = job.started.sink.transactional_id  # type: ignore[attr-defined]
    assert json.loads(CheckpointLayout(old_cp).sink_identity.read_text())["transactional_ids"][cfg.output.topic] == tid
    # The last batch reached Kafka but its commit never reached Spark's checkpoint (a crash between
    # the two): a restart replays it, and only the batch marker of its transactional id says it is written.
    commits = old_cp / "spark" / "commits"
    last = max(int(f.name) for f in commits.iterdir() if f.name.isdigit())
    for f in (commits / str(last), commits / f".{last}.crc"):
        f.unlink(missing_ok=True)
    new_cp.parent.mkdir()
    shutil.move(old_cp, new_cp)
    produce_events(kafka, cfg.events.topic, [{"device_id": "d1", "n": 30 + i} for i in range(5)])
    moved = make_config(kafka, unique, new_cp, max_events_per_batch=10,
                        events={"topic": cfg.events.topic}, joins=[{"dataset": "devices", "topic": cfg.joins[0].topic,
                                                                    "on": "device_id"}],
                        output={"kafka": {"topic": cfg.output.topic}}, dead_letter_topic=cfg.dead_letter_topic)
    job = run_available_now(spark, moved)
    assert job.started.sink.transactional_id == tid  # type: ignore[attr-defined]
    got = sorted(json.loads(m.value())["n"] for m in read_all(kafka, cfg.output.topic))
    assert got == list(range(35)), "each event once after the move"


def test_restart_after_compaction_below_the_recorded_positions_rebuilds_and_says_so(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The test broker does not compact: the changelog is deleted and recreated holding less below
    the positions the checkpoint recorded, as compaction would leave it."""
    from tests.enrich.source.test_kafka import recreate

    cfg = make_config(kafka, unique, tmp_path / "cp", bootstrap_timeout="5s")
    topic = cfg.joins[0].topic
    publish(kafka, topic, changelog(DEVICES, [{"device_id": "d1", "owner": "o1"}, {"device_id": "d2", "owner": "o2"}]))
    produce_events(kafka, cfg.events.topic, [{"device_id": "d1", "n": 0}])
    run_available_now(spark, cfg)  # records positions {0: 3}: schema record and two rows
    # Compacted: the schema record below the recorded positions is gone (a later one is kept).
    recreate(kafka, topic)
    publish(kafka, topic, changelog(DEVICES, [{"device_id": f"d{i}", "owner": f"new{i}"} for i in range(1, 6)],
                                    with_schema=False) + [contract.schema_message(DEVICES)])
    produce_events(kafka, cfg.events.topic, [{"device_id": "d1", "n": 1}])
    caplog.set_level(logging.WARNING, logger="enrich.dimension.manager")
    run_available_now(spark, cfg)
    assert "no schema record on" in caplog.text and "the replayed batch may differ" in caplog.text
    # Emptier still: the topic ends below the recorded positions.
    recreate(kafka, topic)
    publish(kafka, topic, changelog(DEVICES, [{"device_id": "d1", "owner": "last"}]))
    produce_events(kafka, cfg.events.topic, [{"device_id": "d1", "n": 2}])
    caplog.clear()
    run_available_now(spark, cfg)
    assert "ends below the recorded positions" in caplog.text and "the replayed batch may differ" in caplog.text
    owners = {json.loads(m.value())["n"]: json.loads(m.value())["owner"] for m in read_all(kafka, cfg.output.topic)}
    assert owners == {0: "o1", 1: "new1", 2: "last"}

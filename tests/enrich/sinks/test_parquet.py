"""The job running continuously (Parquet sink): a reference update while it runs changes later
events only; a replayed batch is not written twice."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from enrich.job import EnrichJob
from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, parquet_job_config, produce_events, publish, wait_for

SCHEMA = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string"),
                                                   Column("price", "decimal(8,3)")))


def parquet_rows(path: Path) -> list[dict]:
    files = sorted(p for p in path.glob("batch_id=*/*.parquet"))
    return [r for f in files for r in pq.read_table(f).to_pylist()]


def test_update_while_running_and_idempotent_replay(spark: SparkSession, kafka: dict[str, str],
                                                    unique: Callable[[str], str], tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    cfg = parquet_job_config(kafka, unique, out, tmp_path / "checkpoint")
    ref = cfg.joins[0].topic
    publish(kafka, ref, changelog(SCHEMA, [{"device_id": "d1", "owner": "old", "price": "1.125"}]))
    produce_events(kafka, cfg.events.topic, [{"device_id": "d1", "n": i} for i in range(5)])
    job = EnrichJob(cfg)
    runner = threading.Thread(target=job.run, args=(spark,), daemon=True)
    runner.start()
    try:
        wait_for(lambda: len(parquet_rows(out)) == 5, "the first events", runner)
        publish(kafka, ref, changelog(SCHEMA, [{"device_id": "d1", "owner": "new", "price": "2.5"}], version=2,
                                      with_schema=False))
        time.sleep(1.0)  # the change reaches the driver's consumer
        produce_events(kafka, cfg.events.topic, [{"device_id": "d1", "n": i} for i in range(5, 10)])
        wait_for(lambda: len(parquet_rows(out)) == 10, "the later events", runner)
    finally:
        job.stop()
        runner.join(120)
    assert not runner.is_alive()
    rows = {r["n"]: r for r in parquet_rows(out)}
    assert {rows[i]["owner"] for i in range(5)} == {"old"} and {rows[i]["owner"] for i in range(5, 10)} == {"new"}
    assert str(rows[0]["price"]) == "1.125" and str(rows[9]["price"]) == "2.500"
    # Every row ends with its event's identity and kind, as the Kafka output's records do.
    assert pq.read_table(next(out.glob("batch_id=*/*.parquet"))).column_names[-4:] == [
        "_topic", "_partition", "_offset", "_kind"]
    assert set(pq.read_table(next(out.glob("batch_id=*/*.parquet"))).column_names) == {
        "device_id", "n", "owner", "price", "_devices_matched", "_topic", "_partition", "_offset", "_kind"}
    assert {r["_kind"] for r in rows.values()} == {"event"} and {r["_topic"] for r in rows.values()} == {cfg.events.topic}
    assert len({(r["_partition"], r["_offset"]) for r in rows.values()}) == 10

    # Make Spark replay the last batch (as after a crash before its commit was recorded).
    commits = tmp_path / "checkpoint" / "spark" / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()
    (commits / f".{last}.crc").unlink(missing_ok=True)
    # A batch the stop left planned and not committed (the job stopped mid-trigger, likelier on a
    # loaded machine) would be the one Spark runs again, not the last committed: its plan goes too.
    offsets = tmp_path / "checkpoint" / "spark" / "offsets"
    for planned in [p for p in offsets.iterdir() if p.name.isdigit() and int(p.name) > last]:
        planned.unlink()
        (offsets / f".{planned.name}.crc").unlink(missing_ok=True)
    with caplog.at_level(logging.INFO, logger="enrich.sinks.parquet"):
        EnrichJob(cfg, available_now=True).run(spark)
    assert f"batch {last}: " in caplog.text and "not written again" in caplog.text, "the batch was not replayed"
    assert sorted(r["n"] for r in parquet_rows(out)) == list(range(10)), "the replayed batch is not written twice"


def test_unmatched_events_are_counted_by_the_join_pass(spark: SparkSession, kafka: dict[str, str],
                                                       unique: Callable[[str], str], tmp_path: Path) -> None:
    """Parquet output counts the unmatched events it writes (refstream_enrich_events_total), in the
    pass that joins: equal to the written rows whose join found nothing."""
    from enrich import config

    out = tmp_path / "out"
    cfg = config.parse({
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, n INT", "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"parquet": {"path": str(out)}}, "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"), "max_events_per_batch": 7, "metrics": {"port": 0},
    }, "test.yaml")
    publish(kafka, cfg.joins[0].topic, changelog(SCHEMA, [{"device_id": "d1", "owner": "ann", "price": "1"}]))
    produce_events(kafka, cfg.events.topic, [{"device_id": f"d{i % 3 + 1}", "n": i} for i in range(20)]
                   + [b"not json"], partitions=2)
    job = EnrichJob(cfg, available_now=True)
    job.run(spark)
    assert job.started.metrics is not None
    value = job.started.metrics.registry.get_sample_value
    rows = parquet_rows(out)
    missed = sum(1 for r in rows if not r["_devices_matched"])
    assert (len(rows), missed) == (20, 13)
    assert value("refstream_enrich_events_total", {"result": "unmatched"}) == missed
    assert value("refstream_enrich_events_total", {"result": "dead_letter"}) == 1

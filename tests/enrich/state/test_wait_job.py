"""Waiting for completeness end to end (real Spark, the real broker, a changelog published with the
contract's completeness records): an event after the dataset's completeness is held until a
heartbeat says the dataset is complete past it (final), or until max_wait with no events arriving
(provisional); a backfill writes the same reference columns; held events survive a SIGKILL of the
job and are written exactly once."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyspark.sql import SparkSession

from enrich import config
from enrich.checkpoint import CheckpointLayout
from enrich.job import EnrichJob
from refstream import contract
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError
from tests.enrich.helpers import produce_events, publish, read_all, wait_for
from tests.enrich.process import run_then_kill, start_job
from tests.timing import bound

pytestmark = pytest.mark.integration

SCHEMA = DatasetSchema("owners", ("device_id",), (Column("device_id", "int64"), Column("owner", "string")))
REFERENCE = ("owner", "_owners_matched", "_as_of_clipped")


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def changes(owner: str, valid_from: datetime, complete: datetime, *, first: bool = False) -> list[contract.Message]:
    """One version of device 1's row, then a heartbeat saying the dataset is complete as of ``complete``."""
    out = [contract.schema_message(SCHEMA)] if first else []
    out += list(contract.upsert_messages(SCHEMA, [{"device_id": 1, "owner": owner}], 1, valid_from=valid_from))
    out.append(contract.heartbeat_message("owners", 1, datetime.now(UTC), complete))
    return out


def job_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, topics: dict[str, str],
               name: str, max_wait: str, **join: Any) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": topics["events"], "schema": "device_id BIGINT, ts TIMESTAMP, n INT",
                   "starting_offsets": "earliest"},
        "joins": [{"dataset": "owners", "topic": topics["owners"], "on": "device_id", "columns": ["owner"],
                   "as_of": True, "wait": "complete", "max_wait": max_wait, **join}],
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / name),
        "trigger": "300ms",
        "state": {"key": "device_id", "timestamp": "ts", "watermark": "1d", "buckets": 2},
        "spark": {"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "2"},
    }


def output(kafka: dict[str, str], data: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    by_n: dict[int, list[dict[str, Any]]] = {}
    for m in read_all(kafka, data["output"]["kafka"]["topic"]):
        row = json.loads(m.value())
        by_n.setdefault(row["n"], []).append(row)
    return by_n


def test_held_until_complete_or_max_wait_corrected_if_provisional_and_a_backfill_writes_the_same(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """With corrections on the join: a held event is written once, with the version valid at its
    time; one released provisional by max_wait is corrected when a version valid before it arrives."""
    topics = {"events": unique("events"), "owners": unique("ref.owners")}
    now = datetime.now(UTC)
    publish(kafka, topics["owners"], changes("a", now - timedelta(hours=1), now - timedelta(minutes=10), first=True))
    produce_events(kafka, topics["events"], [
        {"device_id": 1, "ts": iso(now - timedelta(minutes=11)), "n": 1},  # before the completeness: at once
        {"device_id": 1, "ts": iso(now - timedelta(minutes=5)), "n": 2},   # after it: held
    ])
    live = job_config(kafka, unique, tmp_path, topics, "live", "60s", corrections={"horizon": "24h"})
    job = EnrichJob(config.parse(live, "test.yaml"))
    runner = threading.Thread(target=job.run, args=(spark,), daemon=True)
    runner.start()
    try:
        wait_for(lambda: 1 in output(kafka, live), "the event before the completeness", runner)
        seen = job.batches
        wait_for(lambda: job.batches >= seen + 2, "batches of ticks alone", runner)  # no events arrive
        assert 2 not in output(kafka, live), "an event after the completeness was not held"
        # The refresher publishes a new version valid before event 2 and says it is complete past it.
        publish(kafka, topics["owners"], changes("b", now - timedelta(minutes=6), datetime.now(UTC)))
        wait_for(lambda: 2 in output(kafka, live), "the held event, once complete", runner, timeout=60)
        after_complete = datetime.now(UTC)
        # An event after the new completeness, and nothing more: max_wait releases it, provisional.
        # max_wait runs on the wall clock (downtime counts): measured on the same clock, which may
        # step against the monotonic one.
        produced = time.time()
        produce_events(kafka, topics["events"], [{"device_id": 1, "ts": iso(after_complete), "n": 3}])
        wait_for(lambda: 3 in output(kafka, live), "the event released by max_wait", runner, timeout=150)
        waited = time.time() - produced
        # Then a version valid from before event 3, and the dataset complete past it: the provisional
        # event is corrected (event 2, held until its version came, is not).
        publish(kafka, topics["owners"], changes("c", after_complete - timedelta(seconds=1), datetime.now(UTC)))
        wait_for(lambda: len(output(kafka, live).get(3, [])) == 2, "the provisional event's correction", runner,
                 timeout=60)
    finally:
        job.stop()
        runner.join(60)
    got = output(kafka, live)
    assert {n: len(rows) for n, rows in got.items()} == {1: 1, 2: 1, 3: 2}
    rows = {n: r[0] for n, r in got.items()}
    assert {n: (r["owner"], r["_provisional"], r["_kind"]) for n, r in rows.items()} == {
        1: ("a", False, "event"), 2: ("b", False, "event"), 3: ("b", True, "event")}
    assert waited >= 60, f"released after {waited:.1f}s, before max_wait"
    fixed = got[3][1]
    assert (fixed["_kind"], fixed["_revision"], fixed["owner"]) == ("correction", 1, "c")
    assert fixed["_cause"]["dataset"] == "owners" and fixed["_cause"]["valid_from"] == iso(
        after_complete - timedelta(seconds=1))
    latest = {n: r[-1] for n, r in got.items()}

    # The dataset is complete past every event now: a backfill over the same events with a new
    # checkpoint writes the reference columns the corrected output holds, every event final, and
    # so does the correction.
    backfill = job_config(kafka, unique, tmp_path, topics, "backfill", "25s")
    EnrichJob(config.parse(backfill, "test.yaml"), available_now=True).run(spark)
    again = {n: r[0] for n, r in output(kafka, backfill).items()}
    assert {n: tuple(r[c] for c in REFERENCE) for n, r in again.items()} == {
        n: tuple(r[c] for c in REFERENCE) for n, r in latest.items()}
    assert {n: r["_provisional"] for n, r in again.items()} == {1: False, 2: False, 3: False}
    assert fixed["_provisional"] is False

    # Waiting adds an input to the query: turning it off against the checkpoint is refused.
    off = {**live, "joins": [{k: v for k, v in j.items() if k not in ("wait", "max_wait")} for j in live["joins"]]}
    with pytest.raises(ConfigError, match=r"joins\[\]\.wait: complete was removed against the checkpoint"):
        EnrichJob(config.parse(off, "test.yaml"), available_now=True).run(spark)


def test_held_events_survive_a_sigkill_and_are_written_once(kafka: dict[str, str], unique: Callable[[str], str],
                                                           tmp_path: Path) -> None:
    topics = {"events": unique("events"), "owners": unique("ref.owners")}
    now = datetime.now(UTC)
    publish(kafka, topics["owners"], changes("a", now - timedelta(hours=1), now - timedelta(minutes=10), first=True))
    produce_events(kafka, topics["events"], [
        {"device_id": 1, "ts": iso(now - timedelta(minutes=11)), "n": 1},
        {"device_id": 1, "ts": iso(now - timedelta(minutes=5)), "n": 2},
    ])
    data = job_config(kafka, unique, tmp_path, topics, "checkpoint", "1h")
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump(data))
    log = tmp_path / "job.log"
    layout = CheckpointLayout(Path(data["checkpoint"]))

    def held_and_committed() -> bool:  # event 1 written, and batches after the one that read event 2
        return 1 in output(kafka, data) and len(list(layout.commits.glob("[0-9]*"))) >= 3

    run_then_kill(path, log, held_and_committed)
    assert 2 not in output(kafka, data)
    publish(kafka, topics["owners"], changes("b", now - timedelta(minutes=6), datetime.now(UTC)))
    proc = start_job(path, log, "--available-now")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    got = output(kafka, data)
    assert {n: len(rows) for n, rows in got.items()} == {1: 1, 2: 1}
    assert (got[2][0]["owner"], got[2][0]["_provisional"]) == ("b", False)

"""``enrich lookup --state`` and the job's state metrics against a checkpoint the real job wrote
(local Spark, the real broker): two runs on one checkpoint, the second one expiring devices (TTL)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyspark.sql import SparkSession

from enrich import cli, config
from enrich.config import EnrichConfig
from enrich.job import EnrichJob
from enrich.ops.batches import Checkpoint
from enrich.ops.device import device_state
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError, DataError
from tests.enrich.helpers import changelog, produce_events, publish, read_all

DEVICES = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ev(n: int, device: str | None, minutes: float, temp: float | None) -> dict[str, Any]:
    return {"device_id": device, "ts": at(minutes), "temp": temp, "n": n}


@dataclass
class Ran:
    cfg: EnrichConfig
    path: Path
    applied: int             # the first run's batch that applied its last events
    first: int               # the first run's last batch (a batch without data: the watermark expired a, b, c, f)
    jobs: list[EnrichJob]    # the runs' jobs (their metrics): two with events, one without
    devices: list[list[int]]  # per run, the devices in state after each batch (the batch log)


class BatchLog(logging.Handler):
    """The devices in state after each batch, from the job's batch log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.devices: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.endswith(" device(s) in state"):
            self.devices.append(int(text.rsplit("; ", 1)[1].split()[0]))


@pytest.fixture(scope="module")
def ran(spark: SparkSession, kafka: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Ran:
    tmp = tmp_path_factory.mktemp("device")
    suffix = f"{time.monotonic_ns()}"
    data = {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": f"device-events-{suffix}", "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, n INT",
                   "starting_offsets": "earliest", "required": ["n"]},
        "joins": [{"dataset": "devices", "topic": f"device-ref-{suffix}", "on": "device_id"}],
        "output": {"kafka": {"topic": f"device-out-{suffix}"}},
        "dead_letter_topic": f"device-dlq-{suffix}",
        "checkpoint": str(tmp / "checkpoint"),
        "max_events_per_batch": 4,
        "metrics": {"port": 0},
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "10m", "watermark": "1m", "buckets": 4,
                  "aggregates": {"temp": ["last", "max", "mean"]}},
    }
    path = tmp / "enrich.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    cfg = config.load(path)
    publish(kafka, cfg.joins[0].topic, changelog(DEVICES, [{"device_id": "a", "owner": "ann"},
                                                           {"device_id": "c", "owner": "cy"}]))
    # Run 1, two batches: a twice, b, c (no temperature), f, g late in event time (25m), and an event
    # without a device (a dead letter). Devices a and c are in the dimension; b, f and g are not.
    produce_events(kafka, cfg.events.topic, [ev(1, "a", 0, 10.0), ev(2, "b", 1, 5.0), ev(3, "a", 1, 20.0),
                                             ev(4, "c", 2, None), ev(5, "f", 2, 3.0), ev(6, None, 2, 1.0),
                                             ev(7, "g", 25, 1.0)])
    logger, handler, devices = logging.getLogger("enrich.job"), BatchLog(), []
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)

    def run() -> None:
        jobs.append(EnrichJob(cfg, available_now=True))
        jobs[-1].run(spark)
        devices.append(handler.devices)
        handler.devices = []

    jobs: list[EnrichJob] = []
    run()
    ck = Checkpoint(cfg.checkpoint)
    first = ck.last_committed()
    applied = min(n for n in ck.committed() if sum(ck.batch(n).events_end.values()) == 7)
    assert first is not None and applied < first, "Spark runs a batch without data to move the watermark on"
    # The watermark is now 24m: a, b, c and f have expired (last_seen + 10m), g has not. Run 2, one
    # batch: a starts afresh, d and e are new (not in the dimension), x is late (2m).
    produce_events(kafka, cfg.events.topic, [ev(8, "d", 30, 1.0), ev(9, "e", 30, 2.0), ev(10, "a", 31, 4.0),
                                             ev(11, "x", 2, 9.0)])
    run()
    run()  # nothing new: the count comes from the checkpoint's record
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    return Ran(cfg, path, applied, first, jobs, devices)


def test_lookup_state_gives_what_the_events_imply(ran: Ran) -> None:
    a = device_state(ran.cfg, "a")
    assert a.batch_id == Checkpoint(ran.cfg.checkpoint).last_committed() and a.found == "present"
    assert a.state == {"events": 1, "first_seen": "2026-01-01T00:31:00.000000Z",
                       "last_seen": "2026-01-01T00:31:00.000000Z", "temp_last": 4.0, "temp_max": 4.0, "temp_mean": 4.0}
    assert a.expires_at == "2026-01-01T00:41:00.000000Z"
    assert device_state(ran.cfg, "g").state["events"] == 1  # type: ignore[index]
    # Expired, late only, never seen: absent.
    assert [device_state(ran.cfg, d).found for d in ("b", "x", "nope")] == ["absent"] * 3
    # As the first run's events left it, and after the watermark expired it.
    then = device_state(ran.cfg, "a", ran.applied)
    assert (then.batch_id, then.state) == (ran.applied, {
        "events": 2, "first_seen": "2026-01-01T00:00:00.000000Z", "last_seen": "2026-01-01T00:01:00.000000Z",
        "temp_last": 20.0, "temp_max": 20.0, "temp_mean": 15.0})
    c = device_state(ran.cfg, "c", ran.applied).state
    assert c is not None and (c["events"], c["temp_last"], c["temp_mean"]) == (1, None, None)
    assert [device_state(ran.cfg, "b", n).found for n in (ran.applied, ran.first)] == ["present", "absent"]


def test_the_jobs_metrics_count_unmatched_and_late_events(ran: Ran) -> None:
    counts = []
    for job in ran.jobs[:2]:
        assert job.started.metrics is not None
        value = job.started.metrics.registry.get_sample_value
        counts.append({r: value("refstream_enrich_events_total", {"result": r})
                       for r in ("enriched", "unmatched", "late", "dead_letter")})
    # Run 1: b, f and g have no devices row; the device-less event is a dead letter. Run 2: d, e
    # and x have none, x is late.
    assert counts == [{"enriched": 6, "unmatched": 3, "late": 0, "dead_letter": 1},
                      {"enriched": 4, "unmatched": 3, "late": 1, "dead_letter": 0}]


def test_devices_in_state_counts_each_batchs_devices_and_drops_by_ttl(ran: Ran) -> None:
    # Run 1: a, b, c; then f and g; then the watermark drops a, b, c and f (a batch without data,
    # the buckets' timers). Run 2: d, e and a afresh besides g.
    assert ran.devices[0] == [3, 5, 1]
    assert set(ran.devices[1]) == {4} and ran.devices[2] == []
    gauges = [j.started.metrics.registry.get_sample_value("refstream_enrich_devices_in_state") for j in ran.jobs
              if j.started.metrics]
    assert gauges == [1, 4, 4]   # the third run read no event: the count its start took from the checkpoint


def test_lookup_state_cli(ran: Ran, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["lookup", "--config", str(ran.path), "--state", "a", "--batch", str(ran.applied)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["found"], out["key"], out["batch_id"], out["state"]["events"]) == ("present", {"device_id": "a"},
                                                                                   ran.applied, 2)
    assert cli.main(["lookup", "--config", str(ran.path), "--state", "b"]) == 1
    assert json.loads(capsys.readouterr().out)["found"] == "absent"
    assert cli.main(["lookup", "--config", str(ran.path), "--state", "a", "--batch", "999"]) == 1
    assert "batch 999 is not a committed batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["lookup", "--config", str(ran.path), "devices", "--state", "a"])


def test_lookup_state_errors(ran: Ran, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = {k: v for k, v in yaml.safe_load(ran.path.read_text()).items() if k != "state"}
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(plain), encoding="utf-8")
    assert cli.main(["lookup", "--config", str(path), "--state", "a"]) == 2
    err = capsys.readouterr().err
    assert "no state: section" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "fresh" / "spark" / "offsets").mkdir(parents=True)
    fresh = {**yaml.safe_load(ran.path.read_text()), "checkpoint": str(tmp_path / "fresh")}
    with pytest.raises(DataError, match="no micro-batch has been committed yet"):
        device_state(config.parse(fresh, "fresh.yaml"), "a")
    with pytest.raises(ConfigError, match=r"state\.buckets changed"):
        device_state(config.parse({**fresh, "checkpoint": str(ran.cfg.checkpoint),
                                   "state": {**fresh["state"], "buckets": 8}}, "other.yaml"), "a")


SITES = DatasetSchema("sites", ("site_id",), (Column("site_id", "string"), Column("region", "string")))
OWNED = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string"),
                                                  Column("site_id", "string")))


def test_lookup_state_plans_the_state_as_the_job_does(spark: SparkSession, kafka: dict[str, str],
                                                      tmp_path: Path) -> None:
    """A partitioned join, and aggregates of columns joins add (one partitioned, one broadcast joined
    in the plan before the step): the lookup finds the state the job wrote, field for field."""
    suffix = f"{time.monotonic_ns()}"
    data = {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": f"lk-events-{suffix}", "schema": "device_id STRING, site_id STRING, ts TIMESTAMP, temp DOUBLE",
                   "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": f"lk-devices-{suffix}", "on": "device_id", "columns": ["owner"],
                   "strategy": "partitioned"},
                  {"dataset": "sites", "topic": f"lk-sites-{suffix}", "on": "site_id"}],
        "output": {"kafka": {"topic": f"lk-out-{suffix}"}},
        "dead_letter_topic": f"lk-dlq-{suffix}",
        "checkpoint": str(tmp_path / "checkpoint"),
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "1h", "buckets": 4,
                  "aggregates": {"temp": ["mean"], "owner": ["last"], "region": ["last"]}},
    }
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    cfg = config.load(path)
    publish(kafka, cfg.joins[0].topic, changelog(OWNED, [{"device_id": "a", "owner": "ann", "site_id": "s1"},
                                                         {"device_id": "b", "owner": "bo", "site_id": "s2"}]))
    publish(kafka, cfg.joins[1].topic, changelog(SITES, [{"site_id": "s1", "region": "north"},
                                                         {"site_id": "s2", "region": "south"}]))
    produce_events(kafka, cfg.events.topic, [{"device_id": "a", "site_id": "s1", "ts": at(0), "temp": 1.0},
                                             {"device_id": "b", "site_id": "s2", "ts": at(1), "temp": 5.0},
                                             {"device_id": "a", "site_id": "s1", "ts": at(2), "temp": 3.0}])
    EnrichJob(cfg, available_now=True).run(spark)
    written = {}
    for m in read_all(kafka, cfg.output.topic):
        event = json.loads(m.value())
        written[event["device_id"]] = event["state"]  # the last event of each device holds its state
    a = device_state(cfg, "a")
    assert a.found == "present" and a.state is not None
    assert (a.state["events"], a.state["temp_mean"], a.state["owner_last"], a.state["region_last"]) == (
        2, 2.0, "ann", "north")
    for device in ("a", "b"):
        assert device_state(cfg, device).state == written[device], device
    assert cli.main(["lookup", "--config", str(path), "--state", "b"]) == 0

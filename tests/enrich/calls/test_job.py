"""The job with calls: end to end with Kafka output, a real HTTP service on 127.0.0.1 (issue 24):
results in the events and in the state, refresh once / every event / a duration, a needs chain,
the on_error modes, and the responses recorded for replays."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from tests.enrich.calls.server import Service, serve
from tests.enrich.helpers import produce_events, read_all

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    with serve() as svc:
        yield svc


def job_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
               calls: list[dict[str, Any]], batch: int = 6) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, n INT",
                   "starting_offsets": "earliest"},
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
        "max_events_per_batch": batch,
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "1h", "watermark": "1h", "buckets": 4,
                  "aggregates": {"temp": ["mean"]}},
        "calls": calls,
    }


def run(spark: SparkSession, data: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    produce_events(data["kafka_settings"], data["events"]["topic"], events)
    cfg = {k: v for k, v in data.items() if k != "kafka_settings"}
    EnrichJob(config.parse(cfg, "test.yaml"), available_now=True).run(spark)
    out = [json.loads(m.value()) for m in read_all(data["kafka_settings"], data["output"]["kafka"]["topic"])]
    return sorted(out, key=lambda e: e["n"])


@pytest.mark.integration
def test_results_feed_the_state_refreshed_once_every_event_and_chained(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        service: Service) -> None:
    calls = [
        {"name": "action", "url": service.url("/action"), "needs": ["risk"], "refresh": "every event",
         "body": {"device": "{device_id}", "score": "{risk.score}"}, "response": {"action": "STRING"}},
        {"name": "risk", "url": service.url("/score"), "refresh": "once",
         "body": {"device": "{device_id}", "mean": "{state.temp_mean}", "events": "{state.events}"},
         "response": {"score": "DOUBLE", "level": "STRING"}},
        {"name": "echo", "url": service.url("/echo"), "method": "GET", "refresh": "10m",
         "body": {"d": "{device_id}", "t": "n={n} at {ts}", "missing": "{temp}"}, "response": {"got": "STRING"}},
    ]
    data = job_config(kafka, unique, tmp_path, calls)
    data["kafka_settings"] = kafka
    events = [{"device_id": f"d{i % 3}", "ts": at(i * 3), "temp": None if i == 6 else float(i), "n": i}
              for i in range(12)]
    out = run(spark, data, events)
    assert [e["n"] for e in out] == list(range(12))
    for e in out:
        assert e["state"]["risk_score"] == e["risk_score"] and e["state"]["action_action"] == e["action_action"]
    by_dev: dict[str, list[dict[str, Any]]] = {}
    for e in out:
        by_dev.setdefault(e["device_id"], []).append(e)
    for dev, evs in by_dev.items():
        # once: called at the device's first event, with its state including that event
        first = evs[0]
        assert first["risk_score"] == 10 + first["temp"]
        assert all(e["risk_score"] == first["risk_score"] for e in evs), dev
        assert [e["action_action"] for e in evs] == [f"act-{first['risk_score']}"] * len(evs)
    # every event: one action call per event; once: one risk call per device; 10m: each 9 minutes apart
    assert service.paths["/action"] == 12 and service.paths["/score"] == 3
    # events of one device are 9 minutes apart: the 10m echo is called at its 1st, 3rd, ... event
    assert service.paths["/echo"] == 6
    gets = [b for p, b in service.bodies if p == "/echo"]
    d0 = [b for b in gets if b["d"] == "d0"]
    assert d0 == [{"d": "d0", "t": f"n=0 at {T0.isoformat()}", "missing": "0.0"},
                  {"d": "d0", "t": f"n=6 at {(T0 + timedelta(minutes=18)).isoformat()}"}]  # a null left out

"""``strategy: partitioned`` on real Spark (local) and the real broker: the same input gives the
same output as ``broadcast``; a partitioned join's columns can be aggregated; the checkpoint keeps
the choice."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.enrich.state.test_stream import at

DEVICES = DatasetSchema("devices", ("id",), (Column("id", "int64"), Column("owner", "string"),
                                             Column("site_id", "string"), Column("limit", "float64")))
SITES = DatasetSchema("sites", ("site_id",), (Column("site_id", "string"), Column("city", "string")))


def make_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, topics: dict[str, str],
                strategy: str, **state: Any) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": topics["events"], "schema": "device_id BIGINT, ts TIMESTAMP, temp DOUBLE, n INT",
                   "starting_offsets": "earliest", "required": ["n"]},
        "joins": [{"dataset": "devices", "topic": topics["devices"], "on": "device_id", "how": "inner",
                   "columns": ["owner", "site_id", "limit"], "strategy": strategy},
                  {"dataset": "sites", "topic": topics["sites"], "on": "site_id"}],
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / strategy / "checkpoint"),
        "max_events_per_batch": 5,
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "1h", "watermark": "1m", "buckets": 4,
                  "aggregates": {"temp": ["last", "max", "mean"]}, **state},
    }


def run(spark: SparkSession, data: dict[str, Any]) -> None:
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)


def outputs(kafka: dict[str, str], data: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[Any]]:
    rows = [json.loads(m.value()) for m in read_all(kafka, data["output"]["kafka"]["topic"])]
    by_n = {r["n"]: r for r in rows}
    assert len(by_n) == len(rows), "an event was written twice"
    dead = sorted(json.loads(m.value())["n"] for m in read_all(kafka, data["dead_letter_topic"]))
    return by_n, dead


@pytest.mark.integration
def test_partitioned_and_broadcast_give_the_same_output(spark: SparkSession, kafka: dict[str, str],
                                                        unique: Callable[[str], str], tmp_path: Path) -> None:
    topics = {"events": unique("events"), "devices": unique("ref.devices"), "sites": unique("ref.sites")}
    jobs = {s: make_config(kafka, unique, tmp_path, topics, s) for s in ("broadcast", "partitioned")}
    publish(kafka, topics["sites"], changelog(SITES, [{"site_id": "s1", "city": "Oslo"},
                                                      {"site_id": "s2", "city": "Rome"}]))
    publish(kafka, topics["devices"], changelog(DEVICES, [
        {"id": i, "owner": f"o{i}", "site_id": f"s{1 + i % 2}", "limit": float(i)} for i in range(1, 40)]))
    rounds = [
        # round 1: devices 1-3 and 99 (no reference row: dropped by the inner join, counted in state)
        [{"device_id": d, "ts": at(m), "temp": float(m), "n": 100 + m} for m, d in
         enumerate([1, 2, 3, 1, 99, 2, 1, 3, 99, 1, 2])]
        + [{"device_id": None, "ts": at(3), "temp": 1.0, "n": 199}],
        # round 2, after the reference changed: 1 moved and renamed, 2 deleted, 40 added
        [{"device_id": d, "ts": at(20 + m), "temp": None if m == 3 else float(m), "n": 200 + m} for m, d in
         enumerate([1, 2, 40, 1, 99, 3, 40, 2, 1])],
    ]
    for i, events in enumerate(rounds):
        if i == 1:
            publish(kafka, topics["devices"], changelog(
                DEVICES, [{"id": 1, "owner": "new", "site_id": "s2", "limit": 7.5},
                          {"id": 40, "owner": "o40", "site_id": "s1", "limit": None}],
                deletes=[{"id": 2}], version=2, with_schema=False))
        produce_events(kafka, topics["events"], events, partitions=1)
        for data in jobs.values():
            run(spark, data)

    (b_out, b_dead), (p_out, p_dead) = (outputs(kafka, jobs[s]) for s in ("broadcast", "partitioned"))
    assert p_out == b_out and p_dead == b_dead
    # What both gave, checked against the input, so that two equal wrong answers fail too.
    assert b_dead == [199]
    assert sorted(b_out) == sorted(e["n"] for r in rounds for e in r if e["device_id"] not in (None, 99)
                                   and not (e["device_id"] == 2 and e["n"] >= 200))
    assert (b_out[100]["owner"], b_out[100]["city"], b_out[100]["state"]["events"]) == ("o1", "Rome", 1)
    assert (b_out[208]["owner"], b_out[208]["city"], b_out[208]["limit"]) == ("new", "Rome", 7.5)
    assert b_out[208]["state"]["events"] == 7
    assert b_out[206]["owner"] == "o40" and b_out[206]["limit"] is None and b_out[206]["state"]["events"] == 2
    assert b_out[105]["state"]["events"] == 2
    assert (b_out[205]["state"]["events"], b_out[205]["state"]["temp_last"]) == (3, 5.0)
    assert (b_out[203]["state"]["events"], b_out[203]["state"]["temp_last"]) == (6, 0.0)


@pytest.mark.integration
def test_a_partitioned_join_column_can_be_aggregated(spark: SparkSession, kafka: dict[str, str],
                                                     unique: Callable[[str], str], tmp_path: Path) -> None:
    topics = {"events": unique("events"), "devices": unique("ref.devices"), "sites": unique("ref.sites")}
    data = make_config(kafka, unique, tmp_path, topics, "partitioned",
                       aggregates={"limit": ["last", "max"], "owner": ["last"]})
    publish(kafka, topics["sites"], changelog(SITES, [{"site_id": "s1", "city": "Oslo"}]))
    publish(kafka, topics["devices"], changelog(DEVICES, [{"id": 1, "owner": "a", "site_id": "s1", "limit": 5.0}]))
    produce_events(kafka, topics["events"], [{"device_id": 1, "ts": at(m), "temp": 1.0, "n": m} for m in range(3)])
    run(spark, data)
    publish(kafka, topics["devices"], changelog(DEVICES, [{"id": 1, "owner": "b", "site_id": "s1", "limit": 2.0}],
                                                version=2, with_schema=False))
    produce_events(kafka, topics["events"], [{"device_id": 1, "ts": at(5), "temp": 1.0, "n": 5}])
    run(spark, data)
    out, _ = outputs(kafka, data)
    assert [(out[n]["state"]["limit_last"], out[n]["state"]["limit_max"], out[n]["state"]["owner_last"])
            for n in (0, 2, 5)] == [(5.0, 5.0, "a"), (5.0, 5.0, "a"), (2.0, 5.0, "b")]
    assert out[5]["state"]["events"] == 4 and out[5]["city"] == "Oslo"
    # The operator's view: status and lookup find the partitioned dimension's range in Spark's offset log.
    from enrich.ops.lookup import lookup
    from enrich.ops.status import status

    cfg = config.parse(data, "test.yaml")
    found = lookup(cfg, "devices", "1")
    assert (found.found, found.row["owner"] if found.row else None, found.version) == ("present", "b", 2)
    dims = {d.dataset: d for d in status(cfg).dimensions}
    assert dims["devices"].positions == {0: 3}   # the schema record and two upserts
    assert dims["devices"].rows is None and dims["sites"].rows == 1

    # The checkpoint keeps the partitioned joins it was run with.
    flipped = {**data, "joins": [{**data["joins"][0], "strategy": "broadcast"}, data["joins"][1]],
               "state": {**data["state"], "aggregates": {"temp": ["last"]}}}
    with pytest.raises(ConfigError, match=r"changed against the checkpoint"):
        run(spark, flipped)
    more = {**data, "joins": [{**data["joins"][0], "columns": ["owner", "site_id", "limit", "id"]}, data["joins"][1]]}
    with pytest.raises(ConfigError, match=r"the partitioned joins \(datasets, topics, selected columns\) changed"):
        run(spark, more)

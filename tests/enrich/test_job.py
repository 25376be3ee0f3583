"""The streaming job end to end on real Spark (local) and the real broker: changelogs and events
in, enriched events and dead letters read back from Kafka."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError
from tests.enrich.helpers import changelog, produce_events, publish, read_all

DEVICES = DatasetSchema("devices", ("device_id",), (
    Column("device_id", "string"), Column("site_id", "int64"), Column("owner", "string"),
    Column("price", "decimal(10,2)"), Column("installed", "timestamp")))
SITES = DatasetSchema("sites", ("site_id",), (Column("site_id", "int64"), Column("site_name", "string")))


def device(i: str, owner: str, site: int = 1, price: str | None = "9.99") -> dict[str, Any]:
    return {"device_id": i, "site_id": site, "owner": owner, "price": price,
            "installed": datetime(2024, 3, 1, 8, 30, 0, 250000)}


def make_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, **extra: Any) -> config.EnrichConfig:
    data = {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, n INT",
                   "starting_offsets": "earliest", "required": ["n"]},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id",
                   "columns": ["site_id", "owner", "price", "installed"]},
                  {"dataset": "sites", "topic": unique("ref.sites"), "on": "site_id"}],
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
        "trigger": "200ms",
        **extra,
    }
    return config.parse(data, "test.yaml")


def run_available_now(spark: SparkSession, cfg: config.EnrichConfig) -> None:
    job = EnrichJob(cfg, available_now=True)
    job.run(spark)


def outputs(kafka: dict[str, str], topic: str) -> list[dict[str, Any]]:
    return [json.loads(m.value()) | {"_kafka_key": m.key()} for m in read_all(kafka, topic)]


def test_enrichment_end_to_end(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str],
                               tmp_path: Path) -> None:
    cfg = make_config(kafka, unique, tmp_path)
    devices_topic, sites_topic = cfg.joins[0].topic, cfg.joins[1].topic
    publish(kafka, devices_topic, changelog(DEVICES, [device("d1", "ann"), device("d2", "bob", 2, None),
                                                      device("d3", "cy", 7)]))
    publish(kafka, sites_topic, changelog(SITES, [{"site_id": 1, "site_name": "Paris"},
                                                  {"site_id": 2, "site_name": "Oslo"}]))
    # Phase 1: the dimension is bootstrapped before the first event.
    produce_events(kafka, cfg.events.topic, [
        {"device_id": "d1", "ts": "2024-05-01T10:00:00Z", "n": 1},
        {"device_id": "d2", "ts": "2024-05-01T10:00:01Z", "n": 2},
        {"device_id": "d3", "ts": "2024-05-01T10:00:02Z", "n": 3},   # site 7 is not in sites: unmatched there
        {"device_id": "zz", "ts": "2024-05-01T10:00:03Z", "n": 4},   # unknown device
        b"{not json",
        {"device_id": "d1", "ts": "2024-05-01T10:00:04Z", "n": "four"},  # does not fit the schema
        {"device_id": "d1", "ts": "2024-05-01T10:00:05Z"},               # required n missing
    ])
    run_available_now(spark, cfg)
    out = {r["n"]: r for r in outputs(kafka, cfg.output.topic)}
    assert sorted(out) == [1, 2, 3, 4]
    assert out[1] == {"device_id": "d1", "ts": "2024-05-01T10:00:00.000000Z", "n": 1, "site_id": 1, "owner": "ann",
                      "price": 9.99, "installed": "2024-03-01T08:30:00.250000", "_devices_matched": True,
                      "site_name": "Paris", "_sites_matched": True, "_kafka_key": b"d1",
                      "_topic": cfg.events.topic, "_partition": 0, "_offset": 0, "_kind": "event"}
    assert (out[2]["owner"], out[2]["price"], out[2]["site_name"]) == ("bob", None, "Oslo")
    assert (out[3]["owner"], out[3]["_devices_matched"], out[3]["site_name"], out[3]["_sites_matched"]) == \
        ("cy", True, None, False)
    assert (out[4]["owner"], out[4]["_devices_matched"], out[4]["_sites_matched"]) == (None, False, False)

    dead = read_all(kafka, cfg.dead_letter_topic)
    assert sorted(m.value() for m in dead) == sorted([
        b"{not json", json.dumps({"device_id": "d1", "ts": "2024-05-01T10:00:04Z", "n": "four"}).encode(),
        json.dumps({"device_id": "d1", "ts": "2024-05-01T10:00:05Z"}).encode()])
    errors = {dict(m.headers())["error"].decode() for m in dead}
    assert any("not valid JSON or does not fit" in e for e in errors)
    assert "required field n is null" in errors
    assert {dict(m.headers())["source.topic"].decode() for m in dead} == {cfg.events.topic}

    # Phase 2: reference changes arrive (update, delete, delete then re-insert in one batch), then events.
    publish(kafka, devices_topic, changelog(DEVICES, [device("d1", "ann2", 2)], [{"device_id": "d2"}],
                                            version=2, with_schema=False)
            + changelog(DEVICES, [], [{"device_id": "d3"}], version=2, with_schema=False)
            + changelog(DEVICES, [device("d3", "cy-again", 1, "1.50")], version=2, with_schema=False))
    produce_events(kafka, cfg.events.topic, [
        {"device_id": "d1", "ts": "2024-05-01T11:00:00Z", "n": 11},
        {"device_id": "d2", "ts": "2024-05-01T11:00:01Z", "n": 12},
        {"device_id": "d3", "ts": "2024-05-01T11:00:02Z", "n": 13}])
    run_available_now(spark, cfg)
    rows = outputs(kafka, cfg.output.topic)
    assert sorted(r["n"] for r in rows) == [1, 2, 3, 4, 11, 12, 13], "earlier events are neither changed nor repeated"
    out = {r["n"]: r for r in rows}
    assert (out[1]["owner"], out[1]["site_name"]) == ("ann", "Paris")
    assert (out[11]["owner"], out[11]["site_name"]) == ("ann2", "Oslo")
    assert (out[12]["owner"], out[12]["_devices_matched"]) == (None, False)
    assert (out[13]["owner"], out[13]["price"], out[13]["_devices_matched"]) == ("cy-again", 1.5, True)
    assert Decimal(str(out[13]["price"])) == Decimal("1.50")
    assert len(read_all(kafka, cfg.dead_letter_topic)) == 3


def test_inner_join_drops_unmatched_but_dead_letters_still_arrive(spark: SparkSession, kafka: dict[str, str],
                                                                  unique: Callable[[str], str], tmp_path: Path) -> None:
    cfg = make_config(kafka, unique, tmp_path, joins=[
        {"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id", "columns": ["owner"],
         "how": "inner"}])
    publish(kafka, cfg.joins[0].topic, changelog(DEVICES, [device("d1", "ann"), device("d2", "bob")]))
    produce_events(kafka, cfg.events.topic, [
        {"device_id": "d1", "n": 1}, {"device_id": "nope", "n": 2}, {"device_id": "d2", "n": 3},
        {"device_id": None, "n": 4}, b"[1, 2", {"device_id": "nope", "ts": "2024-05-01T10:00:00Z"}])
    run_available_now(spark, cfg)
    out = sorted(outputs(kafka, cfg.output.topic), key=lambda r: r["n"])
    assert [(r["n"], r["owner"], r["_devices_matched"]) for r in out] == [(1, "ann", True), (3, "bob", True)]
    dead = read_all(kafka, cfg.dead_letter_topic)
    assert sorted(m.value() for m in dead) == sorted(
        [b"[1, 2", json.dumps({"device_id": "nope", "ts": "2024-05-01T10:00:00Z"}).encode()])
    assert {m.key() for m in dead} == {b"bad", b"nope"}, "dead letters keep the original key"


def test_builtin_source_is_chosen_by_config(spark: SparkSession, kafka: dict[str, str],
                                            unique: Callable[[str], str], tmp_path: Path) -> None:
    cfg = make_config(kafka, unique, tmp_path, joins=[])
    builtin = make_config(kafka, unique, tmp_path, joins=[],
                          events={"topic": cfg.events.topic, "schema": "device_id STRING, n INT",
                                  "starting_offsets": "earliest", "source": "builtin"})
    assert (cfg.events.source, builtin.events.source) == ("python", "builtin")
    # This machine has no spark-sql-kafka connector jar: the builtin setting must reach Spark's "kafka"
    # format (and fail there), not fall back to the Python source.
    with pytest.raises(Exception, match=r"(?i)find (the )?data source: kafka"):
        EnrichJob(builtin, available_now=True).run(spark)


def test_schema_errors_name_the_key(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str],
                                    tmp_path: Path) -> None:
    def events(**kw: Any) -> dict[str, Any]:
        return {"topic": "ev", "schema": "device_id STRING, n INT", **kw}

    for ev, message in [(events(schema="device_id STRNG"), "test.yaml: events.schema: 'device_id STRNG' is not"),
                        (events(required=["serial"]), "test.yaml: events.required: ['serial'] not in events.schema"),
                        (events(schema="_error STRING"), "test.yaml: events.schema: field name(s) ['_error']")]:
        with pytest.raises(ConfigError) as exc:
            EnrichJob(make_config(kafka, unique, tmp_path, events=ev)).start(spark)
        assert message in str(exc.value)
    # Join settings only the published schema can check: refused once the dimension is bootstrapped,
    # before the query starts.
    cfg = make_config(kafka, unique, tmp_path, joins=[
        {"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id", "columns": ["colour"]}])
    publish(kafka, cfg.joins[0].topic, changelog(DEVICES, [device("d1", "ann")]))
    job = EnrichJob(cfg, available_now=True)
    with pytest.raises(ConfigError, match=r"^test\.yaml: joins\[0\] \(devices\): columns: \['colour'\] not in"):
        job.run(spark)
    assert job.query is None, "the query must not start"


def test_console_output(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
                        capfd: pytest.CaptureFixture[str]) -> None:
    cfg = make_config(kafka, unique, tmp_path, output={"console": {"rows": 5}}, joins=[
        {"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id", "columns": ["owner"]}])
    publish(kafka, cfg.joins[0].topic, changelog(DEVICES, [device("d1", "ann-console")]))
    produce_events(kafka, cfg.events.topic, [{"device_id": "d1", "n": 1}, {"device_id": "zz", "n": 2}, b"oops"])
    run_available_now(spark, cfg)
    shown = capfd.readouterr().out
    assert "-------- batch 0 --------" in shown and "ann-console" in shown and "_devices_matched" in shown
    assert [m.value() for m in read_all(kafka, cfg.dead_letter_topic)] == [b"oops"]

"""``strategy: partitioned`` on real Spark (local) and the real broker: the same input gives the
same output as ``broadcast``; a partitioned join's columns can be aggregated; the checkpoint keeps
the choice."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
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


def _json(value: Any) -> Any:
    """An event field's JSON as a device would send it (Spark's from_json reads BINARY as base64)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ") if value.tzinfo else value.isoformat()
    if isinstance(value, date):
        return value.isoformat()
    return value


def _naive(ts: datetime) -> datetime:
    return ts.astimezone(UTC).replace(tzinfo=None)


_T = datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
#: Every key type state.key accepts (enrich.state.hashing.supports): the events' type, the dataset's
#: key type, the keys the dataset has, a key the events have and it has not, and (for the narrow
#: integer types) keys the dataset has that do not fit the events' type.
KEY_TYPES = {
    "string": ("STRING", "string", ["d1", "d22", "ünï", "a-longer-key-with-a-tail"], "zz", []),
    "binary": ("BINARY", "binary", [b"\x00\x01", b"\xff\xfe\xfd", b"abcd", b"xyz12"], b"\x07", []),
    "tinyint": ("TINYINT", "int64", [1, -7, 100, 0], 55, [1000]),
    "smallint": ("SMALLINT", "int64", [1, -7, 30000, 0], 55, [100_000]),
    "int": ("INT", "int64", [1, -7, 2_000_000_000, 0], 55, [2**40]),
    "bigint": ("BIGINT", "int64", [1, -7, 2**40, 0], 55, []),
    "boolean": ("BOOLEAN", "bool", [True], False, []),
    "date": ("DATE", "date", [date(2026, 1, 1), date(1999, 12, 31), date(2030, 6, 15)], date(2001, 1, 1), []),
    "timestamp": ("TIMESTAMP", "timestamp_tz", [_T, _T + timedelta(microseconds=1), _T + timedelta(days=400)],
                  _T + timedelta(seconds=1), []),
    "timestamp-ntz-dataset": ("TIMESTAMP", "timestamp", [_T, _T + timedelta(microseconds=1),
                                                        _T + timedelta(days=400)], _T + timedelta(seconds=1), []),
}


@pytest.mark.parametrize("key_type", list(KEY_TYPES))
def test_a_changelog_key_lands_in_the_bucket_of_its_events_for_every_key_type(
        spark: SparkSession, request: pytest.FixtureRequest, key_type: str) -> None:
    """Every key type state.key accepts: the changelog key as the refresher writes it, decoded by
    the state step (``changelog_key``), and the same key as an event's JSON field parsed by Spark,
    get the same bucket; a dataset key the events' type cannot hold gets none."""
    from pyspark.sql import functions as F

    from enrich.pipeline import Pipeline
    from enrich.state.layout import BucketLayout
    from enrich.state.stream import changelog_key

    event_type, dataset_type, keys, _, outside = KEY_TYPES[key_type]
    if dataset_type == "timestamp":
        spark.conf.set("spark.sql.session.timeZone", "America/New_York")
        request.addfinalizer(lambda: spark.conf.set("spark.sql.session.timeZone", "UTC"))
    schema = DatasetSchema("things", ("k",), (Column("k", dataset_type), Column("owner", "string")))
    cfg = config.parse({
        "kafka": {"bootstrap_servers": "127.0.0.1:9"}, "events": {"topic": "ev", "schema": f"k {event_type}, ts TIMESTAMP"},
        "joins": [{"dataset": "things", "on": "k", "strategy": "partitioned"}],
        "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck",
        "state": {"key": "k", "timestamp": "ts", "buckets": 8}}, "test.yaml")
    st = Pipeline.build(cfg, {"things": schema}).state
    assert st is not None
    key_type_ = st.joined["k"].dataType
    layout = BucketLayout.even(8)
    naive = dataset_type == "timestamp"
    messages = [m for m in changelog(schema, [{"k": _naive(k) if naive else k, "owner": "o"} for k in [*keys, *outside]],
                                     with_schema=False)]
    records = spark.createDataFrame([(m.key,) for m in messages], "key BINARY")
    decoded = records.select(changelog_key(st.dims[0], key_type_).alias("k"))
    from_changelog = [r[0] for r in decoded.select(layout.column(F.col("k"))).collect()]
    events = spark.createDataFrame([(json.dumps({"k": _json(k)}),) for k in keys], "value STRING")
    typed = events.select(F.from_json("value", f"k {event_type}").getField("k").alias("k"))
    from_events = [r[0] for r in typed.select(layout.column(F.col("k"))).collect()]
    assert from_changelog[:len(keys)] == from_events and None not in from_events
    assert [r[0] for r in decoded.collect()][len(keys):] == [None] * len(outside)  # matches no event


@pytest.mark.integration
@pytest.mark.parametrize("key_type", ["binary", "tinyint", "timestamp-ntz-dataset"])
def test_partitioned_and_broadcast_agree_for_every_key_type(spark: SparkSession, kafka: dict[str, str],
                                                            unique: Callable[[str], str], tmp_path: Path,
                                                            request: pytest.FixtureRequest, key_type: str) -> None:
    """A changelog row must land in the bucket its key's events hash to: the changelog's key JSON
    is decoded as the published key type (base64 for binary) before it is hashed. An inner join
    makes a missed bucket visible: the event is dropped. Two single-batch runs per type (about 20 s
    on this machine): the types whose keys need decoding (base64, a narrower integer, a timestamp
    without zone); every type's bucketing is compared above."""
    event_type, dataset_type, keys, missing, outside = KEY_TYPES[key_type]
    if dataset_type == "timestamp":
        # A dataset TIMESTAMP without zone is UTC to the join whatever the session's zone: so in bucketing.
        spark.conf.set("spark.sql.session.timeZone", "America/New_York")
        request.addfinalizer(lambda: spark.conf.set("spark.sql.session.timeZone", "UTC"))
    schema = DatasetSchema("things", ("k",), (Column("k", dataset_type), Column("owner", "string")))
    naive = dataset_type == "timestamp"
    rows = [{"k": _naive(k) if naive else k, "owner": f"o{i}"} for i, k in enumerate(keys)]
    rows += [{"k": k, "owner": "outside"} for k in outside]
    topics = {"events": unique("events"), "things": unique("ref.things")}
    publish(kafka, topics["things"], changelog(schema, rows))
    values = [*keys, missing]
    produce_events(kafka, topics["events"], [{"k": _json(k), "ts": at(i), "n": i}
                                             for i, k in enumerate(values + values)], key_field="n")
    written = {}
    for strategy in ("broadcast", "partitioned"):
        data = {
            "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
            "events": {"topic": topics["events"], "schema": f"k {event_type}, ts TIMESTAMP, n INT",
                       "starting_offsets": "earliest"},
            "joins": [{"dataset": "things", "topic": topics["things"], "on": "k", "how": "inner",
                       "strategy": strategy}],
            "output": {"kafka": {"topic": unique("enriched")}},
            "dead_letter_topic": unique("dlq"),
            "checkpoint": str(tmp_path / strategy / "checkpoint"),
            "state": {"key": "k", "timestamp": "ts", "buckets": 8},
        }
        run(spark, data)
        # The same records; their fields come in another order (partitioned joins run inside the step).
        written[strategy] = sorted(((m.key(), json.loads(m.value()))
                                    for m in read_all(kafka, data["output"]["kafka"]["topic"])), key=lambda r: r[1]["n"])
    assert written["partitioned"] == written["broadcast"]
    # What both gave, against the input: every event of a key the dataset has, with its row, in state.
    out = [r for _, r in written["broadcast"]]
    n = len(values)
    assert [r["n"] for r in out] == [i for i in range(2 * n) if i % n != n - 1]
    assert [r["owner"] for r in out] == [f"o{i % n}" for i in range(2 * n) if i % n != n - 1]
    assert [r["state"]["events"] for r in out] == [1 + i // n for i in range(2 * n) if i % n != n - 1]

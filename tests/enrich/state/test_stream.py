"""The keyed state step in the running job, on real Spark (local) and the real broker: counts and
aggregates over several micro-batches, late events, TTL, dead letters, the checkpoint's record."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyspark.sql import SparkSession

from enrich import config
from enrich.job import EnrichJob
from enrich.state.stream import CHANGELOG_CONF
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError
from tests.enrich.helpers import changelog, produce_events, publish, read_all, read_settled
from tests.timing import bound

DEVICES = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
KEEPERS = DatasetSchema("keepers", ("device_id",), (Column("device_id", "string"), Column("keeper", "string")))
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(minutes: float) -> str:
    return (T0 + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def make_config(kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path, **state: Any) -> dict[str, Any]:
    return {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, ts TIMESTAMP, temp DOUBLE, n INT",
                   "starting_offsets": "earliest", "required": ["n"]},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(tmp_path / "checkpoint"),
        "max_events_per_batch": 4,    # several micro-batches out of each round of events
        "state": {"key": "device_id", "timestamp": "ts", "ttl": "10m", "watermark": "1m", "buckets": 4,
                  "aggregates": {"temp": ["last", "max", "mean"]}, **state},
    }


def run(spark: SparkSession, data: dict[str, Any]) -> None:
    EnrichJob(config.parse(data, "test.yaml"), available_now=True).run(spark)


def outputs(kafka: dict[str, str], topic: str, expect: int = 0) -> dict[int, dict[str, Any]]:
    """The output's rows by their ``n``, read again until ``expect`` are visible (see read_settled)."""
    rows = [json.loads(m.value()) for m in read_settled(kafka, topic, expect)]
    by_n = {r["n"]: r for r in rows}
    assert len(by_n) == len(rows), "an event was written twice"
    return by_n


@pytest.mark.integration
def test_device_state_over_micro_batches(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str],
                                         tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = make_config(kafka, unique, tmp_path)
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
    events = data["events"]["topic"]
    # Round 1, two batches of four: a and b interleaved; one event without device, one without time.
    produce_events(kafka, events, [
        {"device_id": "a", "ts": at(0), "temp": 10.0, "n": 1},
        {"device_id": "b", "ts": at(1), "temp": None, "n": 2},
        {"device_id": "a", "ts": at(2), "temp": 30.0, "n": 3},
        {"device_id": None, "ts": at(2), "temp": 1.0, "n": 4},
        # second batch: the watermark is 2m - 1m = 1m
        {"device_id": "a", "ts": at(3), "temp": None, "n": 5},
        {"device_id": "b", "ts": None, "temp": 1.0, "n": 6},
        {"device_id": "b", "ts": at(4), "temp": 5.0, "n": 7},
        {"device_id": "a", "ts": at(1.5), "temp": 20.0, "n": 8},   # same batch as n=5, earlier: applied first
    ])
    # Round 1 as a checkpoint of an earlier release left it: RocksDB without changelog checkpointing.
    spark.conf.set(CHANGELOG_CONF, "false")
    try:
        run(spark, data)
    finally:
        spark.conf.unset(CHANGELOG_CONF)
    state_dir = Path(data["checkpoint"]) / "spark" / "state"
    assert list(state_dir.rglob("*.zip")) and not list(state_dir.rglob("*.changelog"))
    out = outputs(kafka, data["output"]["kafka"]["topic"], 6)
    assert sorted(out) == [1, 2, 3, 5, 7, 8]
    a = [out[n]["state"] for n in (1, 3, 8, 5)]
    assert [s["events"] for s in a] == [1, 2, 3, 4]
    assert [s["temp_last"] for s in a] == [10.0, 30.0, 20.0, 20.0]
    assert [s["temp_max"] for s in a] == [10.0, 30.0, 30.0, 30.0]
    assert [s["temp_mean"] for s in a] == [10.0, 20.0, 20.0, 20.0]
    assert (a[2]["first_seen"], a[2]["last_seen"]) == ("2026-01-01T00:00:00.000000Z", "2026-01-01T00:02:00.000000Z")
    assert a[3]["last_seen"] == "2026-01-01T00:03:00.000000Z"
    assert [(out[n]["state"]["events"], out[n]["state"]["temp_mean"]) for n in (2, 7)] == [(1, None), (2, 5.0)]
    assert out[1]["owner"] == "ann" and out[2]["_devices_matched"] is False
    assert {out[n]["_late"] for n in out} == {False}
    dead = {json.loads(m.value())["n"]: dict(m.headers())["error"].decode()
            for m in read_all(kafka, data["dead_letter_topic"])}
    assert dead == {4: "state.key device_id is null", 6: "state.timestamp ts is null"}

    # Round 2, a later run on the same checkpoint (its watermark, 4m - 1m, carries over).
    produce_events(kafka, events, [
        {"device_id": "c", "ts": at(30), "temp": 1.0, "n": 9},
        {"device_id": "c", "ts": at(31), "temp": 3.0, "n": 10},
        {"device_id": "b", "ts": at(5), "temp": 7.0, "n": 11},
        {"device_id": "x", "ts": at(2), "temp": 7.0, "n": 12},           # late: at or before 3m
        # next batch: the watermark is 30m, past a's and b's last_seen + 10m: both are dropped
        {"device_id": "b", "ts": at(6), "temp": 8.0, "n": 13},           # late
        {"device_id": "a", "ts": at(32), "temp": 4.0, "n": 14},          # a starts afresh
        {"device_id": "c", "ts": at(31.5), "temp": None, "n": 15},
    ])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="enrich.job"):
        run(spark, data)
    # The batch log counts the late events: one in each of the two batches (a batch without data,
    # which Spark may run to move the watermark on, logs none).
    late_logged = [int(r.getMessage().split(": ")[1].split()[0]) for r in caplog.records
                   if "late event(s) written with a null state" in r.getMessage()]
    assert [n for n in late_logged if n] == [1, 1]
    out = outputs(kafka, data["output"]["kafka"]["topic"], 13)
    assert sorted(out) == [1, 2, 3, 5, 7, *range(8, 16)] and sorted(n for n in out if out[n]["_late"]) == [12, 13]
    assert out[12]["state"] is None and out[13]["state"] is None and out[13]["temp"] == 8.0
    assert (out[11]["state"]["events"], out[11]["state"]["temp_mean"]) == (3, 6.0)
    assert out[14]["state"]["events"] == 1 and out[14]["state"]["first_seen"] == "2026-01-01T00:32:00.000000Z"
    assert out[14]["state"]["temp_max"] == 4.0 and out[14]["owner"] == "ann"
    assert [(out[n]["state"]["events"], out[n]["state"]["temp_mean"]) for n in (9, 10, 15)] == \
        [(1, 1.0), (2, 2.0), (3, 2.0)]
    # Round 2 ran with the job's default, changelog checkpointing, on round 1's state: its batches
    # committed changelog files, and the counts above continued.
    assert list(state_dir.rglob("*.changelog"))

    # The checkpoint keeps the settings its state was written with.
    changed = make_config(kafka, unique, tmp_path, aggregates={"temp": ["last"]})
    changed["events"], changed["joins"], changed["output"] = data["events"], data["joins"], data["output"]
    with pytest.raises(ConfigError, match=r"state\.aggregates changed against the checkpoint .* point checkpoint: "
                                          r"at a new directory"):
        run(spark, changed)
    with pytest.raises(ConfigError, match=r"state\.buckets changed"):
        run(spark, {**data, "state": {**data["state"], "buckets": 8}})
    with pytest.raises(ConfigError, match=r"keeps device state"):
        run(spark, {k: v for k, v in data.items() if k != "state"})


@pytest.mark.integration
def test_state_of_a_broadcast_join_column(spark: SparkSession, kafka: dict[str, str],
                                          unique: Callable[[str], str], tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    from tests.enrich.joins.test_partitioned_job import SITES

    data = make_config(kafka, unique, tmp_path, aggregates={"owner": ["last"], "temp": ["max"]})
    sites = {"dataset": "sites", "topic": unique("ref.sites"), "on": "site_id"}
    data["events"]["schema"] += ", site_id STRING"
    data["joins"].append(sites)   # not needed by the state: stays after the step
    data["max_events_per_batch"] = 100
    devices = data["joins"][0]["topic"]
    publish(kafka, devices, changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
    publish(kafka, sites["topic"], changelog(SITES, [{"site_id": "s1", "city": "Oslo"}]))
    events = data["events"]["topic"]
    produce_events(kafka, events, [{"device_id": d, "ts": at(m), "temp": float(m), "n": m, "site_id": "s1"}
                                   for m, d in enumerate(["a", "b", "a"])])
    with caplog.at_level(logging.INFO, logger="enrich.job"):
        run(spark, data)
    plan = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan: ")]
    assert any("join devices (left, on device_id = device_id, broadcast, in the plan before the state step)" in line
               for line in plan), plan
    assert any("join sites (left, on site_id = site_id, broadcast, in the join pass)" in line for line in plan), plan
    # The owner changes; the next batch's events (and their state) see the version pinned for it.
    publish(kafka, devices, changelog(DEVICES, [{"device_id": "a", "owner": "bob"}, {"device_id": "b", "owner": "bo"}],
                                      version=2, with_schema=False))
    produce_events(kafka, events, [{"device_id": d, "ts": at(m), "temp": 1.0, "n": m, "site_id": "s1"}
                                   for m, d in [(3, "a"), (4, "b")]])
    run(spark, data)
    out = outputs(kafka, data["output"]["kafka"]["topic"], 5)
    got = [(out[n]["owner"], out[n]["state"]["owner_last"], out[n]["state"]["events"], out[n]["city"]) for n in range(5)]
    assert got == [("ann", "ann", 1, "Oslo"), (None, None, 1, "Oslo"), ("ann", "ann", 2, "Oslo"),
                   ("bob", "bob", 3, "Oslo"), ("bo", "bo", 2, "Oslo")]
    assert [out[n]["state"]["temp_max"] for n in range(5)] == [0.0, 1.0, 2.0, 2.0, 1.0]

    # A state column from a join that cannot run before the step is named.
    bad = make_config(kafka, unique, tmp_path / "bad", aggregates={"city": ["last"]})
    bad["joins"].append({**sites, "on": "owner"})    # on a column the devices join adds: fine in the plan
    bad["joins"][0]["strategy"] = "partitioned"      # ... unless devices is joined inside the step
    publish(kafka, bad["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
    with pytest.raises(ConfigError, match=r"state\.aggregates\.city: 'city' comes from a join that cannot run before "
                                          r"the state step"):
        run(spark, bad)
    unknown = {**data, "state": {**data["state"], "aggregates": {"humidity": ["last"]}}}
    with pytest.raises(ConfigError, match=r"state\.aggregates\.humidity: column 'humidity' is neither an event "
                                          r"field nor added by a join"):
        run(spark, unknown)


@pytest.mark.integration
def test_sigkill_then_restart_continues_every_device_count(kafka: dict[str, str], unique: Callable[[str], str],
                                                           tmp_path: Path) -> None:
    """Both join strategies in one job (a broadcast join and a partitioned one, kept in the state
    step): one kill and one restart cover both, instead of a job pair per strategy."""
    from collections import Counter

    from tests.enrich.process import committed_count, run_then_kill, start_job, write_config

    config = tmp_path / "enrich.yaml"
    # Batches of 100: the kill at 300 written lands with most of the 2,000 still to come, however
    # fast the machine (with batches of 500 a quick run had written every event before it landed).
    cfg = write_config(config, kafka, unique, max_events_per_batch=100,
                       state={"key": "device_id", "timestamp": "ts", "watermark": "2h", "buckets": 8,
                              "aggregates": {"n": ["max"]}})
    cfg["events"]["schema"] = "device_id STRING, ts TIMESTAMP, n INT"
    cfg["joins"] = [{**cfg["joins"][0], "strategy": "broadcast"},
                    {"dataset": "keepers", "topic": unique("ref.keepers"), "on": "device_id", "strategy": "partitioned"}]
    config.write_text(yaml.safe_dump(cfg))
    publish(kafka, cfg["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "d1", "owner": "o1"}]))
    publish(kafka, cfg["joins"][1]["topic"], changelog(KEEPERS, [{"device_id": "d2", "keeper": "k2"}]))
    total = 2000
    produce_events(kafka, cfg["events"]["topic"],
                   [{"device_id": f"d{i % 12}", "ts": at(i / 60), "n": i} for i in range(total)], partitions=2)
    out_topic = cfg["output"]["kafka"]["topic"]
    log = tmp_path / "job.log"
    run_then_kill(config, log, lambda: committed_count(kafka, out_topic) >= 300)
    assert committed_count(kafka, out_topic) < total, "the job should have been killed mid-stream"

    # The restart also loses a task: the first one to write records in a batch after the last
    # committed one kills its Python worker inside its transaction (test hook), and Spark runs the
    # task again (local[2,4]), state step included. Any slot: a slot whose transaction the killed
    # run committed before Spark committed the batch skips it, and writes nothing to be killed in.
    from enrich.ops.batches import Checkpoint

    last = Checkpoint(tmp_path / "checkpoint").last_committed()
    flag = tmp_path / "killed"
    # The rest in batches of 1,000 (Spark runs the batch the kill left planned with its own range
    # first): each batch costs the same CPU whatever its size, and the restart is not about sizes.
    config.write_text(yaml.safe_dump({**cfg, "max_events_per_batch": 1000}))
    proc = start_job(config, log, "--available-now", master="local[2,4]",
                     kill=f"{0 if last is None else last + 1}+:*:{flag}")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    assert flag.exists(), "the hook did not fire"
    rows = [json.loads(m.value()) for m in read_all(kafka, out_topic)]
    got = Counter(r["n"] for r in rows)
    assert set(got) == set(range(total)) and max(got.values()) == 1, "an event lost or written twice"
    # A device's events come in order (one partition per device, times rising): its k-th event has
    # events == k across the crash, and the running max is that event's own n.
    for r in rows:
        i = r["n"]
        assert r["state"]["events"] == i // 12 + 1, r
        assert r["state"]["n_max"] == i and r["_late"] is False
        assert r["owner"] == ("o1" if r["device_id"] == "d1" else None), r
        assert r["keeper"] == ("k2" if r["device_id"] == "d2" else None), r
    # The count of devices in state continues across the crash and the retried task too.
    counts = [line.rsplit("; ", 1)[1] for line in log.read_text().splitlines() if line.endswith(" device(s) in state")]
    assert counts and counts[-1] == "12 device(s) in state", counts[-5:]


@pytest.mark.integration
def test_parquet_output_carries_the_state_struct(spark: SparkSession, kafka: dict[str, str],
                                                 unique: Callable[[str], str], tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    data = {**make_config(kafka, unique, tmp_path), "output": {"parquet": {"path": str(out)}}, "metrics": {"port": 0}}
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": "a", "ts": at(0), "temp": 10.0, "n": 1}, {"device_id": "a", "ts": at(1), "temp": 20.0, "n": 2},
        {"device_id": "b", "ts": at(5), "temp": 1.0, "n": 3}, {"device_id": "b", "ts": at(0), "temp": 2.0, "n": 4},
        {"device_id": "a", "ts": at(3), "temp": 30.0, "n": 5}])
    job = EnrichJob(config.parse(data, "test.yaml"), available_now=True)
    job.run(spark)
    # The Parquet sink counts what it wrote from the files' footers; the job counts late events (n=5,
    # at 3m, in a batch whose watermark is 5m - 1m) and the join pass the unmatched ones (b's two).
    assert job.started.metrics is not None
    value = job.started.metrics.registry.get_sample_value
    assert [value("refstream_enrich_events_total", {"result": r}) for r in ("enriched", "late", "unmatched")] == \
        [5, 1, 2]
    rows = sorted((r for d in sorted(out.glob("batch_id=*")) for r in pq.read_table(d).to_pylist()),
                  key=lambda r: r["n"])
    assert [(r["n"], r["owner"], r["_late"]) for r in rows][:2] == [(1, "ann", False), (2, "ann", False)]
    naive = T0.replace(tzinfo=None)   # Spark writes TIMESTAMP to Parquet as INT96 (UTC, no zone)
    assert rows[1]["state"] == {"events": 2, "first_seen": naive, "last_seen": naive + timedelta(minutes=1),
                                "temp_last": 20.0, "temp_max": 20.0, "temp_mean": 15.0}


@pytest.mark.integration
def test_events_left_to_from_json_are_counted_like_the_others(spark: SparkSession, kafka: dict[str, str],
                                                             unique: Callable[[str], str], tmp_path: Path) -> None:
    """The fast parser leaves these values to ``from_json`` (enrich.state.ingest): single quotes, a
    timestamp with a space, a field that is not JSON's type, a value that is not JSON at all. In
    between the others, the same device's state counts them in offset order, and the output is
    the one ``events.parser: spark`` gives, byte for byte."""
    values: list[bytes | dict[str, Any]] = [
        {"device_id": "a", "ts": at(0), "temp": 1.0, "n": 1},
        b"{'device_id': 'a', 'ts': '" + at(1).encode() + b"', 'temp': 3.0, 'n': 2}",
        {"device_id": "b", "ts": at(1), "temp": 2.0, "n": 3},
        b'{"device_id": "a", "ts": "2026-01-01 00:02:00", "temp": 5.0, "n": 4}',
        b'{"device_id": "b", "ts": "' + at(2).encode() + b'", "temp": "7", "n": 5}',
        b"not json",
        {"device_id": "a", "ts": at(3), "temp": 9.0, "n": 6},
        b'{"device_id": null, "ts": "2026-01-01 00:04:00", "temp": 1.0, "n": 7}',
    ]
    written = {}
    for parser in ("auto", "spark"):
        data = make_config(kafka, unique, tmp_path / parser)
        data["events"]["parser"] = parser
        data["max_events_per_batch"] = 5
        publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
        produce_events(kafka, data["events"]["topic"], values)
        run(spark, data)
        # Buckets leave the step in no fixed order: compared as sets of records, each run's events
        # topic (which every record names) written the same.
        topic = data["events"]["topic"].encode()
        written[parser] = (sorted((m.key(), m.value().replace(topic, b"<events>"))
                                  for m in read_all(kafka, data["output"]["kafka"]["topic"])),
                           sorted((m.value(), dict(m.headers())["error"]) for m in read_all(kafka, data["dead_letter_topic"])))
    assert written["auto"] == written["spark"]
    out = {json.loads(v)["n"]: json.loads(v) for _, v in written["auto"][0]}
    assert [out[n]["state"]["events"] for n in (1, 2, 4, 6)] == [1, 2, 3, 4]
    assert [out[n]["state"]["temp_mean"] for n in (1, 2, 4, 6)] == [1.0, 2.0, 3.0, 4.5]
    assert out[3]["state"]["events"] == 1
    dead = {e.decode() for _, e in written["auto"][1]}
    assert "state.key device_id is null" in dead and any("not valid JSON" in e for e in dead)


@pytest.mark.integration
def test_the_buckets_are_spread_evenly_over_the_state_partitions(spark: SparkSession, kafka: dict[str, str],
                                                                  unique: Callable[[str], str], tmp_path: Path) -> None:
    from enrich.checkpoint import CheckpointLayout
    from enrich.state.layout import BucketLayout
    from enrich.state.record import BUCKET_IDS, PARTITIONS

    data = make_config(kafka, unique, tmp_path, buckets=8)
    data["max_events_per_batch"] = 1000
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "d1", "owner": "ann"}]))
    produce_events(kafka, data["events"]["topic"],
                   [{"device_id": f"d{i}", "ts": at(i / 60), "temp": 1.0, "n": i} for i in range(200)])
    run(spark, data)
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions") or 0)
    checkpoint = CheckpointLayout(Path(data["checkpoint"]))
    layout = BucketLayout.even(8)   # partitions (2 here) divides 8
    kept = json.loads(checkpoint.state_record.read_text())
    assert kept[PARTITIONS] == partitions and kept[BUCKET_IDS] == list(layout.ids)
    # Where Spark's state store holds each bucket's table: the partition the layout chose for it.
    rows = (spark.read.format("statestore").option("path", str(checkpoint.spark))
            .option("stateVarName", "devices").load().select("partition_id", "key._bucket").collect())
    held = {r["_bucket"]: r["partition_id"] for r in rows}
    assert len(rows) == 8 and sorted(held) == sorted(layout.ids)
    assert [held[g] for g in layout.ids] == [b % partitions for b in range(8)]
    assert sum(json.loads(checkpoint.devices.read_text())["buckets"].values()) == 200


@pytest.mark.integration
def test_an_event_from_the_future_is_a_dead_letter_and_moves_neither_watermark_nor_state(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """One device's clock years ahead: without a guard its event would move the watermark there for
    good, the TTL would drop every device's state and every later event would be late. With the
    default ``max_future_skew`` (1h) it is a dead letter and the others carry on."""
    data = {**make_config(kafka, unique, tmp_path), "metrics": {"port": 0}}
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
    future = (datetime.now(UTC) + timedelta(days=3 * 365)).replace(microsecond=0)
    produce_events(kafka, data["events"]["topic"], [
        # first batch (four events each): the future event among real ones
        {"device_id": "a", "ts": at(0), "temp": 1.0, "n": 1},
        {"device_id": "b", "ts": at(1), "temp": 2.0, "n": 2},
        {"device_id": "z", "ts": future.strftime("%Y-%m-%dT%H:%M:%SZ"), "temp": 9.0, "n": 3},
        {"device_id": "a", "ts": at(2), "temp": 3.0, "n": 4},
        *[{"device_id": "ab"[i % 2], "ts": at(3 + i), "temp": float(i), "n": 5 + i} for i in range(8)],
    ])
    job = EnrichJob(config.parse(data, "test.yaml"), available_now=True)
    job.run(spark)
    out = outputs(kafka, data["output"]["kafka"]["topic"], 11)
    assert {n for n in out if out[n]["_late"]} == set()
    dead = [(json.loads(m.value())["n"], dict(m.headers())["error"].decode())
            for m in read_all(kafka, data["dead_letter_topic"])]
    assert dead == [(3, f"event time {future:%Y-%m-%dT%H:%M:%SZ} is more than 1h ahead of the clock")]
    assert sorted(out) == [1, 2, *range(4, 13)]
    # Every later event of a and b counts on from their earlier ones: no state was dropped.
    assert [out[n]["state"]["events"] for n in (1, 4, 5, 7, 9, 11)] == [1, 2, 3, 4, 5, 6]
    assert [out[n]["state"]["events"] for n in (2, 6, 8, 10, 12)] == [1, 2, 3, 4, 5]
    # The watermark the metric shows is the real events' (the greatest time, 10m, less 1m, as
    # of the last progress the driver read), not the future event's.
    assert job.started.metrics is not None
    watermark = job.started.metrics.registry.get_sample_value("refstream_enrich_watermark_seconds")
    assert watermark is not None and T0.timestamp() < watermark <= (T0 + timedelta(minutes=9)).timestamp()


@pytest.mark.integration
def test_a_device_id_longer_than_max_key_bytes_is_a_dead_letter_and_the_others_carry_on(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """A 300 kB device id (the default state.max_key_bytes is 1 KiB) through Kafka: a dead letter
    naming the size, never hashed or kept in the state; the events around it are enriched as usual."""
    data = make_config(kafka, unique, tmp_path)
    publish(kafka, data["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "a", "owner": "ann"}]))
    huge = "x" * 300_000
    produce_events(kafka, data["events"]["topic"], [
        {"device_id": "a", "ts": at(0), "temp": 1.0, "n": 1},
        {"device_id": huge, "ts": at(1), "temp": 2.0, "n": 2},
        {"device_id": "a", "ts": at(2), "temp": 3.0, "n": 3},
    ])
    run(spark, data)
    out = outputs(kafka, data["output"]["kafka"]["topic"], 2)
    assert sorted(out) == [1, 3] and [out[n]["state"]["events"] for n in (1, 3)] == [1, 2]
    dead = [(json.loads(m.value())["n"], dict(m.headers())["error"].decode())
            for m in read_all(kafka, data["dead_letter_topic"])]
    assert dead == [(2, "state.key device_id is 300000 bytes, more than state.max_key_bytes 1024")]

"""``enrich savepoint`` and ``enrich run --from-savepoint``: a savepoint after batch N, two jobs
forked from it that write what the original job writes for the later events, a savepoint of a
running job, and the refusals (no Spark for most of them)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from pyspark.sql import DataFrame, SparkSession

from enrich import cli, config
from enrich.checkpoint import CheckpointLayout
from enrich.job import EnrichJob
from enrich.ops import savepoint as sp
from enrich.ops.savepoint import META, STATE, Savepoint, SavepointRefused, from_rows, to_rows
from enrich.state import engine
from enrich.state.engine import StateSpec
from enrich.state.stored import stored_spec
from refstream.errors import ConfigError
from tests.enrich.helpers import changelog, produce_events, publish, read_all, read_settled, wait_for
from tests.enrich.ops.test_rescale import batch, checkpoint, write_config
from tests.enrich.state.test_stream import DEVICES, T0, at, make_config, outputs, run

# ---------------------------------------------------------------------------------- without Spark

SPEC = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=600_000_000,
                 aggregates=(("temp", ("last", "mean"), pa.float64()),))


def saved(tmp_path: Path, **state: Any) -> Savepoint:
    meta = {"format": sp.FORMAT, "batch_id": 3, "events": {"topic": "ev", "offsets": {"0": 30}},
            "state": {"key": "device_id", "key_type": "string", "aggregates": {"temp": ["last", "mean"]},
                      "aggregate_types": {"temp": "double"}, **state}}
    return Savepoint(tmp_path, meta)


def cfg_with(tmp_path: Path, **state: Any) -> config.EnrichConfig:
    return config.load(write_config(tmp_path, state={"key": "device_id", "timestamp": "ts", "buckets": 8, **state}))


def test_the_config_must_continue_the_savepoints_state(tmp_path: Path) -> None:
    """One line naming the setting that differs; an added aggregate, another TTL or bucket count is fine."""
    point = saved(tmp_path)
    ok = cfg_with(tmp_path, aggregates={"temp": ["last", "mean", "max"]}, ttl="2h", buckets=16)
    point.check(ok, SPEC)
    with pytest.raises(SavepointRefused, match=r"state.key is 'site'; the savepoint .* keeps device state by "
                                               r"'device_id'"):
        point.check(cfg_with(tmp_path, key="site"), SPEC)
    with pytest.raises(SavepointRefused, match=r"state.aggregates.temp: mean removed; the savepoint"):
        point.check(cfg_with(tmp_path, aggregates={"temp": ["last"]}), SPEC)
    with pytest.raises(SavepointRefused, match=r"state.key 'device_id' is of type int64; in the savepoint"):
        point.check(ok, StateSpec(key="device_id", key_type=pa.int64(), timestamp="ts", ttl_us=1))
    floats = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=1,
                       aggregates=(("temp", ("last", "mean"), pa.float32()),))
    with pytest.raises(SavepointRefused, match=r"state.aggregates.temp: the column is float; in the savepoint"):
        point.check(ok, floats)
    other = config.load(write_config(tmp_path / "o", events={"topic": "other", "schema": "device_id STRING"}))
    with pytest.raises(SavepointRefused, match="events.topic is 'other'"):
        point.check(other, SPEC)
    assert issubclass(SavepointRefused, ConfigError)  # the CLI's exit 2


def test_rows_round_trip_and_an_added_aggregate_starts_empty() -> None:
    stored = stored_spec(SPEC)
    table = pa.table({engine.KEY: ["a", "b"], engine.FIRST_SEEN: [1_000_000, 2_000_000],
                      engine.LAST_SEEN: [3_000_000, 4_000_000], engine.EVENTS: [2, 1], "temp_last": [1.5, None],
                      "temp_sum": [3.0, 0.0], "temp_count": [2, 0]}, schema=stored.state_schema())
    rows = to_rows(table, SPEC, "device_id")
    assert rows.column_names == ["device_id", "events", "first_seen", "last_seen", "temp_last", "temp_mean",
                                 "temp_mean_sum", "temp_mean_count"]
    assert rows.column("temp_mean").to_pylist() == [1.5, None] and str(rows.schema.field("first_seen").type) == \
        "timestamp[us, tz=UTC]"
    assert from_rows(rows, SPEC, "device_id").equals(table)
    more = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=1,
                     aggregates=(("temp", ("last", "mean", "max"), pa.float64()), ("n", ("mean",), pa.int32())))
    back = from_rows(rows, more, "device_id")
    assert back.column("temp_max").to_pylist() == [None, None]
    assert back.column("n_sum").to_pylist() == [0.0, 0.0] and back.column("n_count").to_pylist() == [0, 0]
    assert back.column("temp_sum").to_pylist() == [3.0, 0.0]


def test_refused_into_a_non_empty_directory_or_without_a_committed_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path)
    ck = checkpoint(tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    assert cli.main(["savepoint", "--config", str(path), "--to", str(full)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"enrich: error: {full}: not an empty directory; a savepoint is written to a new or empty one"]
    for name in ("0", "1"):
        (ck.commits / name).unlink()
    assert cli.main(["savepoint", "--config", str(path), "--to", str(tmp_path / "new")]) == 2
    assert "no batch has been committed yet" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_refused_for_a_job_whose_joins_wait(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The events a waiting join holds are past the recorded offsets but in no device's state: a
    savepoint would lose them."""
    path = write_config(tmp_path, joins=[{"dataset": "owners", "on": "device_id", "as_of": True,
                                          "wait": "complete"}])
    checkpoint(tmp_path)
    assert cli.main(["savepoint", "--config", str(path), "--to", str(tmp_path / "new")]) == 2
    assert "joins wait for completeness (owners); a savepoint does not hold the events they hold" in \
        capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_fork_with_corrections_of_a_savepoint_without_written_events_is_warned_of(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A savepoint of a job with corrections holds its written events and a fork goes on correcting
    them (tests/enrich/state/test_corrections_job.py); one of a job without them holds none: the fork
    starts, and a warning says that it corrects only what it writes itself."""
    joins = [{"dataset": "owners", "on": "device_id"},
             {"dataset": "devices", "on": "device_id", "as_of": True, "corrections": {"horizon": "1h"}}]
    state = {"key": "device_id", "timestamp": "ts", "aggregates": {"temp": ["last", "mean"]}}
    cfg = config.load(write_config(tmp_path, joins=joins, state=state))
    with caplog.at_level("WARNING", logger="enrich.ops.savepoint"):
        saved(tmp_path).check(cfg, SPEC)
    assert [r.getMessage() for r in caplog.records] == [
        f"{cfg.source}: joins[1].corrections: the savepoint {tmp_path} was taken of a job without corrections and "
        "holds no events it wrote; the fork corrects only the events it writes itself"]
    caplog.clear()
    holding = saved(tmp_path)
    holding.meta["written"] = {"rows": sp.WRITTEN_FILE, "chunks": 0}
    with caplog.at_level("WARNING", logger="enrich.ops.savepoint"):
        holding.check(cfg, SPEC)
    assert not caplog.records


def test_a_rollup_the_savepoint_holds_must_keep_its_layout(tmp_path: Path) -> None:
    """A rollup held under its name with another window is refused; one added or removed is fine."""
    from enrich.rollups.spec import RollupSpec
    from enrich.state.record import rollup_record

    r = RollupSpec(name="d_1m", by=("device_id",), by_types=(pa.string(),), window_us=60_000_000,
                   correct_for_us=60_000_000, metrics=(("temp", ("mean",), pa.float64()),))
    point = saved(tmp_path)
    point.meta["rollups"] = {"rows": "rollups.parquet", "rollups": rollup_record([r])}
    cfg = cfg_with(tmp_path, aggregates={"temp": ["last", "mean"]})
    point.check(cfg, SPEC, (), [r])
    point.check(cfg, SPEC, (), [])                                            # removed
    point.check(cfg, SPEC, (), [r, dataclasses.replace(r, name="d_2m")])   # added
    with pytest.raises(SavepointRefused, match=r"rollup d_1m: window changed; the savepoint .* new name"):
        point.check(cfg, SPEC, (), [dataclasses.replace(r, window_us=120_000_000)])
    # A rollup that moves its events (corrections) keeps its windows' parts per state bucket: it must
    # keep moving, and a fork the savepoint's bucket count.
    with pytest.raises(SavepointRefused, match=r"rollup d_1m: moving its events when a late version corrects"):
        point.check(cfg, SPEC, (), [dataclasses.replace(r, moves=True)])
    moving = dataclasses.replace(r, moves=True)
    point.meta["rollups"] = {"rows": "rollups.parquet", "rollups": rollup_record([moving]), "bucket_ids": list(range(8))}
    point.check(cfg, SPEC, (), [moving])
    with pytest.raises(SavepointRefused, match=r"rollup d_1m: its windows' parts are kept per state bucket and the "
                                               r"savepoint .* has 8 buckets, not 16"):
        point.check(cfg_with(tmp_path, aggregates={"temp": ["last", "mean"]}, buckets=16), SPEC, (), [moving])


def test_a_fork_is_refused_on_a_checkpoint_with_batches(tmp_path: Path) -> None:
    ck = checkpoint(tmp_path)
    batch(ck, 2, 2)
    with pytest.raises(SavepointRefused, match=r"the checkpoint has batches already; --from-savepoint"):
        EnrichJob(config.load(write_config(tmp_path)), from_savepoint=tmp_path / "sp").start(None)  # type: ignore[arg-type]
    with pytest.raises(SavepointRefused, match="no savepoint"):
        sp.load(tmp_path / "nothing")


# ------------------------------------------------------------------------------ the job, forked


def fork_config(data: dict[str, Any], unique: Callable[[str], str], tmp_path: Path, name: str) -> dict[str, Any]:
    """The same job into its own checkpoint and output topic."""
    out = copy.deepcopy(data)
    out["checkpoint"] = str(tmp_path / name)
    out["output"]["kafka"]["topic"] = unique(f"enriched-{name}")
    return out


def _counted(real: Callable[..., Any], into: list[int]) -> Callable[..., Any]:
    def spy(self: DataFrame, *args: Any, **kwargs: Any) -> Any:
        got = real(self, *args, **kwargs)
        into.append(len(got) if isinstance(got, list) else got.num_rows if isinstance(got, pa.Table) else len(got))
        return got
    return spy


@contextlib.contextmanager
def on_the_driver(spark: SparkSession) -> Iterator[dict[str, list[int]]]:
    """What reaches the driver meanwhile: the row count of every DataFrame collected
    (``collect``, ``toArrow``, ``toPandas``) and of every one created from local data."""
    frame = type(spark.range(0))  # the session's DataFrame class (PySpark's classic one)
    seen: dict[str, list[int]] = {"collected": [], "created": []}
    real_create = SparkSession.createDataFrame

    def create(self: SparkSession, data: Any, *args: Any, **kwargs: Any) -> DataFrame:
        seen["created"].append(len(data) if isinstance(data, list) else -1)
        return real_create(self, data, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        for name in ("collect", "toArrow", "toPandas"):
            mp.setattr(frame, name, _counted(getattr(frame, name), seen["collected"]))
        mp.setattr(SparkSession, "createDataFrame", create)
        yield seen


def settled(kafka: dict[str, str], topic: str, expect: int) -> dict[int, dict[str, Any]]:
    """:func:`outputs` once the topic holds ``expect`` committed records (a read right after a
    transaction's commit can stop short of its markers: :func:`tests.enrich.helpers.read_settled`)."""
    read_settled(kafka, topic, expect)
    return outputs(kafka, topic)


def fork(spark: SparkSession, data: dict[str, Any], directory: Path) -> None:
    EnrichJob(config.parse(data, "test.yaml"), available_now=True, from_savepoint=directory).run(spark)


@pytest.mark.integration
def test_two_forks_from_a_savepoint_write_what_the_original_job_writes(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A savepoint after batch N of a job (partitioned dimension, aggregates, watermark); the job
    goes on over more events, and two new jobs forked from the savepoint read the same events: the
    first, same config, writes the same record for every later event (state, late flag, the
    dimension's columns), the second, with an aggregate added, the same with that aggregate empty
    until each device's next event. Then the refusals of a fork's start."""
    data = make_config(kafka, unique, tmp_path, buckets=4)
    data["max_events_per_batch"] = 10
    data["joins"][0]["strategy"] = "partitioned"
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    devices_topic, events = data["joins"][0]["topic"], data["events"]["topic"]
    publish(kafka, devices_topic, changelog(DEVICES, [{"device_id": "d1", "owner": "ann"}]))
    # Ten devices, three events each, one a minute: the watermark (1m) ends at minute 28.
    produce_events(kafka, events, [{"device_id": f"d{n % 10}", "ts": at(n), "temp": float(n), "n": n}
                                   for n in range(30)])
    run(spark, data)
    ck = CheckpointLayout(Path(data["checkpoint"]))
    last = ck.committed()[-1]

    point = tmp_path / "savepoint"
    with on_the_driver(spark) as driver:
        assert cli.main(["savepoint", "--config", str(path), "--to", str(point)]) == 0
    assert f"savepoint of batch {last} of" in capsys.readouterr().out
    # No device nor bucket passed through the driver: what it collected is the dimension's schema
    # (one value per version), and Spark's tasks wrote the part files.
    assert driver["collected"] and max(driver["collected"]) <= 1, driver
    parts = sorted((point / STATE).glob("part-*.parquet"))
    assert parts and (point / STATE / "_SUCCESS").exists()
    assert sorted((point / "dimensions" / "devices.parquet").glob("part-*.parquet"))
    meta = json.loads((point / META).read_text())
    assert meta["batch_id"] == last and meta["events"]["offsets"] == {"0": 30}
    # The watermark for the batch after it: the greatest event time (minute 29) less 1m.
    assert meta["watermark_ms"] == int((T0 + timedelta(minutes=28)).timestamp() * 1000)
    assert meta["state"]["key"] == "device_id" and meta["state"]["buckets"] == 4
    rows = pq.read_table(point / STATE)         # any tool reads it: one row per device
    assert rows.schema.field("first_seen").type == pa.timestamp("us", tz="UTC")
    assert sorted(rows.column("device_id").to_pylist()) == sorted(f"d{i}" for i in range(10))
    assert set(rows.column("events").to_pylist()) == {3}
    d1 = rows.filter(pa.compute.equal(rows.column("device_id"), "d1")).to_pylist()[0]
    assert (d1["temp_last"], d1["temp_max"], d1["temp_mean"]) == (21.0, 21.0, 11.0)
    assert pq.read_table(point / "dimensions" / "devices.parquet").num_rows == 1

    # Later events: one late (minute 5, behind the watermark) first, a new device, a dimension change.
    publish(kafka, devices_topic, changelog(DEVICES, [{"device_id": "d2", "owner": "bo"}], version=2,
                                            with_schema=False))
    later = [{"device_id": "d3", "ts": at(5), "temp": 99.0, "n": 100}]
    later += [{"device_id": f"d{n % 10}", "ts": at(n), "temp": float(n), "n": n} for n in range(30, 50)]
    later += [{"device_id": "d99", "ts": at(50), "temp": 1.0, "n": 101}]
    produce_events(kafka, events, later)
    run(spark, data)
    original = settled(kafka, data["output"]["kafka"]["topic"], 30 + len(later))
    assert original[100]["_late"] is True and original[100]["state"] is None

    same = fork_config(data, unique, tmp_path, "fork1")
    with on_the_driver(spark) as driver:
        fork(spark, same, point)
    assert not driver["created"]  # the initial state was built by Spark from the files, not on the driver
    forked = settled(kafka, same["output"]["kafka"]["topic"], len(later))
    later_n = sorted(e["n"] for e in later)
    assert sorted(forked) == later_n
    differ = [n for n in later_n if forked[n] != original[n]]
    assert not differ, [(original[n], forked[n]) for n in differ[:3]]
    assert forked[32]["owner"] == "bo" and forked[31]["owner"] == "ann" and forked[31]["state"]["events"] == 4

    added = fork_config(data, unique, tmp_path, "fork2")
    added["state"]["aggregates"]["n"] = ["min"]
    fork(spark, added, point)
    second = settled(kafka, added["output"]["kafka"]["topic"], len(later))
    assert sorted(second) == later_n
    for n in later_n:
        got, want = copy.deepcopy(second[n]), original[n]
        if want["state"] is not None:
            # The added aggregate starts empty: its minimum is of the device's events since the savepoint.
            assert got["state"].pop("n_min") == (101 if n == 101 else 30 + n % 10), (n, second[n])
        assert got == want, (got, want)
    # The fork's own checkpoint started at the savepoint's offsets, with its own state record.
    assert CheckpointLayout(Path(same["checkpoint"])).committed()

    # A config that cannot continue the state: refused at the start, one line naming the setting.
    removed = fork_config(data, unique, tmp_path, "fork3")
    removed["state"]["aggregates"]["temp"] = ["last"]
    with pytest.raises(SavepointRefused, match=r"state.aggregates.temp: max, mean removed"):
        fork(spark, removed, point)
    other_key = fork_config(data, unique, tmp_path, "fork4")
    other_key["events"]["schema"] += ", site STRING"
    other_key["state"]["key"] = "site"
    other_key["joins"] = []   # a partitioned join is on state.key
    with pytest.raises(SavepointRefused, match=r"state.key is 'site'"):
        fork(spark, other_key, point)
    # The partitioned join's rows kept otherwise (as_of adds their validity): refused naming the join,
    # not a crash of the fork's first batch on an executor.
    as_of = fork_config(data, unique, tmp_path, "fork5")
    as_of["joins"][0]["as_of"] = True
    with pytest.raises(SavepointRefused, match=r"joins\[0\] \(devices, partitioned\): .*as_of changed"):
        fork(spark, as_of, point)
    # A fork into a checkpoint that has batches and is not a fork of this savepoint: refused (on its
    # own fork the same savepoint is a restart: tests/enrich/test_origin.py).
    with pytest.raises(SavepointRefused, match="the checkpoint has batches already"):
        fork(spark, data, point)

    # A savepoint that fails half way leaves no directory behind: the command can run again.
    def fail(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(sp, "write_json_atomic", fail)
    with pytest.raises(OSError, match="disk full"):
        sp.take(config.parse(data, "test.yaml"), tmp_path / "again", spark=spark)
    assert not (tmp_path / "again").exists()


@pytest.fixture
def running_job(spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str],
                tmp_path: Path) -> Iterator[tuple[dict[str, Any], EnrichJob, threading.Thread]]:
    data = make_config(kafka, unique, tmp_path, buckets=4)
    data["trigger"] = "100ms"
    data["max_events_per_batch"] = 5
    data["joins"] = []
    job = EnrichJob(config.parse(data, "test.yaml"))
    runner = threading.Thread(target=job.run, args=(spark,), daemon=True)
    runner.start()
    try:
        yield data, job, runner
    finally:
        job.stop()
        runner.join(120)


@pytest.mark.integration
def test_a_savepoint_of_a_running_job_is_its_last_committed_batch(
        spark: SparkSession, kafka: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        running_job: tuple[dict[str, Any], EnrichJob, threading.Thread]) -> None:
    """Taken while the job commits batch after batch: the batch recorded is the last one the commit
    log held when the savepoint read it, and the state is exactly that batch's (every event below
    its offsets counted once, none above)."""
    data, job, runner = running_job
    ck = CheckpointLayout(Path(data["checkpoint"]))
    events = data["events"]["topic"]
    produce_events(kafka, events, [{"device_id": f"d{n % 7}", "ts": at(n / 10), "temp": 1.0, "n": n}
                                   for n in range(40)])
    wait_for(lambda: len(ck.committed()) >= 2, "two committed batches", runner)
    seen: list[list[int]] = []
    committed = CheckpointLayout.committed

    def spy(self: CheckpointLayout) -> list[int]:
        got = committed(self)
        if threading.current_thread() is threading.main_thread():  # the savepoint's reads, not the job's
            seen.append(got)
        return got

    monkeypatch.setattr(CheckpointLayout, "committed", spy)
    point = tmp_path / "savepoint"
    result = sp.take(config.parse(data, "test.yaml"), point, spark=spark)
    monkeypatch.undo()
    assert seen and result.batch_id == seen[-1][-1]   # the commit log's last when it was read
    assert result.batch_id in ck.committed()
    meta = json.loads((point / META).read_text())
    upto = meta["events"]["offsets"]["0"]
    assert 0 < upto <= 40
    rows = pq.read_table(point / STATE)
    # The state holds exactly the events below the batch's end offset (each device once).
    want = Counter(f"d{n % 7}" for n in range(upto))
    assert dict(zip(rows.column("device_id").to_pylist(), rows.column("events").to_pylist(), strict=True)) == want
    assert len(read_all(kafka, data["output"]["kafka"]["topic"])) >= upto


@pytest.mark.integration
def test_a_savepoint_of_no_device_forks_an_empty_state(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """A committed batch that left no device (its events had no key): the savepoint holds none, and
    a fork from it starts with an empty state at the recorded offsets."""
    data = make_config(kafka, unique, tmp_path)
    data["joins"] = []
    events = data["events"]["topic"]
    produce_events(kafka, events, [{"device_id": None, "ts": at(n), "temp": 1.0, "n": n} for n in range(2)])
    run(spark, data)
    point = tmp_path / "savepoint"
    result = sp.take(config.parse(data, "test.yaml"), point, spark=spark)
    assert result.devices == 0 and json.loads((point / META).read_text())["events"]["offsets"] == {"0": 2}
    produce_events(kafka, events, [{"device_id": "a", "ts": at(3), "temp": 2.0, "n": 3}])
    same = fork_config(data, unique, tmp_path, "fork")
    fork(spark, same, point)
    forked = settled(kafka, same["output"]["kafka"]["topic"], 1)
    assert list(forked) == [3] and forked[3]["state"]["events"] == 1


def test_the_source_offsets_of_a_batch_leave_the_tick_sources_out(tmp_path: Path) -> None:
    """A job with the tick source (gaps, idle_finalize, a fill by a join's keys) has its offset beside
    the topics' in the offset log: a savepoint reads the topics' only (it failed on the tick's before)."""
    ck = CheckpointLayout(tmp_path)
    ck.offsets.mkdir(parents=True)
    (ck.offsets / "4").write_text('v1\n{"batchTimestampMs": 5}\n{"events": {"0": 3, "1": 7}, "@topic_ids": '
                                  '{"events": "x"}}\n{"ms": 1796314669455}\n')
    assert sp._sources(ck, 4) == {("events", 0): 3, ("events", 1): 7}

"""``enrich rescale``: its refusals on checkpoints laid out by hand (no Spark), and one job run with
2 state partitions, rescaled to 4 and then to 1, on real Spark and the real broker."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyspark.sql import SparkSession

from enrich import cli, config
from enrich.checkpoint import CheckpointBusy, CheckpointLayout
from enrich.job import EnrichJob
from enrich.ops.batches import Checkpoint
from enrich.ops.rescale import RescaleRefused, rescale
from enrich.state.layout import BucketLayout
from enrich.state.record import BUCKET_IDS, PARTITIONS
from refstream.errors import ConfigError
from tests.enrich.helpers import changelog, produce_events, publish
from tests.enrich.state.test_stream import DEVICES, at, make_config, outputs, run

# ------------------------------------------------------------------------ a checkpoint laid out by hand


def write_config(tmp_path: Path, **extra: Any) -> Path:
    data = {"kafka": {"bootstrap_servers": "127.0.0.1:9"},
            "events": {"topic": "ev", "schema": "device_id STRING, ts TIMESTAMP"},
            "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq",
            "checkpoint": str(tmp_path / "checkpoint"),
            "state": {"key": "device_id", "timestamp": "ts", "buckets": 8}, **extra}
    data = {k: v for k, v in data.items() if v is not None}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def batch(ck: CheckpointLayout, n: int, partitions: int, *, committed: bool = True) -> None:
    """Spark's offset log entry of batch ``n`` (recording ``partitions``) and, if ``committed``, its commit."""
    ck.offsets.mkdir(parents=True, exist_ok=True)
    ck.commits.mkdir(parents=True, exist_ok=True)
    meta = {"batchWatermarkMs": 0, "batchTimestampMs": 1000 + n, "conf": {"spark.sql.shuffle.partitions": str(partitions)}}
    (ck.offsets / str(n)).write_text(f"v1\n{json.dumps(meta)}\n{json.dumps({'ev': {'0': 10 * n}})}\n")
    if committed:
        (ck.commits / str(n)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')


def checkpoint(tmp_path: Path, partitions: int = 2) -> CheckpointLayout:
    """A checkpoint whose job ran with state: its record, and batches 0 and 1 committed."""
    ck = CheckpointLayout(tmp_path / "checkpoint")
    ck.own.mkdir(parents=True)
    ck.state_record.write_text(json.dumps({"key": "device_id", "buckets": 8, PARTITIONS: partitions,
                                           BUCKET_IDS: list(BucketLayout.even(8).ids)}))
    for n in (0, 1):
        batch(ck, n, partitions)
        ck.dimensions.mkdir(exist_ok=True)
        (ck.dimensions / f"{n}.json").write_text(json.dumps({"batch_id": n, "positions": {"devices": {"0": n}}}))
    return ck


def refused(path: Path, partitions: int, capsys: pytest.CaptureFixture[str]) -> str:
    """``enrich rescale``'s one line of refusal (exit 2); the checkpoint's logs unchanged."""
    ck = CheckpointLayout(Path(config.load(path).checkpoint))
    before = (ck.planned(), ck.committed())
    assert cli.main(["rescale", "--config", str(path), "--partitions", str(partitions)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("enrich: error: "), err
    assert (ck.planned(), ck.committed()) == before
    return err[0]


def test_refused_while_the_job_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = checkpoint(tmp_path)
    with ck.held():   # what a running job holds
        assert "the job is running on this checkpoint" in refused(write_config(tmp_path), 4, capsys)
    # And the other way round: a job does not start while a rescale holds the checkpoint.
    cfg = config.load(write_config(tmp_path))
    with ck.held(exclusive=True), pytest.raises(CheckpointBusy, match="enrich rescale is rewriting"):
        EnrichJob(cfg).start(None)  # type: ignore[arg-type]  # refused before Spark is touched


def test_refused_when_the_last_batch_is_not_committed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = checkpoint(tmp_path)
    batch(ck, 2, 2, committed=False)
    line = refused(write_config(tmp_path), 4, capsys)
    assert "batch 2 was planned and not committed" in line and "offsets/2 without" in line
    assert "enrich run --available-now" in line


def test_an_unfinished_rescale_is_finished_with_its_own_number_first(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ck = checkpoint(tmp_path)
    batch(ck, 2, 4, committed=False)   # Spark's repartition batch, planned with 4, not committed
    assert ck.unfinished_rescale() == 4
    line = refused(write_config(tmp_path), 8, capsys)
    assert "a rescale to 4 state partitions did not finish (batch 2)" in line
    assert "enrich rescale --partitions 4 first" in line


def test_refused_before_any_batch_or_without_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path)
    assert "has not run with state: on this checkpoint" in refused(path, 4, capsys)
    ck = checkpoint(tmp_path)
    for name in ("0", "1"):
        (ck.commits / name).unlink()
        (ck.offsets / name).unlink()
    assert "no batch has been committed yet" in refused(path, 4, capsys)
    with pytest.raises(RescaleRefused, match="no batch has been committed yet"):
        rescale(config.load(path), 4)
    with pytest.raises(ConfigError, match="no state: section"):
        rescale(config.load(write_config(tmp_path / "none", state=None)), 4)
    with pytest.raises(SystemExit):
        cli.main(["rescale", "--config", str(path), "--partitions", "0"])
    assert "'0' is not a positive number" in capsys.readouterr().err


def test_the_same_number_again_finishes_the_records_and_changes_nothing(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A rescale that stopped after Spark committed its batch: run again, it records the number and
    the batch's dimension positions, and leaves Spark's logs alone."""
    ck = checkpoint(tmp_path)
    batch(ck, 2, 6)    # Spark's repartition batch, committed; the job's records not yet written
    ck.devices.write_text(json.dumps({"batch_id": 1, "buckets": {str(g): 10 for g in BucketLayout.even(8).ids}}))
    assert cli.main(["rescale", "--config", str(write_config(tmp_path)), "--partitions", "6"]) == 0
    out, err = capsys.readouterr()
    assert "the state is in 6 state partitions already (8 buckets" in out and "80 device(s)" in out
    # 8 buckets over 6: the warning says how uneven, and which numbers are even.
    spread = BucketLayout.even(8).spread(6)
    assert f"enrich: warning: 8 buckets fall {min(spread)} to {max(spread)} per state partition over 6" in err
    assert "(1, 2, 4, 8) spreads them evenly" in err
    assert json.loads(ck.state_record.read_text())[PARTITIONS] == 6
    assert json.loads((ck.dimensions / "2.json").read_text())["positions"] == {"devices": {"0": 1}}
    assert ck.planned() == ck.committed() == [0, 1, 2]
    assert Checkpoint(ck.root).batch().positions == {"devices": {0: 1}}    # enrich status reads it


# ------------------------------------------------------------------------------- the job, rescaled


def transient(record: logging.LogRecord) -> bool:
    """A transient failure the job retried (a Python worker that did not start on a loaded machine):
    not what the test is about."""
    return "which is transient" in record.getMessage()


@pytest.mark.integration
def test_a_job_rescaled_from_2_to_4_to_1_state_partitions_continues_every_device(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Every device keeps its state (its k-th event has ``events == k``), every event is written
    once, the partitioned dimension's rows and the timers move with their buckets, and the
    checkpoint's record and Spark's offset log show the new number."""
    data = make_config(kafka, unique, tmp_path, buckets=8)
    data["spark"] = {"spark.sql.shuffle.partitions": "2"}   # as the shared session runs it
    data["max_events_per_batch"] = 10
    data["joins"][0]["strategy"] = "partitioned"
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    devices_topic, events = data["joins"][0]["topic"], data["events"]["topic"]
    publish(kafka, devices_topic, changelog(DEVICES, [{"device_id": "d1", "owner": "ann"}]))
    ck = CheckpointLayout(Path(data["checkpoint"]))
    layout = BucketLayout.even(8)

    def round_of(r: int) -> None:
        # Ten devices, three events each per round, in order: event n is device n % 10's (n // 10 + 1)-th.
        produce_events(kafka, events, [{"device_id": f"d{n % 10}", "ts": at(n / 60), "temp": 1.0, "n": n}
                                       for n in range(30 * r, 30 * (r + 1))])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="enrich.state.stream"):
            run(spark, data)

    def rescaled_to(n: int) -> None:
        last = ck.committed()[-1]
        assert cli.main(["rescale", "--config", str(path), "--partitions", str(n)]) == 0
        out = capsys.readouterr().out
        assert f"rescaled from {2 if n == 4 else 4} to {n} state partitions in" in out, out
        assert f"(batch {last + 1}, which reads no input; 8 buckets, {8 // n} bucket(s) in each; 10 device(s)" in out
        assert ck.planned() == ck.committed() and ck.committed()[-1] == last + 1
        assert ck.recorded_partitions(last + 1) == n and json.loads(ck.state_record.read_text())[PARTITIONS] == n
        # enrich status reads the new batch: the offsets and positions of the one it copies.
        info = Checkpoint(ck.root).batch()
        assert info.batch_id == last + 1 and info.events_end == Checkpoint(ck.root).batch(last).events_end
        # Each bucket's device table, its dimension rows and its timer are in the partition the layout says.
        for name, option in [("devices", "stateVarName"), ("dim0", "stateVarName"), (None, "readRegisteredTimers")]:
            reader = spark.read.format("statestore").option("path", str(ck.spark.resolve()))
            reader = reader.option(option, name if name else "true")
            rows = reader.load().select("partition_id", "key._bucket").collect()
            assert rows and all(r["partition_id"] == layout.ids.index(r["_bucket"]) % n for r in rows), (name, rows)

    round_of(0)
    assert ck.recorded_partitions(ck.committed()[-1]) == 2 and json.loads(ck.state_record.read_text())[PARTITIONS] == 2
    assert not [r for r in caplog.records if r.name.startswith("enrich") and not transient(r)]
    rescaled_to(4)
    publish(kafka, devices_topic, changelog(DEVICES, [{"device_id": "d2", "owner": "bo"}], version=2,
                                            with_schema=False))
    round_of(1)
    # The config's spark.sql.shuffle.partitions (2) is ignored, with one warning: the checkpoint's 4 count.
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("enrich") and not transient(r)]
    assert len(warned) == 1 and "spark.sql.shuffle.partitions is 2, ignored" in warned[0], warned
    assert "keeps its state in 4 state partitions" in warned[0]
    assert ck.recorded_partitions(ck.committed()[-1]) == 4
    rescaled_to(1)
    round_of(2)
    assert ck.recorded_partitions(ck.committed()[-1]) == 1

    out = outputs(kafka, data["output"]["kafka"]["topic"])      # fails on an event written twice
    assert sorted(out) == list(range(90))
    wrong = [(n, r["state"]["events"]) for n, r in out.items() if r["state"]["events"] != n // 10 + 1]
    assert not wrong, wrong
    assert all(r["_late"] is False for r in out.values())
    # The partitioned dimension's rows moved with their buckets: d1's from the first run, d2's from the second.
    assert {out[n]["owner"] for n in range(90) if n % 10 == 1} == {"ann"}
    assert [out[n]["owner"] for n in (2, 32, 62)] == [None, "bo", "bo"]
    assert sum(json.loads(ck.devices.read_text())["buckets"].values()) == 10

    # A rescale that stopped half way (its batch planned with another number, not committed): the
    # job does not start on it.
    last = ck.committed()[-1]
    entry = (ck.offsets / str(last)).read_text().replace('"spark.sql.shuffle.partitions":"1"',
                                                           '"spark.sql.shuffle.partitions":"2"')
    assert '"spark.sql.shuffle.partitions":"2"' in entry
    (ck.offsets / str(last + 1)).write_text(entry)
    with pytest.raises(ConfigError, match="a rescale to 2 state partitions did not finish; run enrich rescale "
                                          "--partitions 2 again before the job"):
        run(spark, data)

"""What a checkpoint records at its first start (enrich.origin), through the job: where its events
start, kept for a restart in batch 0; a fork's savepoint and watermark floor."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession

from enrich import config
from enrich.checkpoint import CheckpointLayout
from enrich.job import EnrichJob
from enrich.ops import savepoint as sp
from refstream import kafka as rkafka
from refstream.errors import DataError, TerminalError
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.enrich.kill import read_note
from tests.enrich.ops.test_savepoint import fork, fork_config
from tests.enrich.process import SCHEMA, start_job, wait_until, write_config
from tests.enrich.state.test_stream import at, make_config, outputs, run
from tests.timing import bound


def events(first: int, n: int) -> list[dict[str, object]]:
    return [{"device_id": f"d{i % 12}", "n": i} for i in range(first, first + n)]


@pytest.mark.integration  # starts `python -m enrich run` (Spark) itself
def test_a_job_killed_in_its_first_batch_starts_again_where_its_first_start_began(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """events.starting_offsets: latest. The job waits in the dimensions' bootstrap (no schema record
    yet) while events arrive, so its first batch holds them; the whole job is killed inside that
    batch (one slot committed, the other open), more events arrive, and the restart writes every
    event produced after the first start once: none of those produced before it."""
    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique, bootstrap_timeout="600s",
                       events={"topic": unique("events"), "schema": "device_id STRING, n INT",
                               "starting_offsets": "latest"})
    topic, out = cfg["events"]["topic"], cfg["output"]["kafka"]["topic"]
    produce_events(kafka, topic, events(-100, 100), partitions=2)  # before the start: never read
    flag, log = tmp_path / "killed", tmp_path / "job.log"
    proc = start_job(config, log, kill=f"job:0:*:{flag}")
    try:
        # The output topics are created right before the bootstrap, which waits for the schema record.
        wait_until("the job's output topics", lambda: bool(rkafka.partitions_of(kafka, cfg["dead_letter_topic"])),
                   120, log)
        produce_events(kafka, topic, events(0, 600), partitions=2)
        publish(kafka, cfg["joins"][0]["topic"], changelog(SCHEMA, [{"device_id": f"d{i}", "owner": f"o{i}"}
                                                                    for i in range(10)]))
        layout = CheckpointLayout(Path(cfg["checkpoint"]))
        wait_until("the kill in batch 0, or batch 0's commit",
                   lambda: proc.poll() is not None or layout.committed_any(), 300, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(bound(30))
    assert flag.exists(), "batch 0 held none of the events produced after the job started"
    note = read_note(flag)
    assert note is not None and note["batch"] == 0 and note["other"] is not None, note
    assert not layout.committed_any()

    produce_events(kafka, topic, events(600, 400), partitions=2)
    again = start_job(config, log, "--available-now")
    assert again.wait(bound(300)) == 0, log.read_text()[-3000:]
    got = Counter(json.loads(m.value())["n"] for m in read_all(kafka, out))
    assert set(got) == set(range(1000)), (f"lost: {sorted(set(range(1000)) - set(got))[:20]}, "
                                          f"read before the start: {sorted(set(got) - set(range(1000)))[:20]}")
    assert [n for n, c in got.items() if c > 1] == [], "duplicates after the restart"


@pytest.mark.integration
def test_a_fork_failed_in_its_first_batch_starts_again_and_keeps_its_watermark_floor(
        spark: SparkSession, kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A savepoint whose watermark is minute 28; a fork whose first batch fails once planned (as a
    kill would leave it: offsets/0 without commits/0) is started again with the same --from-savepoint
    (failing once more), then without it, then once more over more events. Its own watermark stays below the savepoint's
    (its events end at minute 28.5), so only the floor makes an event at minute 27.8 late: every
    event is written as the original job writes it."""
    data = make_config(kafka, unique, tmp_path, buckets=4)
    data["joins"] = []
    events = data["events"]["topic"]
    # Ten devices, three events each, one a minute: the watermark (1m) ends at minute 28.
    produce_events(kafka, events, [{"device_id": f"d{n % 10}", "ts": at(n), "temp": float(n), "n": n}
                                   for n in range(30)])
    run(spark, data)
    point = tmp_path / "savepoint"
    sp.take(config.parse(data, "test.yaml"), point, spark=spark)
    produce_events(kafka, events, [{"device_id": "d3", "ts": at(10), "temp": 99.0, "n": 100},
                                   {"device_id": "d4", "ts": at(28.5), "temp": 1.0, "n": 101}])

    forked = fork_config(data, unique, tmp_path, "fork")
    ck = CheckpointLayout(Path(forked["checkpoint"]))
    real = EnrichJob._process_batch

    def fails(self: EnrichJob, batch_df: DataFrame, batch_id: int) -> Any:
        raise DataError("killed in the fork's first batch")

    monkeypatch.setattr(EnrichJob, "_process_batch", fails)
    for _ in range(2):  # the restart with the same savepoint is taken, and fails in batch 0 again
        with pytest.raises(TerminalError, match="killed in the fork's first batch"):
            fork(spark, forked, point)
        assert ck.planned() == [0] and not ck.committed()
    monkeypatch.setattr(EnrichJob, "_process_batch", real)
    run(spark, forked)  # without --from-savepoint: batch 0 runs again with the recorded savepoint's state
    assert ck.committed()
    produce_events(kafka, events, [{"device_id": "d5", "ts": at(27.8), "temp": 2.0, "n": 102}])
    run(spark, forked)  # a later start

    run(spark, data)
    original = outputs(kafka, data["output"]["kafka"]["topic"], 33)
    got = outputs(kafka, forked["output"]["kafka"]["topic"], 3)
    assert sorted(got) == [100, 101, 102]
    assert original[102]["_late"] is True and original[101]["_late"] is False
    differ = [n for n in got if got[n] != original[n]]
    assert not differ, [(original[n], got[n]) for n in differ]

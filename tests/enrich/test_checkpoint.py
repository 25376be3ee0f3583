"""The checkpoint's lock (enrich.checkpoint): one job at a time on a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from enrich.checkpoint import STALE_S, CheckpointBusy, CheckpointLayout
from refstream.errors import DataError
from tests.enrich.process import committed_count, seed, start_job, write_config
from tests.timing import bound


@pytest.mark.integration  # starts `python -m enrich run` (Spark) itself, twice
def test_a_second_job_on_a_running_jobs_checkpoint_exits_2_naming_its_host_and_process(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique)
    seed(kafka, cfg, 200)
    out = cfg["output"]["kafka"]["topic"]
    log, second_log = tmp_path / "job.log", tmp_path / "second.log"
    first = start_job(config, log)
    try:
        deadline = time.monotonic() + bound(240)
        while committed_count(kafka, out) < 200:
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the first job wrote nothing: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        second = start_job(config, second_log)
        try:
            rc = second.wait(bound(60))
        except Exception:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(bound(30))
            raise AssertionError(f"the second job ran beside the first: {second_log.read_text()[-3000:]}") from None
        errors = [line for line in second_log.read_text().splitlines() if line.startswith("enrich: error: ")]
        assert rc == 2 and len(errors) == 1, second_log.read_text()[-3000:]
        assert cfg["checkpoint"] in errors[0] and f"on {socket.gethostname()}, process {first.pid}" in errors[0], errors
        assert first.poll() is None, "the running job goes on"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(bound(30))


def test_a_holder_on_another_machine_is_known_by_its_heartbeat(tmp_path: Path) -> None:
    """Storage whose flock does not reach other machines: the lock file says who holds it, and its
    modification time is the holder's heartbeat."""
    ck = CheckpointLayout(tmp_path / "checkpoint")
    ck.own.mkdir(parents=True)
    ck.lock.write_text(json.dumps({"holder": "job", "host": "elsewhere", "pid": 4321}))
    with pytest.raises(CheckpointBusy, match="the job is running on this checkpoint .on elsewhere, process 4321"), \
            ck.held():
        pass
    gone = time.time() - STALE_S - 1
    os.utime(ck.lock, (gone, gone))  # its heartbeat stopped: the holder is gone
    with ck.held():
        kept = json.loads(ck.lock.read_text())
        assert (kept["host"], kept["pid"], kept["holder"]) == (socket.gethostname(), os.getpid(), "job")
        with pytest.raises(CheckpointBusy, match=f"on {socket.gethostname()}, process {os.getpid()}"), ck.held():
            pass


def test_spark_offset_and_commit_logs_are_read_in_one_place(tmp_path: Path) -> None:
    """CheckpointLayout reads Spark's logs: an offset entry's metadata and sources ('-': none), a
    commit's metadata; a missing entry is None (or an error when asked for), an unreadable one an
    error naming the file."""
    ck = CheckpointLayout(tmp_path)
    ck.offsets.mkdir(parents=True)
    ck.commits.mkdir(parents=True)
    meta = {"batchWatermarkMs": 5000, "batchTimestampMs": 7, "conf": {"spark.sql.shuffle.partitions": "4"}}
    (ck.offsets / "3").write_text("v1\n" + json.dumps(meta) + '\n{"t": {"0": 10}}\n-\n{"u": {"1": 2}}\n')
    (ck.commits / "3").write_text('v1\n{"nextBatchWatermarkMs": 6000}\n')
    (ck.offsets / "4").write_text("v1\nnot json\n")
    entry = ck.offset_entry(3)
    assert entry is not None and entry.meta == meta and entry.sources == ({"t": {"0": 10}}, {"u": {"1": 2}})
    assert (ck.recorded_partitions(3), ck.batch_watermark_ms(3)) == (4, 5000)
    assert ck.commit_entry(3) == {"nextBatchWatermarkMs": 6000}
    assert ck.offset_entry(9) is None and ck.recorded_partitions(9) is None
    assert (ck.planned(), ck.committed()) == ([3, 4], [3])
    with pytest.raises(DataError, match=r"offsets/9: unreadable offset log entry"):
        ck.offset_entry(9, missing_ok=False)
    with pytest.raises(DataError, match=r"offsets/4: unreadable offset log entry"):
        ck.offset_entry(4)
    with pytest.raises(DataError, match=r"commits/4: unreadable commit log entry"):
        ck.commit_entry(4)

"""The driver's count of devices in state: its record in the checkpoint, and a checkpoint without one."""

from __future__ import annotations

import json
from pathlib import Path

from pyspark.sql import SparkSession

from enrich.checkpoint import CheckpointLayout
from enrich.state.devices import DeviceCount


def test_counts_merge_per_bucket_and_a_restart_resumes_from_the_record(spark: SparkSession, tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    count = DeviceCount(spark.sparkContext, ck)
    assert count.total == 0                      # a new checkpoint: no state yet
    count.before_batch()
    count.accumulator.add({0: 3, 1: 2})
    count.accumulator.add({1: 2})                # the same bucket again (a retried attempt): no change
    assert count.after_batch(0) == 5
    count.before_batch()
    count.accumulator.add({1: 0, 2: 4})          # bucket 1 emptied (TTL), bucket 0 not called
    assert count.after_batch(1) == 7
    assert json.loads(ck.devices.read_text()) == {"batch_id": 1, "buckets": {"0": 3, "1": 0, "2": 4}}
    assert DeviceCount(spark.sparkContext, ck).total == 7


def test_a_checkpoint_with_batches_but_no_record_has_no_count(spark: SparkSession, tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    ck.commits.mkdir(parents=True)
    (ck.commits / "0").write_text("v1\n")
    count = DeviceCount(spark.sparkContext, ck)
    count.before_batch()
    count.accumulator.add({0: 3})
    assert count.total is None and count.after_batch(1) is None
    assert not ck.devices.exists()

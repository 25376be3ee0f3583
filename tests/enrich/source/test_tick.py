"""The tick source (enrich.source.tick): new data at every trigger, one tick per bucket; under
Trigger.AvailableNow one tick batch at most, up to the run's start."""

from __future__ import annotations

import time

import pandas as pd
from pyspark.sql.streaming.datasource import ReadAllAvailable

from enrich import packed
from enrich.ipc import from_ipc
from enrich.source.tick import TICK, TickStreamReader


def test_every_trigger_has_new_ticks_for_every_bucket() -> None:
    reader = TickStreamReader([7, 3])
    start = reader.initialOffset()
    first = reader.latestOffset(start, ReadAllAvailable())
    second = reader.latestOffset(first, ReadAllAvailable())  # at once: still later (strictly increasing)
    assert start["ms"] < first["ms"] < second["ms"]
    rows = list(reader.read(reader.partitions(start, first)[0]))
    assert [b for b, _ in rows] == [7, 3]
    kinds = packed.unpack_kinds([pd.DataFrame({"_0": [7], "rows": [rows[0][1]]})])
    assert list(kinds) == [TICK] and kinds[TICK].num_rows == 0
    assert from_ipc(rows[0][1]).num_rows == 0


def test_available_now_stops_at_the_runs_start() -> None:
    reader = TickStreamReader([1])
    old = {"ms": int(time.time() * 1000) - 60_000}  # the last committed batch, a minute ago
    reader.prepareForTriggerAvailableNow()
    end = reader.latestOffset(old, ReadAllAvailable())
    assert end["ms"] > old["ms"]
    time.sleep(0.01)
    assert reader.latestOffset(end, ReadAllAvailable()) == end  # no more

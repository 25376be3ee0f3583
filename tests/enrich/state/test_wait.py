"""Holding and releasing events for completeness (enrich.state.wait): pure logic."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa

from enrich.state import wait
from enrich.state.wait import BatchFacts, WaitSpec

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MIN = 60_000  # ms


def us(minutes: float) -> int:
    return int((T0 + timedelta(minutes=minutes)).timestamp() * 1_000_000)


def events(*minutes: float) -> pa.Table:
    return pa.table({"_offset": pa.array(range(len(minutes)), pa.int64()),
                     "_ts_us": pa.array([us(m) for m in minutes], pa.int64())})


SPEC = WaitSpec.of({"a": timedelta(minutes=15)})


def facts(now_min: float, **complete: float | None) -> BatchFacts:
    return BatchFacts(int(T0.timestamp() * 1000 + now_min * MIN),
                      {ds: None if m is None else us(m) for ds, m in complete.items()})


def test_an_event_after_the_completeness_is_held_and_released_final_once_it_passes() -> None:
    f1 = facts(10, a=5)
    first = wait.split(SPEC, f1, wait.admit(events(4, 5, 6), f1), "_ts_us")
    assert first.released.column("_offset").to_pylist() == [0, 1]  # at or before the completeness: at once
    assert first.provisional.tolist() == [False, False]
    assert first.held.column("_offset").to_pylist() == [2]
    assert first.held.column(wait.READ_MS).to_pylist() == [f1.time_ms]
    f2 = facts(11, a=6)
    second = wait.split(SPEC, f2, pa.concat_tables([first.held, wait.admit(events(7), f2)]), "_ts_us")
    assert second.released.column("_ts_us").to_pylist() == [us(6)]
    assert second.provisional.tolist() == [False]
    assert second.held.column("_ts_us").to_pylist() == [us(7)]


def test_max_wait_counts_from_the_first_read_and_releases_provisional() -> None:
    f1 = facts(0, a=None)  # no completeness known yet: everything waits
    held = wait.split(SPEC, f1, wait.admit(events(1, 2), f1), "_ts_us").held
    assert held.num_rows == 2
    assert wait.split(SPEC, facts(14.99, a=None), held, "_ts_us").released.num_rows == 0
    # Downtime counts: the next batch an hour later releases them, not yet complete: provisional.
    late = wait.split(SPEC, facts(60, a=1.5), held, "_ts_us")
    assert late.released.column("_ts_us").to_pylist() == [us(1), us(2)]
    assert late.provisional.tolist() == [False, True]  # completeness wins where it holds
    assert late.held.num_rows == 0


def test_every_waited_for_dataset_must_be_complete_or_expired() -> None:
    spec = WaitSpec.of({"a": timedelta(minutes=15), "b": timedelta(minutes=5)})
    f = facts(0)
    pool = wait.admit(events(10), f)
    assert wait.split(spec, facts(1, a=20, b=None), pool, "_ts_us").released.num_rows == 0
    s = wait.split(spec, facts(5, a=20, b=None), pool, "_ts_us")  # b expired, a complete
    assert s.released.num_rows == 1 and s.provisional.tolist() == [True]
    s = wait.split(spec, facts(1, a=20, b=10), pool, "_ts_us")
    assert s.released.num_rows == 1 and s.provisional.tolist() == [False]


def test_a_replayed_batch_decides_the_same() -> None:
    f = facts(3, a=2)
    pool = wait.admit(events(1, 2, 3, 4), f)
    a, b = wait.split(SPEC, f, pool, "_ts_us"), wait.split(SPEC, BatchFacts.from_json(f.to_json()), pool, "_ts_us")
    assert a.released.equals(b.released) and a.held.equals(b.held)
    assert np.array_equal(a.provisional, b.provisional)


def test_batch_facts_from_the_recorded_texts() -> None:
    f = BatchFacts.of(123, {"a": "2026-01-01T00:05:00.000001Z", "b": None})
    assert f.complete_us == {"a": us(5) + 1, "b": None}
    assert BatchFacts.from_json(f.to_json()) == f


def test_incomplete_is_past_some_datasets_completeness_or_before_any_is_known() -> None:
    """What a correction of a released event says of ``_provisional``: as the batch decides it now."""
    spec = WaitSpec.of({"a": timedelta(minutes=15), "b": timedelta(minutes=5)})
    ts = np.array([10, 20, 30], dtype=np.int64)
    assert wait.incomplete(spec, BatchFacts(0, {"a": 25, "b": 15}), ts).tolist() == [False, True, True]
    assert wait.incomplete(spec, BatchFacts(0, {"a": 30, "b": 30}), ts).tolist() == [False, False, False]
    assert wait.incomplete(spec, BatchFacts(0, {"a": 30, "b": None}), ts).tolist() == [True, True, True]

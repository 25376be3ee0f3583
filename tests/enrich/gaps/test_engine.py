"""The gap engine (enrich.gaps.engine): pure, one bucket and batch at a time."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from enrich.gaps.engine import EVERY, KEY, PARTITION, TS, GapSpec, advance, gap_id, partition_times

S = 1_000_000  # a second in microseconds
SPEC = GapSpec(key="device_id", key_type=pa.string(), after=3.0, refs=(("site", pa.string()),),
               ttl_us=3600 * S, topic="events")


def events(*rows: tuple[str, int, int, int | None, str | None]) -> pa.Table:
    """(device, time in s, partition, interval in s, site) per event."""
    return pa.table({KEY: pa.array([r[0] for r in rows], pa.string()),
                     TS: pa.array([r[1] * S for r in rows], pa.int64()),
                     PARTITION: pa.array([r[2] for r in rows], pa.int32()),
                     EVERY: pa.array([r[3] * S if r[3] is not None else None for r in rows], pa.int64()),
                     "site": pa.array([r[4] for r in rows], pa.string())})


class Run:
    """A bucket across batches: each ``batch`` applies events against the partitions' times."""

    def __init__(self, spec: GapSpec = SPEC) -> None:
        self.spec, self.table, self.closed = spec, None, None
        self.times: dict[int, int] = {}

    def batch(self, *rows: Any, times: dict[int, int] | None = None, watermark: int | None = None) -> list[dict[str, Any]]:
        """``times``: what the other buckets' events brought the partitions to (the driver carries
        each batch's times to the next, as here)."""
        for p, t in (times or {}).items():
            self.times[p] = max(self.times.get(p, t * S), t * S)
        batch = events(*rows) if rows else events()
        got = advance(self.spec, self.table, self.closed, batch, dict(self.times),
                      watermark * S if watermark is not None else None)
        self.times = partition_times(self.times, batch)
        self.table, self.closed, self.no_interval = got.table, got.closed, got.no_interval
        return got.records.to_pylist()


def kinds(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(r["kind"], r["device_id"]) for r in records]


def test_a_silent_device_opens_a_gap_when_its_partition_passes_the_threshold() -> None:
    run = Run()
    assert run.batch(("d1", 100, 0, 30, "s-2"), ("d2", 100, 0, 30, "s-2")) == []
    # d2 goes on reporting; the partition is at 189: d1's threshold is 100 + 3 x 30 = 190
    assert run.batch(("d2", 189, 0, 30, "s-2")) == []
    got = run.batch(("d2", 190, 0, 30, "s-2"))
    assert kinds(got) == [("opened", "d1")]
    r = got[0]
    assert r["gap_id"] == gap_id("d1", 100 * S)
    assert (r["last_seen"].timestamp(), r["opened_at"].timestamp()) == (100, 190)
    assert (r["expected_every_s"], r["site"], r["partition"], r["topic"]) == (30.0, "s-2", 0, "events")
    assert run.batch(("d2", 250, 0, 30, "s-2")) == []  # opened once


def test_a_quiet_partition_opens_no_gap_and_another_partitions_time_does_not_count() -> None:
    run = Run()
    run.batch(("d1", 100, 0, 30, None))
    assert run.batch(times={1: 10_000}) == []           # partition 1 far ahead: not d1's
    assert run.batch(("d9", 10_000, 1, 30, None)) == []
    assert kinds(run.batch(times={0: 190})) == [("opened", "d1")]  # recorded by the driver for partition 0


def test_a_device_that_reports_again_closes_its_gap() -> None:
    run = Run()
    run.batch(("d1", 100, 0, 30, "s-2"))
    [opened] = run.batch(times={0: 200})
    [closed] = run.batch(("d1", 250, 0, 30, "s-2"))
    assert (closed["kind"], closed["gap_id"]) == ("closed", opened["gap_id"])
    assert (closed["start"].timestamp(), closed["end"].timestamp(), closed["duration_s"]) == (100, 250, 150.0)


def test_events_that_fill_the_gap_retract_it_completely_or_partly() -> None:
    run = Run()
    run.batch(("d1", 100, 0, 30, None))
    [opened] = run.batch(times={0: 200})
    # late readings of d1 at 120 and 150: not silent from 100; 150 + 90 = 240 > 200: no gap now
    got = run.batch(("d1", 120, 0, 30, None), ("d1", 150, 0, 30, None))
    assert [(r["kind"], r["gap_id"]) for r in got] == [("retracted", opened["gap_id"])]
    partly = Run()
    partly.batch(("d1", 100, 0, 30, None))
    [first] = partly.batch(times={0: 400})
    got = partly.batch(("d1", 130, 0, 30, None))  # 130 + 90 = 220 <= 400: silent from 130 still
    assert [r["kind"] for r in got] == ["retracted", "opened"]
    assert got[0]["gap_id"] == first["gap_id"] and got[1]["gap_id"] == gap_id("d1", 130 * S)
    assert got[1]["opened_at"].timestamp() == 220


def test_a_silence_inside_a_backlog_is_a_gap_opened_and_closed_and_regular_reports_none() -> None:
    run = Run()
    got = run.batch(*[("d1", t, 0, 30, None) for t in range(0, 600, 30)], ("d2", 0, 0, 30, None),
                    ("d2", 500, 0, 30, None), times={0: 0})
    assert kinds(got) == [("opened", "d2"), ("closed", "d2")]
    assert got[0]["gap_id"] == got[1]["gap_id"] and got[1]["duration_s"] == 500.0


def test_an_event_inside_a_closed_gap_splits_it() -> None:
    run = Run()
    run.batch(("d1", 0, 0, 10, None), ("d1", 100, 0, 10, None))  # gap 0..100 (threshold 30)
    got = run.batch(("d1", 20, 0, 10, None))                      # 0..20 no longer, 20..100 still
    assert [r["kind"] for r in got] == ["retracted", "opened", "closed"]
    assert got[0]["gap_id"] == gap_id("d1", 0)
    assert (got[2]["start"].timestamp(), got[2]["end"].timestamp()) == (20, 100)
    got = run.batch(("d1", 60, 0, 10, None))  # splits 20..100 into two gaps of 40 each
    assert [r["kind"] for r in got] == ["retracted", "opened", "closed", "opened", "closed"]


def test_a_device_without_an_interval_gets_no_gap_and_is_counted() -> None:
    run = Run()
    run.batch(("d1", 100, 0, None, None), ("d2", 100, 0, 30, None))
    assert run.no_interval == 1
    assert kinds(run.batch(times={0: 10_000})) == [("opened", "d2")]


def test_a_changed_interval_applies_from_the_event_that_carries_it() -> None:
    run = Run()
    run.batch(("d1", 100, 0, 30, None), ("d1", 110, 0, 100, None))  # now 100 s: threshold 110 + 300
    assert run.batch(times={0: 409}) == []
    assert kinds(run.batch(times={0: 410})) == [("opened", "d1")]


def test_devices_go_with_the_state_ttl_and_the_same_input_gives_the_same_records() -> None:
    run = Run()
    run.batch(("d1", 100, 0, 30, None), ("d2", 4000, 0, 30, None), times={0: 4000}, watermark=3700)
    assert run.table is not None and run.table.column(KEY).to_pylist() == ["d2"]
    a, b = Run(), Run()
    rows = [("d1", 100, 0, 30, "x"), ("d1", 500, 0, 30, "x"), ("d2", 10, 1, 5, "y")]
    assert a.batch(*rows, times={1: 900}) == b.batch(*rows, times={1: 900})


@pytest.mark.parametrize("every", [pa.array([30, None], pa.int32()), pa.array([30.0, None]),
                                   pa.array([30_000_000, None], pa.duration("us"))])
def test_an_interval_column_is_seconds_or_a_duration(every: pa.Array) -> None:
    from enrich.gaps.engine import every_us

    assert every_us(every).to_pylist() == [30 * S, None]


def test_an_interval_that_is_not_a_positive_number_of_at_most_31_years_is_none() -> None:
    from enrich.gaps.engine import every_us

    bad = pa.array([0.0, -5.0, float("nan"), float("inf"), 1e300, 2e9, 1e9, 0.5])
    assert every_us(bad).to_pylist() == [None, None, None, None, None, None, 10**15, 500_000]
    assert every_us(pa.array([-30_000_000, 0], pa.duration("us"))).to_pylist() == [None, None]
    run = Run()  # a device whose interval is none gets no gap, counted; nothing fails
    got = advance(SPEC, None, None, events(("d1", 100, 0, None, None)).set_column(
        3, EVERY, every_us(pa.array([1e300]))), {0: 10**12}, None)
    assert (got.records.num_rows, got.no_interval) == (0, 1)
    assert run.batch() == []


def test_a_device_whose_clock_runs_ahead_moves_its_partition_no_further_than_the_batchs_time() -> None:
    run = Run()
    run.batch(("d1", 100, 0, 30, None), ("d2", 100, 0, 30, None))
    # d2's clock jumps 50 minutes ahead (a silence of its own, by its clock): with the cap at the
    # batch's time (110) d1 is not silent; uncapped it would be.
    got = advance(SPEC, run.table, run.closed, events(("d2", 3100, 0, 30, None)), {0: 100 * S}, None, 110 * S)
    assert [r["kind"] for r in got.records.to_pylist() if r["device_id"] == "d1"] == []
    got = advance(SPEC, run.table, run.closed, events(("d2", 3100, 0, 30, None)), {0: 100 * S}, None)
    assert [r["kind"] for r in got.records.to_pylist() if r["device_id"] == "d1"] == ["opened"]


def test_a_stored_table_of_another_plan_is_conformed_and_an_interval_under_a_microsecond_is_none() -> None:
    from enrich.gaps.engine import every_us

    run = Run()
    run.batch(("d1", 100, 0, 30, "s-2"))
    assert run.table is not None
    # The joins before the step now add region and no longer site: the stored rows still load.
    wider = GapSpec(key="device_id", key_type=pa.string(), after=3.0, refs=(("region", pa.string()),),
                    ttl_us=3600 * S)
    got = advance(wider, run.table, run.closed, events().drop_columns(["site"]).append_column(
        "region", pa.array([], pa.string())), {0: 200 * S}, None)
    assert [(r["kind"], r["region"]) for r in got.records.to_pylist()] == [("opened", None)]
    assert every_us(pa.array([1e-7, 4e-7, 1e-6])).to_pylist() == [None, None, 1]


def test_an_event_at_the_devices_last_time_is_judged_alike_whatever_else_the_batch_holds() -> None:
    """An event at a device's last_seen neither moves it nor changes the interval the next event is
    judged by, whether the device goes the vectorised way or the per-device one."""
    for extra in ([], [("d1", 10, 0, 30, None)]):   # with a backward event: the per-device path
        run = Run()
        run.batch(("d1", 20, 0, 10, None))
        got = run.batch(("d1", 20, 0, 1000, None), ("d1", 55, 0, 1000, None), *extra)
        assert [r["kind"] for r in got] == ["opened", "closed"], extra  # 55 - 20 >= 3 x 10


def test_gap_ids_hash_a_canonical_key_not_its_repr() -> None:
    from datetime import UTC, datetime, timedelta, timezone
    from zoneinfo import ZoneInfo

    t = datetime(2026, 1, 1, 12, tzinfo=UTC)
    assert gap_id(t, 5) == gap_id(t.astimezone(ZoneInfo("Europe/Berlin")), 5) == \
        gap_id(t.astimezone(timezone(timedelta(hours=1))), 5)
    assert gap_id("1", 5) != gap_id(1, 5) != gap_id(b"1", 5)

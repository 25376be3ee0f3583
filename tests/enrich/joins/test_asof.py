"""The as-of lookup (enrich.joins.asof, enrich.joins's as-of path): pure logic on Arrow tables, no Spark."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest

from enrich.columns import DELETED, VALID_FROM
from enrich.joins import AsOfLookup, JoinSpec, join_table
from enrich.joins.asof import CLIPPED, VersionIndex, micros

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def us(hours: float) -> int:
    return int((T0 + timedelta(hours=hours)).timestamp() * 1_000_000)


def versions(rows: list[tuple[int, str | None, float]]) -> pa.Table:
    """(key, value or None for a tombstone, hours after T0), in changelog order."""
    return pa.table({"k": pa.array([k for k, _, _ in rows], pa.int64()),
                     "v": pa.array([v for _, v, _ in rows], pa.string()),
                     VALID_FROM: pa.array([us(h) for _, _, h in rows], pa.int64()),
                     DELETED: pa.array([v is None for _, v, _ in rows], pa.bool_())})


SPEC = JoinSpec(dataset="d", pairs=(("key", "k"),), key_types=(pa.int64(),), columns=(("v", "v"),),
                out_types=(pa.string(),), matched="_d_matched", inner=False, time="ts")


def events(rows: list[tuple[int | None, float | None]]) -> pa.Table:
    return pa.table({"key": pa.array([k for k, _ in rows], pa.int64()),
                     "ts": pa.array([None if h is None else T0 + timedelta(hours=h) for _, h in rows],
                                    pa.timestamp("us", tz="UTC"))})


def test_each_event_gets_the_version_valid_at_its_time() -> None:
    base = AsOfLookup(versions([(1, "a1", 0), (2, "b1", 0), (1, "a2", 10), (1, "a3", 20), (2, None, 5)]), ["k"])
    out = join_table(events([(1, 5), (1, 10), (1, 15), (1, 25), (2, 1), (2, 6), (3, 1), (None, 1), (1, None)]),
                     SPEC, base, None)
    assert out.column("v").to_pylist() == ["a1", "a2", "a2", "a3", "b1", None, None, None, None]
    assert out.column("_d_matched").to_pylist() == [True, True, True, True, True, False, False, False, False]
    assert out.column(CLIPPED).to_pylist() == [False] * 9


def test_an_event_older_than_every_version_gets_the_oldest_clipped() -> None:
    base = AsOfLookup(versions([(1, "a1", 10), (1, "a2", 20), (2, None, 10), (2, "b2", 20)]), ["k"])
    out = join_table(events([(1, 5), (1, 15), (2, 5), (3, 5)]), SPEC, base, None)
    assert out.column("v").to_pylist() == ["a1", "a1", None, None]
    assert out.column(CLIPPED).to_pylist() == [True, False, True, False]
    assert out.column("_d_matched").to_pylist() == [True, True, False, False]  # the oldest is a tombstone


def test_equal_times_the_later_change_wins_and_the_overlay_is_later_than_the_base() -> None:
    base = AsOfLookup(versions([(1, "a1", 0), (1, "a1b", 0), (2, "b1", 0), (2, "b2", 10)]), ["k"])
    overlay = AsOfLookup(versions([(1, "a2", 0), (2, "b3", 5), (3, "c1", 7), (2, None, 12)]), ["k"])
    out = join_table(events([(1, 1), (2, 1), (2, 6), (2, 11), (2, 13), (3, 1), (3, 8)]), SPEC, base, overlay)
    assert out.column("v").to_pylist() == ["a2", "b1", "b3", "b2", None, "c1", "c1"]
    assert out.column("_d_matched").to_pylist() == [True, True, True, True, False, True, True]
    assert out.column(CLIPPED).to_pylist() == [False, False, False, False, False, True, False]


def test_clipping_with_an_overlay_takes_the_oldest_of_both() -> None:
    base = AsOfLookup(versions([(1, "a2", 10)]), ["k"])
    overlay = AsOfLookup(versions([(1, "a1", 5), (2, "b1", 3)]), ["k"])
    out = join_table(events([(1, 1), (2, 1), (1, 7)]), SPEC, base, overlay)
    assert out.column("v").to_pylist() == ["a1", "b1", "a1"]
    assert out.column(CLIPPED).to_pylist() == [True, True, False]


def test_a_second_as_of_join_keeps_an_earlier_clip() -> None:
    base = AsOfLookup(versions([(1, "a1", 10), (2, "b1", 0)]), ["k"])
    first = join_table(events([(1, 5), (2, 5)]), SPEC, base, None)
    other = JoinSpec(dataset="d", pairs=(("key", "k"),), key_types=(pa.int64(),), columns=(("v", "w"),),
                     out_types=(pa.string(),), matched="_e_matched", inner=False, time="ts")
    both = join_table(first, other, AsOfLookup(versions([(1, "x", 0), (2, "y", 9)]), ["k"]), None)
    assert both.column(CLIPPED).to_pylist() == [True, True]
    # where the first as-of join put it, as enrich.joins.resolve lays the columns out
    assert both.column_names == ["key", "ts", "v", "_d_matched", CLIPPED, "w", "_e_matched"]


@pytest.mark.parametrize("scan", [0, 1000], ids=["searchsorted", "scan"])
def test_the_index_matches_a_brute_force_lookup_on_random_versions(scan: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(VersionIndex, "SCAN", scan)
    rng = np.random.default_rng(7)
    keys = rng.integers(0, 50, 2000)
    times = rng.integers(0, 100, 2000) * 1000
    index = VersionIndex(keys, times)
    assert (index.composite is None) == bool(scan)
    probe_keys, probe_times = rng.integers(0, 60, 3000), rng.integers(-5, 110, 3000) * 1000
    found = index.find(probe_keys, np.zeros(3000, bool), probe_times, np.zeros(3000, bool))
    for i in range(3000):
        mine = [j for j in range(2000) if keys[j] == probe_keys[i]]
        valid = [j for j in mine if times[j] <= probe_times[i]]
        best = max(valid, key=lambda j: (times[j], j)) if valid else -1
        oldest = min(mine, key=lambda j: (times[j], j)) if mine else -1
        assert found.pos[i] == best, i
        assert found.first[i] == oldest, i


def test_micros_reads_any_timestamp_unit_as_utc_microseconds() -> None:
    arr = pa.array([T0, None], pa.timestamp("ms", tz="Europe/Oslo"))
    values, nulls = micros(arr)
    assert values[0] == us(0) and nulls.tolist() == [False, True]

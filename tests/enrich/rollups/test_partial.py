"""Events to a rollup's window tables, and window tables merged."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pyarrow as pa

from enrich.rollups import engine, partial, sketch
from enrich.rollups.spec import RollupSpec

W = 1_000  # a 1 ms window: small numbers in the cases below
SPEC = RollupSpec(
    name="r", by=("dev",), by_types=(pa.string(),), window_us=W, correct_for_us=10 * W,
    metrics=(("t", ("count", "min", "max", "mean", "sum", "last", "p50", "p95", "p99", "count_distinct"),
              pa.float64()),
             ("s", ("last", "count_distinct", "count"), pa.string())))


def events(rows: list[tuple[Any, ...]], first_offset: int = 0) -> pa.Table:
    """(dev, ts µs, t, s[, partition[, offset]]) rows; offsets count up unless given."""
    return pa.table({
        "dev": pa.array([r[0] for r in rows], pa.string()),
        "_ts_us": pa.array([r[1] for r in rows], pa.int64()),
        "_partition": pa.array([r[4] if len(r) > 4 else 0 for r in rows], pa.int32()),
        "_offset": pa.array([r[5] if len(r) > 5 else first_offset + i for i, r in enumerate(rows)], pa.int64()),
        "t": pa.array([r[2] for r in rows], pa.float64()),
        "s": pa.array([r[3] for r in rows], pa.string()),
    })


def metrics(windows: pa.Table, spec: RollupSpec = SPEC) -> list[dict[str, Any]]:
    """The windows' metrics as the engine writes them (provisional rows), without the row columns."""
    rows = engine.advance(spec, None, windows, None).rows
    return rows.drop_columns(["_kind", "_revision", "_finalized_by", "_cause"]).to_pylist()


def test_windows_are_aligned_to_the_epoch_negative_times_too() -> None:
    ts = [-W - 1, -W, -1, 0, W - 1, W, 5 * W + 3]
    out = partial.partials(SPEC, events([("a", t, 1.0, "x") for t in ts]))
    assert out.column("window_start").to_pylist() == [-2 * W, -W, 0, W, 5 * W]
    assert out.column("_events").to_pylist() == [1, 2, 2, 1, 1]
    # The same rule as beyond_horizon's.
    assert engine.beyond_horizon(SPEC, np.array([-1, 0]), 10 * W).tolist() == [True, False]


def test_one_row_per_key_and_window_a_null_key_a_group_of_its_own() -> None:
    out = partial.partials(SPEC, events([("b", 5, 1.0, "x"), (None, 6, 2.0, "y"), ("a", 7, 3.0, "z"),
                                         (None, W + 1, 4.0, "y"), ("b", 8, 5.0, "x"), (None, 9, 6.0, "y")]))
    assert list(zip(out.column("dev").to_pylist(), out.column("window_start").to_pylist(),
                    out.column("_events").to_pylist(), strict=True)) == [
        ("a", 0, 1), ("b", 0, 2), (None, 0, 2), (None, W, 1)]
    assert out.column("t.sum").to_pylist() == [3.0, 6.0, 8.0, 4.0]


def test_events_without_a_time_belong_to_no_window() -> None:
    table = events([("a", 1, 1.0, "x"), ("a", 2, 2.0, "y")])
    table = table.set_column(1, "_ts_us", pa.array([None, 2], pa.int64()))
    assert metrics(partial.partials(SPEC, table))[0]["_events"] == 1
    assert partial.partials(SPEC, events([])).num_rows == 0


def test_nulls_nan_and_infinities_are_ignored_by_every_metric() -> None:
    out = partial.partials(SPEC, events([
        ("a", 1, 2.0, None), ("a", 2, None, "x"), ("a", 3, math.nan, None), ("a", 4, math.inf, None),
        ("a", 5, -math.inf, None), ("a", 6, 4.0, None), ("a", 7, math.nan, None),
        ("b", 1, None, None), ("b", 2, math.nan, None)]))
    a, b = metrics(out)
    assert a | {"window_start": None, "window_end": None} == {
        "dev": "a", "window_start": None, "window_end": None, "t_count": 2, "t_min": 2.0, "t_max": 4.0,
        "t_mean": 3.0, "t_sum": 6.0, "t_last": 4.0, "t_p50": 2.0, "t_p95": 4.0, "t_p99": 4.0,
        "t_count_distinct": 2, "s_last": "x", "s_count_distinct": 1, "s_count": 1, "_events": 7}
    # A window of no values: null aggregates, zero counts.
    assert {k: v for k, v in b.items() if k.startswith(("t_", "s_"))} == {
        "t_count": 0, "t_min": None, "t_max": None, "t_mean": None, "t_sum": None, "t_last": None,
        "t_p50": None, "t_p95": None, "t_p99": None, "t_count_distinct": 0, "s_last": None,
        "s_count_distinct": 0, "s_count": 0}
    assert b["_events"] == 2
    assert out.column("t.kll").to_pylist()[1] is None and out.column("t.set").to_pylist()[1] == []


def test_last_is_the_latest_event_by_time_then_partition_then_offset_whatever_the_arrival_order() -> None:
    rows = [("a", 10, 1.0, "p0-o9", 0, 9), ("a", 10, 2.0, "p1-o3", 1, 3), ("a", 10, 3.0, "p1-o2", 1, 2),
            ("a", 9, 4.0, "early", 2, 50), ("a", 10, None, None, 1, 4),  # the latest event, but null
            ("a", 3, 5.0, "first", 0, 1)]
    expected = partial.partials(SPEC, events(rows))
    assert metrics(expected)[0]["t_last"] == 2.0 and metrics(expected)[0]["s_last"] == "p1-o3"
    assert expected.column("t.last_ts").to_pylist() == [10]
    assert expected.column("t.last_p").to_pylist() == [1] and expected.column("t.last_o").to_pylist() == [3]
    r = random.Random(7)
    for _ in range(8):
        shuffled = rows[:]
        r.shuffle(shuffled)
        assert partial.partials(SPEC, events(shuffled)).equals(expected)
        # Split into two batches merged either way round: the same last.
        cut = r.randrange(1, len(rows))
        one, two = partial.partials(SPEC, events(shuffled[:cut])), partial.partials(SPEC, events(shuffled[cut:]))
        for merged in (partial.merge(SPEC, one, two), partial.merge(SPEC, two, one)):
            assert merged.drop_columns(["t.kll"]).equals(expected.drop_columns(["t.kll"]))
            assert metrics(merged) == metrics(expected)


def test_merge_combines_windows_in_both_and_keeps_the_others_as_they_are() -> None:
    a = partial.partials(SPEC, events([("a", 1, 1.0, "x"), ("a", W + 1, 7.0, "y"), ("b", 1, 2.0, "x")]))
    b = partial.partials(SPEC, events([("a", 2, -3.0, "z"), ("c", 1, 5.0, "q"), ("a", 3, math.nan, "x")], 10))
    merged = partial.merge(SPEC, a, b)
    assert merged.schema == SPEC.window_schema()
    got = {(m["dev"], m["window_start"].timestamp() * 10**6): m for m in metrics(merged)}
    assert list(got) == [("a", 0), ("a", W), ("b", 0), ("c", 0)]
    assert {k: v for k, v in got[("a", 0)].items() if k.startswith(("t_", "s_", "_"))} == {
        "t_count": 2, "t_min": -3.0, "t_max": 1.0, "t_mean": -1.0, "t_sum": -2.0, "t_last": -3.0,
        "t_p50": -3.0, "t_p95": 1.0, "t_p99": 1.0, "t_count_distinct": 2, "s_last": "x",
        "s_count_distinct": 2, "s_count": 3, "_events": 3}
    # A window in one table only keeps its row, its sketch's bytes too.
    kll = dict(zip(zip(merged.column("dev").to_pylist(), merged.column("window_start").to_pylist(), strict=True),
                   merged.column("t.kll").to_pylist(), strict=True))
    assert kll[("a", W)] == a.column("t.kll")[1].as_py() and kll[("c", 0)] == b.column("t.kll")[1].as_py()
    assert partial.merge(SPEC, a, SPEC.empty_windows()).equals(a)


def test_count_distinct_is_exact_across_merges() -> None:
    r = random.Random(3)
    values = [r.choice([None, *map(str, range(500))]) for _ in range(3000)]
    batches = [partial.partials(SPEC, events([("a", i % W, None, v) for i, v in enumerate(values[j:j + 300], j)], j))
               for j in range(0, len(values), 300)]
    merged = batches[0]
    for b in batches[1:]:
        merged = partial.merge(SPEC, b, merged) if r.random() < 0.5 else partial.merge(SPEC, merged, b)
    assert metrics(merged)[0]["s_count_distinct"] == len({v for v in values if v is not None})
    assert merged.column("s.set").to_pylist()[0] == sorted({v for v in values if v is not None})
    assert metrics(merged)[0]["s_count"] == sum(v is not None for v in values)


def test_percentiles_are_exact_below_k_values() -> None:
    r = random.Random(11)
    for n in (1, 2, 19, 100, sketch.KLL_K - 1):
        values = [float(r.randint(-50, 50)) for _ in range(n)]
        half = n // 2
        one = partial.partials(SPEC, events([("a", i, v, None) for i, v in enumerate(values[:half])]))
        two = partial.partials(SPEC, events([("a", i, v, None) for i, v in enumerate(values[half:], half)], half))
        got = metrics(partial.merge(SPEC, one, two))[0]
        for m, q in (("t_p50", 0.5), ("t_p95", 0.95), ("t_p99", 0.99)):
            assert got[m] == np.quantile(values, q, method="inverted_cdf"), (n, m)


def test_percentiles_of_100k_values_are_within_the_stated_rank_error() -> None:
    rng = np.random.default_rng(5)
    values = rng.lognormal(size=100_000)
    batches = np.array_split(values, 8)
    parts = [partial.partials(SPEC, pa.table({
        "dev": pa.array(["a"] * len(b)), "_ts_us": pa.array(np.arange(len(b)) % W),
        "_partition": pa.array(np.full(len(b), i), pa.int32()), "_offset": pa.array(np.arange(len(b))),
        "t": pa.array(b), "s": pa.nulls(len(b), pa.string())})) for i, b in enumerate(batches)]
    merged = parts[0]
    for p in parts[1:]:
        merged = partial.merge(SPEC, merged, p)
    got = metrics(merged)[0]
    assert got["t_count"] == 100_000 and got["_events"] == 100_000
    ordered = np.sort(values)
    for m, q in (("t_p50", 0.5), ("t_p95", 0.95), ("t_p99", 0.99)):
        # The returned value's true rank (the fraction of values at or below it) is within the error.
        rank = np.searchsorted(ordered, got[m], side="right") / len(values)
        assert abs(rank - q) <= sketch.KLL_RANK_ERROR, (m, rank)


def test_integer_and_timestamp_columns_keep_their_types() -> None:
    ts_type = pa.timestamp("us", tz="UTC")
    spec = RollupSpec(name="r", by=(), by_types=(), window_us=W, correct_for_us=W,
                      metrics=(("i", ("min", "max", "sum", "last", "p50"), pa.int32()),
                               ("seen", ("last", "count_distinct"), ts_type)))
    table = pa.table({"_ts_us": pa.array([1, 2, 3], pa.int64()), "_partition": pa.array([0, 0, 0], pa.int32()),
                      "_offset": pa.array([1, 2, 3], pa.int64()), "i": pa.array([5, None, -2], pa.int64()),
                      "seen": pa.array([10, 20, 10], ts_type)})
    out = partial.partials(spec, table)
    assert out.schema.field("i.min").type == pa.int32() and out.schema.field("seen.set").type == pa.list_(ts_type)
    [row] = metrics(out, spec)
    assert (row["i_min"], row["i_max"], row["i_sum"], row["i_last"], row["i_p50"]) == (-2, 5, 3.0, -2, -2.0)
    assert row["seen_count_distinct"] == 2

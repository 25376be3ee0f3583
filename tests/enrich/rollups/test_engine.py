"""The rollup engine: kinds and revisions of the rows per window, finalizing, eviction, and a batch
recompute of random events split into random micro-batches."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from enrich.rollups import engine, partial
from enrich.rollups.spec import RollupSpec

W = 1_000
SPEC = RollupSpec(name="r", by=("dev",), by_types=(pa.string(),), window_us=W, correct_for_us=3 * W,
                  metrics=(("t", ("count", "mean", "last", "p95"), pa.float64()),
                           ("s", ("count_distinct",), pa.string())))


def events(rows: list[tuple[Any, ...]], spec: RollupSpec = SPEC) -> pa.Table:
    """(dev, ts µs, t[, s]) rows, on partition 0 with offsets counting up."""
    return pa.table({"dev": pa.array([r[0] for r in rows], pa.string()),
                     "_ts_us": pa.array([r[1] for r in rows], pa.int64()),
                     "_partition": pa.array([0] * len(rows), pa.int32()),
                     "_offset": pa.array(range(len(rows)), pa.int64()),
                     "t": pa.array([r[2] for r in rows], pa.float64()),
                     "s": pa.array([r[3] if len(r) > 3 else None for r in rows], pa.string())})


def as_dicts(rows: pa.Table) -> list[dict[str, Any]]:
    """Output rows with their window as int64 µs."""
    for name in ("window_start", "window_end"):
        rows = rows.set_column(rows.schema.get_field_index(name), name, rows.column(name).cast(pa.int64()))
    return rows.to_pylist()


class Bucket:
    """A bucket's state across calls, and the rows written."""

    def __init__(self, spec: RollupSpec = SPEC) -> None:
        self.spec, self.evicted = spec, 0
        self.state: pa.Table | None = None

    def advance(self, rows: list[tuple[Any, ...]] | None, watermark: int | None) -> list[dict[str, Any]]:
        parts = partial.partials(self.spec, events(rows, self.spec)) if rows is not None else None
        return self.took(engine.advance(self.spec, self.state, parts, watermark))

    def idle(self) -> list[dict[str, Any]]:
        return self.took(engine.finalize_idle(self.spec, self.state))

    def took(self, result: engine.Advanced) -> list[dict[str, Any]]:
        assert result.rows.schema == self.spec.output_schema()
        assert result.state.schema == engine.state_schema(self.spec)
        self.state, self.evicted = result.state, self.evicted + result.evicted
        return as_dicts(result.rows)


def brief(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["dev"], r["window_start"], r["_kind"], r["_revision"], r["_finalized_by"], r["_cause"], r["_events"])
            for r in rows]


def test_a_window_is_provisional_then_final_by_the_watermark_then_corrected_with_rising_revisions() -> None:
    b = Bucket()
    [row] = b.advance([("a", 10, 1.0, "x"), ("a", 20, 3.0, "y")], None)
    assert row | {"window_end": row["window_end"]} == {
        "dev": "a", "window_start": 0, "window_end": W, "t_count": 2, "t_mean": 2.0, "t_last": 3.0, "t_p95": 3.0,
        "s_count_distinct": 2, "_kind": "provisional", "_revision": 1, "_events": 2, "_finalized_by": None,
        "_cause": None}
    assert brief(b.advance([("a", 30, 5.0, "x")], W - 1)) == [("a", 0, "provisional", 2, None, None, 3)]
    # At the window's end (not only past it), final, from the stored partial.
    [final] = b.advance(None, W)
    assert brief([final]) == [("a", 0, "final", 3, "watermark", None, 3)] and final["t_mean"] == 3.0
    assert b.advance(None, W + 500) == []  # a final window is not written again
    [late] = b.advance([("a", 40, 7.0, "z")], W + 600)
    assert brief([late]) == [("a", 0, "correction", 4, None, "late event", 4)]
    assert (late["t_count"], late["t_mean"], late["t_last"], late["s_count_distinct"]) == (4, 4.0, 7.0, 3)
    assert brief(b.advance([("a", 50, None, "z")], W + 700)) == [("a", 0, "correction", 5, None, "late event", 5)]


def test_a_window_whose_events_all_come_after_the_watermark_passed_its_end_is_final_at_once() -> None:
    b = Bucket()
    assert brief(b.advance([("a", 5, 1.0)], 2 * W)) == [("a", 0, "final", 1, "watermark", None, 1)]
    assert brief(b.advance([("a", 6, 1.0)], 2 * W)) == [("a", 0, "correction", 2, None, "late event", 2)]


def test_untouched_windows_are_finalized_by_the_watermark_in_key_and_window_order() -> None:
    b = Bucket()
    b.advance([("b", 5, 1.0), (None, 7, 2.0), ("a", 3, 1.0), ("a", W + 1, 2.0)], None)
    rows = b.advance([("a", W + 2, 4.0), ("c", 2 * W, 1.0)], W)
    assert brief(rows) == [("a", 0, "final", 2, "watermark", None, 1),
                           ("a", W, "provisional", 2, None, None, 2),
                           ("b", 0, "final", 2, "watermark", None, 1),
                           ("c", 2 * W, "provisional", 1, None, None, 1),
                           (None, 0, "final", 2, "watermark", None, 1)]
    assert b.state is not None and b.state.column("_final").to_pylist() == [True, False, True, False, True]


def test_final_windows_are_dropped_once_the_watermark_passes_the_correction_horizon() -> None:
    b = Bucket()
    b.advance([("a", 5, 1.0), ("b", W + 5, 1.0)], None)
    b.advance(None, W)                                  # a@0 final
    assert brief(b.advance(None, 4 * W - 1)) == [("b", W, "final", 2, "watermark", None, 1)]
    assert b.state is not None and b.state.num_rows == 2 and b.evicted == 0
    assert b.advance(None, 4 * W) == [] and b.evicted == 1   # a@0: end + correct_for = 4W
    assert b.state.column("dev").to_pylist() == ["b"]
    # A window the watermark jumps past both its end and its horizon: written final, then dropped.
    c = Bucket()
    c.advance([("a", 5, 1.0)], None)
    assert brief(c.advance(None, 10 * W)) == [("a", 0, "final", 2, "watermark", None, 1)]
    assert c.evicted == 1 and c.state is not None and c.state.num_rows == 0


def test_beyond_horizon_is_where_the_window_end_plus_correct_for_reaches_the_watermark() -> None:
    ts = np.array([-1, 0, W - 1, W, 5 * W])
    assert engine.beyond_horizon(SPEC, ts, None).tolist() == [False] * 5
    assert engine.beyond_horizon(SPEC, ts, 4 * W - 1).tolist() == [True, False, False, False, False]
    assert engine.beyond_horizon(SPEC, ts, 4 * W).tolist() == [True, True, True, False, False]
    assert engine.beyond_horizon(SPEC, ts, 9 * W).tolist() == [True, True, True, True, True]


def test_idle_finalize_writes_every_open_window_final_and_later_events_correct_it() -> None:
    b = Bucket()
    b.advance([("a", 5, 1.0), ("b", W + 5, 2.0)], None)
    b.advance(None, W)                                   # a@0 final by the watermark
    assert brief(b.idle()) == [("b", W, "final", 2, "idle", None, 1)]
    assert b.idle() == []
    assert brief(b.advance([("b", W + 6, 4.0)], None)) == [("b", W, "correction", 3, None, "late event", 2)]
    assert b.advance(None, 2 * W) == []                  # already final: the watermark writes nothing
    b.advance(None, 5 * W)
    assert b.evicted == 2 and b.state is not None and b.state.num_rows == 0


def test_nothing_in_nothing_out_and_the_state_round_trips_through_ipc() -> None:
    empty = engine.advance(SPEC, None, None, 10 * W)
    assert empty.rows.num_rows == 0 and empty.state.num_rows == 0 and empty.evicted == 0
    b = Bucket()
    b.advance([("a", 5, 1.0, "x"), (None, W, math.nan, "y")], None)
    assert b.state is not None
    assert engine.state_from_ipc(engine.state_to_ipc(b.state), SPEC).equals(b.state)
    other = RollupSpec(name="r", by=("dev",), by_types=(pa.string(),), window_us=W, correct_for_us=W,
                       metrics=(("t", ("max",), pa.float64()),))
    with pytest.raises(ValueError, match="stored state of rollup 'r' has schema"):
        engine.state_from_ipc(engine.state_to_ipc(b.state), other)


# The batch recompute: random events in random micro-batches against pandas over the same events.

P = 100  # window
PSPEC = RollupSpec(
    name="p", by=("dev", "site"), by_types=(pa.string(), pa.int64()), window_us=P, correct_for_us=250,
    metrics=(("v", ("count", "min", "max", "mean", "sum", "last", "p50", "p95", "p99", "count_distinct"),
              pa.float64()),
             ("s", ("last", "count_distinct"), pa.string()),
             ("i", ("count", "min", "max", "sum", "last", "p95", "count_distinct"), pa.int64())))
COLUMNS = ["dev", "site", "_ts_us", "_partition", "_offset", "v", "s", "i"]
KEYS = [("a", 1), ("a", 2), ("b", 1), (None, 1), ("a", None), (None, None)]


def random_events(r: random.Random, n: int) -> list[tuple[Any, ...]]:
    offsets = [0, 0, 0]
    rows = []
    for _ in range(n):
        dev, site = r.choice(KEYS)
        p = r.randrange(3)
        offsets[p] += 1
        # Times on a coarse grid: many events share one, ordered by partition and offset.
        ts = r.randrange(-30, 120) * 10
        v = r.choice([None, math.nan, math.inf, -math.inf] + [r.randint(-400, 400) / 8 for _ in range(12)])
        s = r.choice([None, "x", "y", "z", "w"])
        i = r.choice([None, r.randint(-5, 5)])
        rows.append((dev, site, ts, p, offsets[p], v, s, i))
    return rows


def table(rows: list[tuple[Any, ...]]) -> pa.Table:
    types = [pa.string(), pa.int64(), pa.int64(), pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.int64()]
    return pa.table({c: pa.array([r[k] for r in rows], t) for k, (c, t) in enumerate(zip(COLUMNS, types, strict=True))})


def recompute(rows: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Per (dev, site, window_start), the metrics pandas computes over the events at once."""
    df = pd.DataFrame(rows, columns=COLUMNS).astype({"v": "float64", "i": "Int64", "site": "Int64"})
    df["v"] = df["v"].where(np.isfinite(df["v"]))
    df["window_start"] = df["_ts_us"] // P * P
    df = df.sort_values(["_ts_us", "_partition", "_offset"])

    def pct(q: float) -> Any:
        def f(x: pd.Series) -> float | None:
            x = x.dropna()
            return float(np.quantile(x.astype("float64"), q, method="inverted_cdf")) if len(x) else None
        return f

    g = df.groupby(["dev", "site", "window_start"], dropna=False, sort=False)
    out = g.agg(
        v_count=("v", "count"), v_min=("v", "min"), v_max=("v", "max"), v_mean=("v", "mean"),
        v_sum=("v", lambda x: x.sum(min_count=1)), v_last=("v", "last"), v_p50=("v", pct(0.5)),
        v_p95=("v", pct(0.95)), v_p99=("v", pct(0.99)), v_count_distinct=("v", "nunique"),
        s_last=("s", "last"), s_count_distinct=("s", "nunique"),
        i_count=("i", "count"), i_min=("i", "min"), i_max=("i", "max"), i_sum=("i", lambda x: x.sum(min_count=1)),
        i_last=("i", "last"), i_p95=("i", pct(0.95)), i_count_distinct=("i", "nunique"),
        _events=("_ts_us", "size"))

    def plain(x: Any) -> Any:
        return None if x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x)) else x

    return {tuple(plain(k) for k in key): {c: plain(v) for c, v in rec.items()}
            for key, rec in zip(out.index, out.to_dict("records"), strict=True)}


@pytest.mark.parametrize("seed", range(6))
def test_micro_batches_in_any_order_end_as_a_batch_recompute_of_the_events_counted(seed: int) -> None:
    r = random.Random(seed)
    rows = random_events(r, r.randint(150, 300))
    # Arrival in a random order: from nearly in time (most events counted) to shuffled (most beyond
    # the horizon by the time they come).
    disorder = r.choice([100, 300, 1000, 10**6])
    rows.sort(key=lambda e: e[2] + r.uniform(0, disorder))
    cuts = sorted(r.sample(range(1, len(rows)), r.randint(3, 12)))
    batches = [rows[i:j] for i, j in zip([0, *cuts], [*cuts, len(rows)], strict=True)]
    delay = r.choice([0, 50, 150, 400])

    b = Bucket(PSPEC)
    written: list[dict[str, Any]] = []
    counted: list[tuple[Any, ...]] = []
    seen: int | None = None
    for batch in batches:
        watermark = None if seen is None else seen - delay
        ts = np.array([e[2] for e in batch], dtype=np.int64)
        fed = [e for e, beyond in zip(batch, engine.beyond_horizon(PSPEC, ts, watermark), strict=True) if not beyond]
        counted += fed
        parts = partial.partials(PSPEC, table(fed)) if fed or r.random() < 0.5 else None
        written += b.took(engine.advance(PSPEC, b.state, parts, watermark))
        seen = max(int(ts.max()), seen if seen is not None else int(ts.max()))
    assert seen is not None
    written += b.took(engine.advance(PSPEC, b.state, None, seen + 10**6))
    assert b.state is not None and b.state.num_rows == 0

    expected = recompute(counted)
    history: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in written:
        history.setdefault((row["dev"], row["site"], row["window_start"]), []).append(row)
    assert set(history) == set(expected)
    assert b.evicted == len(expected)
    for key, rows_of in history.items():
        revisions = [row["_revision"] for row in rows_of]
        assert revisions == sorted(set(revisions)) and revisions[0] == 1, key
        kinds = [row["_kind"] for row in rows_of]
        first_final = kinds.index("final")
        assert kinds.count("final") == 1, key
        assert set(kinds[:first_final]) <= {"provisional"} and set(kinds[first_final + 1:]) <= {"correction"}, key
        assert rows_of[first_final]["_finalized_by"] == "watermark"
        last, want = rows_of[-1], expected[key]
        assert last["window_end"] == key[2] + P
        for name, value in want.items():
            if name == "v_mean" and value is not None:
                assert last[name] == pytest.approx(value, rel=1e-12), (key, name)
            else:
                assert last[name] == value, (key, name, last[name], value)


def test_the_events_folded_into_final_windows_are_counted_as_corrected() -> None:
    steps = [([("a", 10, 1.0), ("b", 20, 2.0)], None, 0),      # provisional
             ([("a", 30, 1.0), ("b", W + 5, 1.0)], W, 0),      # window 0 turns final in this batch: not a correction
             ([("a", 40, 1.0), ("a", 50, 2.0), ("b", 60, 3.0), ("b", W + 6, 1.0)], W + 10, 3)]  # 3 into window 0
    state = None
    for rows, watermark, corrected in steps:
        got = engine.advance(SPEC, state, partial.partials(SPEC, events(rows)), watermark)
        assert got.corrected == corrected
        state = got.state


def test_fill_writes_the_empty_windows_between_a_keys_first_and_last_with_count_zero() -> None:
    spec = dataclasses.replace(SPEC, fill=True)
    rows = [("a", 10, 1.0, "x"), ("a", 3 * W + 1, 2.0, "y"), ("b", 2 * W, 3.0, "z")]
    parts = partial.partials(spec, events(rows, spec))
    empty = engine.fill(spec, None, parts)
    assert [(r["dev"], r["window_start"], r["_events"]) for r in empty.to_pylist()] == [("a", W, 0), ("a", 2 * W, 0)]
    got = engine.advance(spec, None, pa.concat_tables([parts, empty]), None)
    by_window = {(r["dev"], r["window_start"]): r for r in as_dicts(got.rows)}
    assert sorted(by_window) == [("a", 0), ("a", W), ("a", 2 * W), ("a", 3 * W), ("b", 2 * W)]
    gap = by_window[("a", W)]
    assert (gap["t_count"], gap["t_mean"], gap["t_last"], gap["t_p95"], gap["s_count_distinct"], gap["_events"],
            gap["_kind"], gap["_revision"]) == (0, None, None, None, 0, 0, "provisional", 1)
    # Against the state: a later event at window 5 fills window 4 only; windows already held are not.
    later = partial.partials(spec, events([("a", 5 * W, 1.0, "x")], spec))
    assert [r["window_start"] for r in engine.fill(spec, got.state, later).to_pylist()] == [4 * W]
    assert engine.fill(spec, got.state, None).num_rows == 0


def test_fill_stays_within_the_correction_horizon_whatever_a_keys_first_window() -> None:
    spec = dataclasses.replace(SPEC, fill=True)   # correct_for 3 windows
    # One event with a time far behind the key's others: only the correctable windows are filled.
    parts = partial.partials(spec, events([("a", 10, 1.0), ("a", 100 * W + 1, 2.0)], spec))
    assert [r["window_start"] for r in engine.fill(spec, None, parts).to_pylist()] == [97 * W, 98 * W, 99 * W]
    # With a watermark: the windows whose end + correct_for is past it (from 47 on at 50).
    starts = [r["window_start"] for r in engine.fill(spec, None, parts, watermark_us=50 * W).to_pylist()]
    assert starts == [w * W for w in range(47, 100)]


def test_a_per_device_rollup_marks_the_empty_windows_inside_its_devices_gaps() -> None:
    """With gaps: the filled windows wholly inside a closed gap say _gap true; a withdrawn gap's say
    false again (written again), unless a closed part of it still holds them; a window with events
    is never in a gap."""
    spec = dataclasses.replace(SPEC, fill=True, gaps=True, correct_for_us=10 * W)
    assert spec.output_schema().field("_gap").type == pa.bool_()
    parts = partial.partials(spec, events([("a", 10, 1.0), ("a", 5 * W + 1, 2.0), ("b", 10, 3.0)], spec))
    filled = pa.concat_tables([parts, engine.fill(spec, None, parts)])
    # a was silent from 10 to 5W + 1: windows 1 to 4 lie in the gap; b's window 0 has an event.
    marks = engine.Marks(closed=(("a", 10, 5 * W + 1), ("b", 0, 2 * W)))
    got = engine.advance(spec, None, filled, None, marks)
    rows = {(r["dev"], r["window_start"]): r for r in as_dicts(got.rows)}
    assert {k: r["_gap"] for k, r in rows.items()} == {
        ("a", 0): False, ("a", W): True, ("a", 2 * W): True, ("a", 3 * W): True, ("a", 4 * W): True,
        ("a", 5 * W): False, ("b", 0): False}
    # A reading at 2.5W withdraws the gap; 2.5W..5W + 1 is still one: windows 3 and 4 stay in it.
    late = partial.partials(spec, events([("a", 2 * W + W // 2, 4.0)], spec))
    again = engine.advance(spec, got.state, late, None, engine.Marks(
        closed=(("a", 2 * W + W // 2, 5 * W + 1),), withdrawn=(("a", 10, 5 * W + 1),)))
    changed = {(r["dev"], r["window_start"]): (r["_gap"], r["_revision"], r["_events"]) for r in as_dicts(again.rows)}
    assert changed == {("a", W): (False, 2, 0), ("a", 2 * W): (False, 2, 1)}
    # Unmarked, the same rollup writes _gap false; an idle finalization keeps the marks.
    idle = engine.finalize_idle(spec, again.state)
    assert {(r["dev"], r["window_start"]): r["_gap"] for r in as_dicts(idle.rows)}[("a", 3 * W)] is True
    assert not any(r["_gap"] for r in as_dicts(engine.advance(spec, None, filled, None).rows))


def _sources(rows: list[tuple[Any, ...]]) -> dict[int, list[tuple[Any, ...]]]:
    """Rows by the state bucket of their device (a: 1, b: 2, none: 3)."""
    out: dict[int, list[tuple[Any, ...]]] = {}
    for e in rows:
        out.setdefault({"a": 1, "b": 2}.get(e[0], 3), []).append(e)
    return out


def _move(spec: RollupSpec, rows: list[tuple[Any, ...]], lo: int, hi: int) -> pa.Table:
    """A source's move: its parts of the windows from ``lo`` to ``hi`` from its ``rows`` as corrected."""
    within = [e for e in rows if lo <= e[2] // P * P < hi]
    parts = partial.partials(spec, table(within)) if within else spec.window_schema().empty_table()
    return engine.move_table(spec, parts, lo, hi, '{"dataset":"sites"}')


@pytest.mark.parametrize("seed", range(6))
def test_moves_between_windows_end_as_a_batch_recompute_of_the_corrected_events(seed: int) -> None:
    """Events from three state buckets in micro-batches (each bucket's parts kept); now and then a
    bucket moves some of its events to another site (a late reference version) and sends its new
    parts of every window they left or joined: the latest row of every window equals a batch
    recompute of the events as corrected, windows left with no event say 0, revisions rise, and a
    final window moved is a correction naming the cause."""
    r = random.Random(seed)
    spec = dataclasses.replace(PSPEC, correct_for_us=10**9)
    rows = sorted(random_events(r, r.randint(150, 300)), key=lambda e: e[2] + r.uniform(0, 200))
    cuts = sorted(r.sample(range(1, len(rows)), r.randint(3, 10)))
    batches = [rows[i:j] for i, j in zip([0, *cuts], [*cuts, len(rows)], strict=True)]
    b = Bucket(spec)
    parts: pa.Table | None = None
    written: list[dict[str, Any]] = []
    done: list[tuple[Any, ...]] = []
    seen: int | None = None
    moved_final = 0
    for batch in batches:
        watermark = None if seen is None else seen - 150
        if done and r.random() < 0.7:  # a late version moves a bucket's events from a time on
            source = r.choice(sorted(_sources(done)))
            since, site = r.randrange(-300, 1200, 10), r.choice([1, 2, None])
            hit = [k for k, e in enumerate(done) if _sources([e]).keys() == {source} and e[2] >= since]
            for k in hit:
                done[k] = (done[k][0], site, *done[k][2:])
            if hit:
                lo, hi = since // P * P, max(done[k][2] for k in hit) // P * P + P
                got = engine.move(spec, b.state, parts, [(source, _move(spec, _sources(done)[source], lo, hi))],
                                  watermark)
                rows_moved = b.took(got.advanced)
                for row in rows_moved:
                    assert lo <= row["window_start"] < hi
                    assert row["_cause"] == ('{"dataset":"sites"}' if row["_kind"] == "correction" else None)
                    moved_final += row["_kind"] == "correction"
                written += rows_moved
                parts = got.parts
        fed = _sources(batch)
        parts = engine.add_parts(spec, parts, [(s, partial.partials(spec, table(e))) for s, e in sorted(fed.items())])
        written += b.took(engine.advance(spec, b.state, partial.partials(spec, table(batch)), watermark))
        done += batch
        ts = max(e[2] for e in batch)
        seen = ts if seen is None else max(seen, ts)
    assert seen is not None
    written += b.took(engine.advance(spec, b.state, None, seen + 10**6))

    expected = recompute(done)
    latest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in written:
        key = (row["dev"], row["site"], row["window_start"])
        assert key not in latest or row["_revision"] > latest[key]["_revision"], key
        latest[key] = row
    emptied = {k for k, row in latest.items() if row["_events"] == 0}
    assert set(latest) - emptied == set(expected) and not emptied & set(expected)
    for key, want in expected.items():
        for name, value in want.items():
            if name in ("v_mean", "v_sum") and value is not None:
                assert latest[key][name] == pytest.approx(value, rel=1e-9), (key, name)
            else:
                assert latest[key][name] == value, (key, name, latest[key][name], value)
    assert all(latest[k]["v_count"] == 0 and latest[k]["v_max"] is None for k in emptied)


def test_a_move_rewrites_only_changed_windows_and_never_one_past_the_horizon() -> None:
    spec = dataclasses.replace(PSPEC, correct_for_us=200)
    rows = [("a", 1, 10, 0, k, v, "x", 1) for k, v in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])]
    first = pa.concat_tables([partial.partials(spec, table(rows[:3])), partial.partials(spec, table(rows[3:]))])
    state = engine.advance(spec, None, first, None).state
    parts = engine.add_parts(spec, None, [(1, partial.partials(spec, table(rows[:3]))),
                                          (1, partial.partials(spec, table(rows[3:])))])
    # The same events again, summed at once (their float sum differs in its last bits): nothing to write.
    got = engine.move(spec, state, parts, [(1, _move(spec, rows, 0, 100))], None)
    assert got.advanced.rows.num_rows == 0
    moved = _move(spec, [("a", 1, 10, 1, 1, 2.0, "x", 1)], 0, 100)  # source 1's new part of the window
    # The window ended at 100; with the watermark at 300 (100 + 200) it is gone: a move does not start it again.
    got = engine.move(spec, None, None, [(1, moved)], 300)
    assert got.advanced.rows.num_rows == 0 and got.advanced.state.num_rows == 0
    # A part the move's range covers but its table lacks goes: the window is written empty.
    parts = engine.add_parts(spec, None, [(1, first)])
    got = engine.move(spec, state, parts, [(1, _move(spec, [], 0, 100))], None)
    assert [(r["_events"], r["_revision"]) for r in as_dicts(got.advanced.rows)] == [(0, 2)] and not got.parts.num_rows

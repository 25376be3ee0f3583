"""The state step's part of the rollups (``enrich.state.rollups.feed``): partials routed by their
keys, events beyond a horizon left out of that rollup and dead-lettered once, with their counts."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from enrich.columns import PACK_KIND, ROWS
from enrich.ipc import from_ipc
from enrich.rollups.packs import COUNTS, partial_kind
from enrich.rollups.spec import RollupSpec
from enrich.state.rollups import feed, state_name_of
from enrich.state.stored import VALUE_SCHEMA

MIN = 60_000_000
DEVICE = RollupSpec(name="device_1m", by=("device_id",), by_types=(pa.string(),), window_us=MIN,
                    correct_for_us=2 * MIN, metrics=(("temp", ("mean",), pa.float64()),))
SITE = RollupSpec(name="site_1h", by=("site",), by_types=(pa.string(),), window_us=60 * MIN,
                  correct_for_us=30 * MIN, metrics=(("temp", ("max",), pa.float64()),))


def good_events(rows: list[tuple[str, str, int, float]]) -> pa.Table:
    """(device, site, minute, temp) as the state step holds its good events (no Kafka bytes kept)."""
    n = len(rows)
    return pa.table({"device_id": [r[0] for r in rows], "site": [r[1] for r in rows],
                     "temp": pa.array([r[3] for r in rows], pa.float64()),
                     "_ts_us": pa.array([r[2] * MIN for r in rows], pa.int64()),
                     "_key": pa.nulls(n, pa.binary()), "_value": pa.nulls(n, pa.binary()),
                     "_topic": ["ev"] * n, "_partition": pa.array([0] * n, pa.int32()),
                     "_offset": pa.array(range(n), pa.int64())})


def test_partials_go_to_the_bucket_of_their_keys_and_late_events_beyond_a_horizon_are_dead_letters() -> None:
    events = good_events([("a", "s1", 100, 1.0), ("b", "s1", 100, 2.0), ("c", "s2", 101, 3.0),
                          ("a", "s1", 96, 4.0),     # window 96's end + 2m = 99m <= 100m: beyond device_1m only
                          ("b", "s1", 30, 5.0)])    # beyond both (site_1h: 60m + 30m <= 100m)
    fed = feed((DEVICE, SITE), events, watermark_us=100 * MIN, ids=(11, 22, 33, 44), source=22)
    parts = {}
    for bucket, kind, value in fed.parts:
        parts.setdefault(kind, []).append((bucket, from_ipc(value)))
    assert {b for b, _, _ in fed.parts} <= {11, 22, 33, 44}            # the rollup step's grouping keys
    devices = [(b, d) for b, t in parts[partial_kind(0, 22)] for d in t.column("device_id").to_pylist()]
    assert sorted(d for _, d in devices) == ["a", "b", "c"]             # window 100 of a and b, 101 of c
    assert len({b for b, d in devices if d == "a"}) == 1
    sites = sorted((s, e) for _, t in parts[partial_kind(1, 22)] for s, e in zip(t.column("site").to_pylist(),
                                                                            t.column("_events").to_pylist(), strict=True))
    assert sites == [("s1", 3), ("s2", 1)]                               # the event at minute 96 counts here
    [(_, counts)] = parts[COUNTS]
    assert counts.to_pylist() == [{"rollup": "device_1m", "result": "beyond_horizon", "events": 2},
                                  {"rollup": "site_1h", "result": "beyond_horizon", "events": 1}]
    assert fed.dead is not None
    assert fed.dead.column("_error").to_pylist() == ["beyond the rollup horizon: device_1m",
                                                     "beyond the rollup horizon: device_1m, site_1h"]
    assert fed.dead.column("_offset").to_pylist() == [3, 4]
    assert json.loads(fed.dead.column("_value")[1].as_py()) == {"device_id": "b", "site": "s1", "temp": 5.0}


def test_without_a_watermark_nothing_is_beyond_a_horizon() -> None:
    fed = feed((DEVICE,), good_events([("a", "s1", 1, 1.0), ("a", "s1", 500, 2.0)]), watermark_us=None, ids=(0, 1),
               source=0)
    assert fed.dead is None and [k for _, k, _ in fed.parts] == [partial_kind(0, 0)] * len(fed.parts)


def test_the_keys_a_fill_by_a_join_writes_are_the_join_values_valid_at_the_windows_start() -> None:
    """dimension_keys: every key of an as_of dimension (base and overlay) joined at the window's
    start: a key deleted by then or whose value is null gives no row; values are distinct."""
    from enrich.columns import DELETED, VALID_FROM
    from enrich.joins import AsOfLookup, JoinSpec
    from enrich.state.rollups import dimension_keys

    def versions(rows: list[tuple[str, str | None, int, bool]]) -> pa.Table:
        return pa.table({"device_id": [r[0] for r in rows], "site": pa.array([r[1] for r in rows], pa.string()),
                         VALID_FROM: pa.array([r[2] * MIN for r in rows], pa.int64()),
                         DELETED: pa.array([r[3] for r in rows], pa.bool_())})

    base = AsOfLookup(versions([("a", "s1", 0, False), ("b", "s1", 0, False), ("c", "s2", 0, False),
                                ("d", None, 0, False), ("c", "s3", 10, False)]), ["device_id"])
    overlay = AsOfLookup(versions([("b", None, 5, True), ("e", "s4", 8, False)]), ["device_id"])
    join = JoinSpec(dataset="devices", pairs=(("device_id", "device_id"),), key_types=(pa.string(),),
                    columns=(("site", "site"),), out_types=(pa.string(),), matched="_devices_matched",
                    inner=False, time="ts")
    site = RollupSpec(name="site_1m", by=("site",), by_types=(pa.string(),), window_us=MIN,
                      correct_for_us=10 * MIN, metrics=(("temp", ("mean",), pa.float64()),), fill=True,
                      fill_keys="devices")

    def at(minute: int) -> list[str]:
        return sorted(dimension_keys(site, join, base, overlay, minute * MIN).column("site").to_pylist())

    assert at(1) == ["s1", "s2"]            # a and b in s1, c in s2; d's site is null
    assert at(6) == ["s1", "s2"]            # b deleted at 5: a keeps s1
    assert at(9) == ["s1", "s2", "s4"]      # e from 8
    assert at(12) == ["s1", "s3", "s4"]     # c moved to s3 at 10


def test_a_savepoints_windows_go_to_the_rollup_bucket_of_their_keys_in_the_new_layout() -> None:
    """initial_windows: each window of a saved bucket re-routed by its keys over the new grouping
    keys; a rollup the job no longer has is left out."""
    from enrich.rollups import engine
    from enrich.state.rollups import _route, initial_windows

    windows = engine.advance(DEVICE, None, from_ipc(next(
        v for _, k, v in feed((DEVICE,), good_events([(d, "s1", 100, 1.0) for d in "abcdefgh"]), None,
                              ids=(0,), source=0).parts if k == partial_kind(0, 0))), None).state
    saved = pa.RecordBatch.from_pylist([{"rollup": "device_1m", "windows": engine.state_to_ipc(windows)},
                                        {"rollup": "gone", "windows": b"x"}])
    ids = (7, 8, 9)
    out = pa.Table.from_batches(list(initial_windows(iter([saved]), specs=(DEVICE,), ids=ids)))
    assert set(out.column("_pack_kind").to_pylist()) == {"device_1m"}
    got = {}
    for bucket, value in zip(out.column("_rbucket").to_pylist(), out.column("rows").to_pylist(), strict=True):
        table = engine.state_from_ipc(value, DEVICE)
        assert set(_route(table, DEVICE.by, ids).tolist()) == {bucket}
        got.update(dict.fromkeys(table.column("device_id").to_pylist(), bucket))
    assert sorted(got) == list("abcdefgh") and len(set(got.values())) > 1


def _processor_calls() -> tuple[Any, ...]:
    from pyspark.sql.streaming.tws_tester import TwsTester

    from enrich.state.rollups import FINALS, RollupProcessor, state_name

    return TwsTester, RollupProcessor, state_name(DEVICE) + FINALS


@pytest.mark.parametrize("seed", range(4))
def test_the_rollup_step_keeps_final_windows_apart_and_writes_what_one_whole_table_would(seed: int) -> None:
    """RollupProcessor (through PySpark's TwsTester) against the engine folding one table of every
    window: random events in random batches, late ones within and beyond the horizon, timers firing
    as the watermark moves. The rows written and the timer are the same; the final windows are kept
    apart and most calls never read them."""
    from enrich.rollups import engine
    from enrich.rollups.packs import rows_kind
    from enrich.state.rollups import _next_due

    tester_cls, processor_cls, finals = _processor_calls()
    r = random.Random(seed)
    spec = DEVICE
    t = tester_cls(processor_cls((spec,)), timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)
    reads = 0
    store = t.handle.getListState(finals, VALUE_SCHEMA)
    get = store.get

    def counted_get() -> Any:
        nonlocal reads
        reads += 1
        return get()

    store.get = counted_get  # type: ignore[method-assign]
    whole: pa.Table | None = None
    wrote: list[dict[str, Any]] = []
    want: list[dict[str, Any]] = []

    def rows_of(out: Any) -> list[dict[str, Any]]:
        if out is None or not len(out):
            return []
        return [row for kind, value in zip(out[PACK_KIND], out[ROWS], strict=True) if kind == rows_kind(0)
                for row in from_ipc(value).to_pylist()]

    now, calls = 100 * 60, 0  # seconds
    for _ in range(120):
        now += r.choice([1, 2, 5, 10, 20])
        watermark = (now - 30) * 10**6
        # Timers first, as the new watermark fires them; the engine alike where the whole table is due.
        wrote += rows_of(t.setWatermark(watermark // 1000))
        if whole is not None and (due := _next_due(spec, whole)) is not None and due <= watermark:
            adv = engine.advance(spec, whole, None, watermark)
            whole, want = adv.state, want + adv.rows.to_pylist()
        # Seconds behind: most on time, some late within the 2m horizon, some beyond it.
        lates = [r.choice([0] * 40 + [20, 45, 100, 200, 400]) for _ in range(r.randint(1, 12))]
        events = good_events([(r.choice("abcdefgh"), "s1", 0, float(r.randint(0, 40))) for _ in lates])
        events = events.set_column(events.schema.get_field_index("_ts_us"), "_ts_us",
                                   pa.array([(now - late) * 10**6 for late in lates], pa.int64()))
        fed = feed((spec,), events, watermark, ids=(5,), source=0)
        parts = [(k, v) for _, k, v in fed.parts if k.startswith("partial:")]
        if not parts:
            continue
        calls += 1
        frame = pd.DataFrame({"_0": [5] * len(parts), "_1": [pd.Timestamp(0, tz="UTC")] * len(parts),
                              PACK_KIND: [k for k, _ in parts], ROWS: [v for _, v in parts]})
        wrote += rows_of(t.testInPandas(5, frame))
        adv = engine.advance(spec, whole, pa.concat_tables([from_ipc(v) for _, v in parts]), watermark)
        whole, want = adv.state, want + adv.rows.to_pylist()
        due = _next_due(spec, whole) if whole.num_rows else None
        assert list(t.handle.listTimers()) == ([-(-due // 1000)] if due is not None else [])
    assert wrote == want and any(row["_kind"] == "correction" for row in want)
    kept = [engine.state_from_ipc(bytes(v[0]), spec) for v in t.peekListState(finals, 5)]
    assert kept and reads < calls / 2, (reads, calls)
    held = t.peekValueState(state_name_of(spec.name), 5)
    if held is not None and held[0]:
        kept.append(engine.state_from_ipc(held[0], spec))
    assert whole is not None
    order = [(b, "ascending") for b in (*spec.by, "window_start")]
    assert pa.concat_tables(kept).sort_by(order).equals(whole.sort_by(order))


def test_a_forks_windows_handed_over_in_several_calls_are_all_kept() -> None:
    """PySpark hands a bucket's initial state over in chunks (a call each): the step keeps the windows
    of every call, final and open, not only the last call's."""
    from enrich.rollups import engine

    tester_cls, processor_cls, finals = _processor_calls()
    events = good_events([(d, "s1", m, float(m)) for d in "abcd" for m in (100, 101, 102)])
    parts = from_ipc(next(v for _, k, v in feed((DEVICE,), events, None, ids=(5,), source=0).parts
                          if k.startswith("partial:")))
    windows = engine.advance(DEVICE, None, parts, 102 * MIN).state   # minutes 100 and 101 final, 102 open
    assert 0 < sum(windows.column("_final").to_pylist()) < windows.num_rows
    chunks = [windows.slice(0, 5), windows.slice(5)]
    t = tester_cls(processor_cls((DEVICE,)), timeMode="EventTime", eventTimeExtractor=lambda _: 2**62,
                   initialStatePandas=[(5, pd.DataFrame({"_0": [5], "_1": ["device_1m"], "_2": [engine.state_to_ipc(c)]}))
                                       for c in chunks])
    kept = [engine.state_from_ipc(bytes(v[0]), DEVICE) for v in t.peekListState(finals, 5)]
    held = t.peekValueState(state_name_of(DEVICE.name), 5)
    assert held is not None and held[0]
    kept.append(engine.state_from_ipc(held[0], DEVICE))
    order = [(b, "ascending") for b in (*DEVICE.by, "window_start")]
    assert pa.concat_tables(kept).sort_by(order).equals(windows.sort_by(order))


def test_the_rollup_step_moves_a_buckets_part_of_its_windows_and_a_fork_keeps_the_parts() -> None:
    """A rollup by site whose site a late version corrects (``moves``): the state step's ``moves``
    (from what a bucket kept, as corrected) replace that bucket's part of each window, and the
    rollup step (through PySpark's TwsTester) writes the windows rebuilt from their parts: the other
    bucket's part stays; a final window moved is a correction naming the version. A savepoint's parts
    go to a fork with their bucket's new grouping key (a fork keeps the savepoint's bucket count)."""
    import dataclasses

    from enrich.columns import TS_US
    from enrich.rollups import engine
    from enrich.rollups.packs import rows_kind
    from enrich.state.rollups import PARTS, initial_windows, moves

    tester_cls, processor_cls, _ = _processor_calls()
    spec = dataclasses.replace(SITE, moves=True)
    t = tester_cls(processor_cls((spec,)), timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)

    def call(parts: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
        frame = pd.DataFrame({"_0": [5] * len(parts), "_1": [pd.Timestamp(0, tz="UTC")] * len(parts),
                              PACK_KIND: [k for k, _ in parts], ROWS: [v for _, v in parts]})
        out = t.testInPandas(5, frame)
        return [row for kind, value in zip(out[PACK_KIND], out[ROWS], strict=True) if kind == rows_kind(0)
                for row in from_ipc(value).to_pylist()] if out is not None and len(out) else []

    bucket_1 = good_events([("a", "s1", 100, 9.0), ("b", "s1", 101, 2.0)])
    bucket_2 = good_events([("c", "s1", 102, 5.0)])
    sent = [(k, v) for source, ev in ((1, bucket_1), (2, bucket_2))
            for _, k, v in feed((spec,), ev, None, ids=(5,), source=source).parts if k.startswith("partial:")]
    assert [(r["site"], r["temp_max"], r["_events"]) for r in call(sent)] == [("s1", 9.0, 3)]

    def moved_a(site: str, source: int = 1) -> list[tuple[str, bytes]]:
        """Bucket 1's moves when device a's event is corrected to ``site``: what it kept, as corrected."""
        after = bucket_1.set_column(1, "site", pa.array([site, "s1"]))
        got = moves((spec,), (0,), np.array([100 * MIN]), '{"dataset":"devices"}', after, 0, None, (5,), source, bucket_1)
        return [(k, v) for _, k, v in got]

    rows = call(moved_a("s2"))
    assert sorted((r["site"], r["temp_max"], r["_events"], r["_kind"], r["_cause"]) for r in rows) == [
        ("s1", 5.0, 2, "provisional", None), ("s2", 9.0, 1, "provisional", None)]
    t.setWatermark(130 * 60_000)  # both windows final (they end at 120 minutes), within the 30-minute horizon
    rows = call(moved_a("s3"))  # a again, now to s3: s2's window is left with nothing
    assert sorted((r["site"], r["temp_max"], r["_events"], r["_kind"], r["_cause"]) for r in rows) == [
        ("s2", None, 0, "correction", '{"dataset":"devices"}'), ("s3", 9.0, 1, "final", None)]

    parts = from_ipc(bytes(t.peekValueState(state_name_of(spec.name) + PARTS, 5)[0]))
    assert sorted(zip(parts.column("site").to_pylist(), parts.column(engine.SOURCE).to_pylist(), strict=True)) == [
        ("s1", 1), ("s1", 2), ("s3", 1)]
    saved = pa.RecordBatch.from_pylist([{"rollup": spec.name + PARTS, "windows": engine.state_to_ipc(parts)}])
    out = pa.Table.from_batches(list(initial_windows(iter([saved]), specs=(spec,), ids=(5, 6), sources={1: 11, 2: 12})))
    assert set(out.column(PACK_KIND).to_pylist()) == {spec.name + PARTS}
    got = pa.concat_tables([from_ipc(v) for v in out.column(ROWS).to_pylist()])
    assert sorted(got.column(engine.SOURCE).to_pylist()) == [11, 11, 12]
    assert TS_US in bucket_1.column_names


def test_a_move_goes_to_the_rollup_buckets_of_the_windows_it_touches_and_of_those_left() -> None:
    """A state bucket's moves reach the rollup buckets holding a window in the moved span (as
    corrected) and those of the windows the corrected events leave (an empty move there drops the
    bucket's part), not every rollup bucket: with 16 rollup buckets and three sites, at most three."""
    import dataclasses

    from enrich.state.rollups import _route, moves

    spec = dataclasses.replace(SITE, moves=True)
    ids = tuple(range(100, 116))
    was = good_events([("a", "s1", 100, 9.0), ("b", "s2", 101, 2.0)])
    now = was.set_column(1, "site", pa.array(["s3", "s2"]))
    got = moves((spec,), (0,), np.array([100 * MIN]), '{"dataset":"devices"}', now, 0, None, ids, 7, was.slice(0, 1))
    route = {site: int(_route(pa.table({"site": [site]}), ("site",), ids)[0]) for site in ("s1", "s2", "s3")}
    assert len(set(route.values())) == 3  # the hash spreads them: the test means something
    assert sorted(b for b, _, _ in got) == sorted(route.values())
    sent = {b: from_ipc(v) for b, _, v in got}
    assert sent[route["s3"]].column("site").to_pylist() == ["s3"]
    assert sent[route["s1"]].num_rows == 0  # s1's bucket is told its part from bucket 7 is gone
    # Corrected rows kept under an earlier plan, without a column the rollup is by: null there.
    got = moves((spec,), (0,), np.array([100 * MIN]), "{}", now, 0, None, ids, 7, was.drop_columns(["site"]))
    null = int(_route(pa.table({"site": pa.nulls(1, pa.string())}), ("site",), ids)[0])
    assert sorted(b for b, _, _ in got) == sorted({route["s2"], route["s3"], null})


def test_a_forks_rollup_step_judges_windows_against_its_savepoints_watermark() -> None:
    """A fork's first batches have no watermark of Spark's yet: the rollup step takes the savepoint's
    (``floor_us``), as the state step does, so a window that ends before it is written final at
    once, not provisional; one after it stays provisional; without a floor both are provisional."""
    tester_cls, processor_cls, _ = _processor_calls()
    events = good_events([("a", "s1", 100, 1.0), ("a", "s1", 110, 2.0)])
    sent = [(k, v) for _, k, v in feed((DEVICE,), events, None, ids=(5,), source=0).parts if k.startswith("partial:")]

    def kinds(floor_us: int | None) -> list[tuple[int, str]]:
        t = tester_cls(processor_cls((DEVICE,), floor_us=floor_us), timeMode="EventTime",
                       eventTimeExtractor=lambda _: 2**62)
        frame = pd.DataFrame({"_0": [5] * len(sent), "_1": [pd.Timestamp(0, tz="UTC")] * len(sent),
                              PACK_KIND: [k for k, _ in sent], ROWS: [v for _, v in sent]})
        out = t.testInPandas(5, frame)
        rows = [r for kind, value in zip(out[PACK_KIND], out[ROWS], strict=True) if kind.startswith("rollup:")
                for r in from_ipc(value).to_pylist()]
        return sorted((int(r["window_start"].timestamp()) // 60, r["_kind"]) for r in rows)

    assert kinds(105 * MIN) == [(100, "final"), (110, "provisional")]
    assert kinds(None) == [(100, "provisional"), (110, "provisional")]

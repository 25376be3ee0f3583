"""The per-device state engine on Arrow tables, against hand-worked cases and a per-event model."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enrich.state import engine
from enrich.state.engine import StateSpec

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TS = pa.timestamp("us", tz="UTC")
HOUR = 3600 * 10**6
SPEC = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=HOUR,
                 aggregates=(("temperature", ("last", "min", "max", "mean"), pa.float64()),
                             ("battery", ("last", "min"), pa.int64())))


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def us(seconds: float) -> int:
    return int(seconds * 10**6) + int(T0.timestamp()) * 10**6


def events(rows: list[tuple[Any, ...]], first_offset: int = 0) -> pa.Table:
    """(device, seconds after T0, temperature, battery[, partition]) rows; offsets count up."""
    return pa.table({
        "device_id": pa.array([r[0] for r in rows], pa.string()),
        "ts": pa.array([None if r[1] is None else at(r[1]) for r in rows], TS),
        "temperature": pa.array([r[2] for r in rows], pa.float64()),
        "battery": pa.array([r[3] for r in rows], pa.int64()),
        "_partition": pa.array([r[4] if len(r) > 4 else 0 for r in rows], pa.int32()),
        "_offset": pa.array(range(first_offset, first_offset + len(rows)), pa.int64()),
    })


def run(batches: list[pa.Table], watermarks: list[int | None] | None = None,
        spec: StateSpec = SPEC) -> tuple[list[list[dict | None]], list[list[bool]], pa.Table]:
    state = spec.empty()
    out, late = [], []
    for i, b in enumerate(batches):
        r = engine.apply(spec, state, b, watermarks[i] if watermarks else None)
        state = r.state
        out.append(r.column.to_pylist())
        late.append(r.late.to_pylist())
    return out, late, state


def test_aggregates_ignore_nulls_nan_and_infinities() -> None:
    [out], _, state = run([events([("a", 1, 20.0, None), ("a", 2, None, 7), ("a", 3, math.nan, None),
                                   ("a", 4, math.inf, None), ("a", 5, -math.inf, None), ("a", 6, 10.0, 9)])])
    assert [s["events"] for s in out] == [1, 2, 3, 4, 5, 6]
    assert [s["temperature_last"] for s in out] == [20.0] * 5 + [10.0]
    assert [s["temperature_min"] for s in out] == [20.0] * 5 + [10.0]
    assert [s["temperature_max"] for s in out] == [20.0] * 6
    assert [s["temperature_mean"] for s in out] == [20.0] * 5 + [15.0]
    assert [s["battery_last"] for s in out] == [None, 7, 7, 7, 7, 9]
    assert [s["battery_min"] for s in out] == [None, 7, 7, 7, 7, 7]
    assert [s["first_seen"] for s in out] == [at(1)] * 6
    assert [s["last_seen"] for s in out] == [at(n) for n in range(1, 7)]
    assert state.num_rows == 1 and state.column("temperature_count").to_pylist() == [2]


def test_state_continues_across_batches_in_arrival_order() -> None:
    # The second batch holds an event older than the first batch's (not late: no watermark): it is
    # applied after them, so it is the latest value, and first_seen moves back to its time.
    out, _, _ = run([events([("a", 10, 1.0, 1), ("b", 5, 2.0, 2)]), events([("a", 3, 5.0, None)], 2)])
    assert out[1][0] == {"events": 2, "first_seen": at(3), "last_seen": at(10), "temperature_last": 5.0,
                         "temperature_min": 1.0, "temperature_max": 5.0, "temperature_mean": 3.0,
                         "battery_last": 1, "battery_min": 1}


def test_within_a_batch_events_apply_in_event_time_order_ties_by_offset() -> None:
    # Input order is not event-time order; two events share a time and are ordered by partition,
    # then offset.
    b = events([("a", 5, 50.0, None), ("a", 1, 10.0, None), ("a", 3, 31.0, None, 1), ("a", 3, 30.0, None, 0)])
    [out], _, _ = run([b])
    assert [s["events"] for s in out] == [4, 1, 3, 2]
    assert [s["temperature_last"] for s in out] == [50.0, 10.0, 31.0, 30.0]


def test_late_event_is_flagged_and_not_applied() -> None:
    wm = us(100)
    out, late, state = run([events([("a", 200, 1.0, 1)]),
                            events([("a", 100, 9.0, 9), ("a", 99, 9.0, 9), ("a", 201, 3.0, None)], 1)],
                           [None, wm])
    assert late[1] == [True, True, False]
    assert out[1][0] is None and out[1][1] is None
    assert out[1][2]["events"] == 2 and out[1][2]["temperature_max"] == 3.0 and out[1][2]["battery_min"] == 1
    assert state.column(engine.EVENTS).to_pylist() == [2]


def test_ttl_drops_the_state_then_a_new_event_starts_fresh() -> None:
    first = events([("a", 0, 1.0, 1), ("b", 1800, 2.0, 2)])
    # The watermark reaches a's last_seen + ttl (not b's): a is dropped before the batch applies.
    out, _, state = run([first, events([("a", 3601, 5.0, None)], 2)], [None, us(3600)])
    assert out[1][0]["events"] == 1 and out[1][0]["first_seen"] == at(3601)
    assert out[1][0]["battery_min"] is None and out[1][0]["temperature_mean"] == 5.0
    assert sorted(state.column(engine.KEY).to_pylist()) == ["a", "b"]
    r = engine.apply(SPEC, state, events([]), us(3600 + 1800))
    assert r.evicted == 1 and r.state.column(engine.KEY).to_pylist() == ["a"]


def test_timer_helpers() -> None:
    _, _, state = run([events([("a", 0, 1.0, 1), ("b", 10, 2.0, 2)])])
    assert engine.next_expiry(SPEC, state) == us(0) + HOUR
    assert engine.next_expiry(SPEC, SPEC.empty()) is None
    kept, dropped = engine.evict(SPEC, state, us(0) + HOUR - 1)
    assert dropped == 0 and kept.num_rows == 2
    kept, dropped = engine.evict(SPEC, state, us(0) + HOUR)
    assert dropped == 1 and kept.column(engine.KEY).to_pylist() == ["b"]


def test_null_key_or_time_is_not_applied() -> None:
    [out], [late], state = run([events([(None, 1, 1.0, 1), ("a", None, 1.0, 1), ("a", 2, 1.0, 1)])])
    assert out[:2] == [None, None] and late == [False, False, False]
    assert out[2]["events"] == 1 and state.num_rows == 1


def test_large_integers_stay_exact() -> None:
    big = 2**62 + 1
    [out], _, _ = run([events([("a", 1, None, big), ("a", 2, None, big + 2)])])
    assert out[1]["battery_last"] == big + 2 and out[1]["battery_min"] == big


def test_output_does_not_depend_on_the_devices_sharing_a_bucket() -> None:
    a = [("a", i, 0.1 * i, i) for i in range(20)]
    alone, _, _ = run([events(a)])
    mixed_rows = [r for pair in zip(a, [("z", i, 1e9 / (i + 1), -i) for i in range(20)], strict=True) for r in pair]
    mixed, _, _ = run([events(mixed_rows)])
    assert [s for s in mixed[0][::2]] == alone[0]


def test_state_round_trips_as_bytes_and_is_deterministic() -> None:
    b = events([("a", 5, 1.5, 3), ("b", 1, None, 4), ("a", 1, 2.5, None)])
    r1, r2 = engine.apply(SPEC, SPEC.empty(), b, None), engine.apply(SPEC, SPEC.empty(), b, None)
    data = engine.state_to_ipc(r1.state)
    assert data == engine.state_to_ipc(r2.state)
    assert engine.state_from_ipc(data, SPEC).equals(r1.state)
    other = StateSpec(key="device_id", key_type=pa.string(), timestamp="ts", ttl_us=HOUR)
    with pytest.raises(ValueError, match="stored device state has schema"):
        engine.state_from_ipc(data, other)


def test_finalize_gives_each_device_the_state_its_last_event_carried() -> None:
    first = events([("a", 5, 1.5, 3), ("b", 1, None, 4), ("a", 1, 2.5, None)])
    second = events([("a", 9, None, 1), ("c", 2, 4.0, None)], first_offset=3)
    [out1, out2], _, state = run([first, second])
    got = dict(zip(state.column(engine.KEY).to_pylist(), engine.finalize(SPEC, state).to_pylist(), strict=True))
    # a's last event is its t=9 one (second batch), b's its only one, c's its only one.
    assert got == {"a": out2[0], "b": out1[1], "c": out2[1]}
    assert got["a"]["events"] == 3 and got["a"]["temperature_mean"] == 2.0 and got["b"]["temperature_mean"] is None
    assert engine.finalize(SPEC, SPEC.empty()).to_pylist() == []


def test_spec_refuses_min_of_a_string() -> None:
    with pytest.raises(ValueError, match="numeric"):
        StateSpec(key="k", key_type=pa.string(), timestamp="ts", ttl_us=1, aggregates=(("s", ("min",), pa.string()),))


# ------------------------------------------------------------------------ against a per-event model

def model(batches: list[pa.Table], watermarks: list[int | None]) -> list[list[dict | None]]:
    """The semantics one event at a time, in plain Python."""
    state: dict[str, dict[str, Any]] = {}
    out = []
    for b, wm in zip(batches, watermarks, strict=True):
        if wm is not None:
            state = {k: s for k, s in state.items() if s["last"] + HOUR > wm}
        rows = b.to_pylist()
        res: list[dict | None] = [None] * len(rows)
        order = sorted((i for i, r in enumerate(rows) if r["device_id"] is not None and r["ts"] is not None
                        and (wm is None or us((r["ts"] - T0).total_seconds()) > wm)),
                       key=lambda i: (rows[i]["device_id"], rows[i]["ts"], rows[i]["_partition"], rows[i]["_offset"]))
        for i in order:
            r = rows[i]
            t = us((r["ts"] - T0).total_seconds())
            s = state.setdefault(r["device_id"], {"n": 0, "first": t, "last": t, "tl": None, "tmin": None,
                                                  "tmax": None, "tsum": 0.0, "tc": 0, "bl": None, "bmin": None})
            s["n"] += 1
            s["first"], s["last"] = min(s["first"], t), max(s["last"], t)
            x, y = r["temperature"], r["battery"]
            if x is not None and not math.isnan(x):
                s["tl"] = x
                s["tmin"] = x if s["tmin"] is None else min(s["tmin"], x)
                s["tmax"] = x if s["tmax"] is None else max(s["tmax"], x)
                s["tsum"] += x
                s["tc"] += 1
            if y is not None:
                s["bl"] = y
                s["bmin"] = y if s["bmin"] is None else min(s["bmin"], y)
            res[i] = {"events": s["n"], "first_seen": T0 + timedelta(microseconds=s["first"] - us(0)),
                      "last_seen": T0 + timedelta(microseconds=s["last"] - us(0)), "temperature_last": s["tl"],
                      "temperature_min": s["tmin"], "temperature_max": s["tmax"],
                      "temperature_mean": s["tsum"] / s["tc"] if s["tc"] else None,
                      "battery_last": s["bl"], "battery_min": s["bmin"]}
        out.append(res)
    return out


row = st.tuples(st.sampled_from(["a", "b", "c", None]), st.one_of(st.none(), st.integers(0, 7200)),
                st.one_of(st.none(), st.floats(-100, 100, allow_nan=False)), st.one_of(st.none(), st.integers(-5, 5)),
                st.integers(0, 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(row, max_size=12), st.one_of(st.none(), st.integers(0, 7200))),
                min_size=1, max_size=5))
def test_matches_the_per_event_model(spec_batches: list[tuple[list[tuple[Any, ...]], int | None]]) -> None:
    batches, marks, offset = [], [], 0
    for rows, wm in spec_batches:
        batches.append(events(rows, offset))
        offset += len(rows)
        marks.append(None if wm is None else us(wm))
    got, _, _ = run(batches, marks)
    want = model(batches, marks)
    # Means within rounding: the engine sums with compensation (pandas' grouped cumsum), the model not.
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        for x, y in zip(g, w, strict=True):
            if x is None or y is None:
                assert x is y
            else:
                assert x == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in y.items()}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(row, max_size=12), st.one_of(st.none(), st.integers(0, 7200))),
                min_size=1, max_size=6))
def test_a_stored_change_rebuilds_the_new_table_from_the_old(
        spec_batches: list[tuple[list[tuple[Any, ...]], int | None]]) -> None:
    """What a batch stores instead of its whole table (the devices it touched, the keys it dropped),
    merged into the table before it, gives the table after it: row for row, in order."""
    state, rebuilt, offset = SPEC.empty(), SPEC.empty(), 0
    for rows, wm in spec_batches:
        r = engine.apply(SPEC, state, events(rows, offset), None if wm is None else us(wm))
        offset += len(rows)
        assert r.removed is not None
        rebuilt = engine.merge(SPEC, rebuilt, r.state.slice(r.state.num_rows - r.touched), r.removed)
        assert rebuilt.equals(r.state)
        state = r.state
    evicted, removed = engine.evict_keys(SPEC, state, us(10**6))
    assert engine.merge(SPEC, rebuilt, SPEC.empty(), removed).equals(evicted) and evicted.num_rows == 0


def applied_in_order(batches: list[pa.Table], results: list[engine.Applied]) -> list[tuple[str, int, int]]:
    """(device, batch, row) of every applied event, per device in application order."""
    out = []
    for i, (b, r) in enumerate(zip(batches, results, strict=True)):
        rows = b.to_pylist()
        done = [j for j, s in enumerate(r.column.to_pylist()) if s is not None]
        out += [(rows[j]["device_id"], i, j) for j in sorted(
            done, key=lambda j: (rows[j]["ts"], rows[j]["_partition"], rows[j]["_offset"]))]
    return sorted(out, key=lambda e: e[0])  # stable: per device, batches then time


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(row, max_size=12), st.one_of(st.none(), st.integers(0, 7200))),
                min_size=1, max_size=5), st.integers(0, 60))
def test_a_refold_from_the_accumulators_before_an_event_gives_what_apply_gives_the_changed_values(
        spec_batches: list[tuple[list[tuple[Any, ...]], int | None]], cut: int) -> None:
    """Events from offset ``cut`` on get other temperatures (a correction of a join column): per
    device, a refold from its first changed event (application order), seeded with what apply
    recorded before it and starting afresh where the device's count starts again, gives each
    later event's fields and the final accumulators that apply gives the changed batches."""
    import dataclasses

    import numpy as np

    sub = dataclasses.replace(SPEC, aggregates=SPEC.aggregates[:1])
    names = engine.accumulators(sub)
    batches, changed, marks, offset = [], [], [], 0
    for rows, wm in spec_batches:
        b = events(rows, offset)
        new = [(x * 2 + 1 if x is not None else 5.0) if offset + k >= cut else x
               for k, x in enumerate(b.column("temperature").to_pylist())]
        batches.append(b)
        changed.append(b.set_column(2, "temperature", pa.array(new, pa.float64())))
        offset += len(rows)
        marks.append(None if wm is None else us(wm))

    def apply_all(bs: list[pa.Table]) -> tuple[list[engine.Applied], pa.Table]:
        state, got = SPEC.empty(), []
        for b, wm in zip(bs, marks, strict=True):
            r = engine.apply(SPEC, state, b, wm, before=names)
            got.append(r)
            state = r.state
        return got, state

    first, _ = apply_all(batches)
    truth, truth_state = apply_all(changed)
    order = applied_in_order(batches, first)
    assert order == applied_in_order(changed, truth)
    # Per device, from its first event with an offset past the cut.
    picked = []
    for device in sorted({e[0] for e in order}):
        mine = [e for e in order if e[0] == device]
        at = next((k for k, (_, i, j) in enumerate(mine)
                   if batches[i].column("_offset")[j].as_py() >= cut), None)
        if at is not None:
            picked += mine[at:]
    if not picked:
        return
    count = np.array([first[i].column[j]["events"].as_py() for _, i, j in picked])
    dev = [d for d, _, _ in picked]
    starts = np.flatnonzero([k == 0 or dev[k] != dev[k - 1] or count[k] != count[k - 1] + 1
                             for k in range(len(picked))])
    seeds = pa.table({n: pa.array([first[picked[k][1]].before.column(n)[picked[k][2]].as_py() for k in starts],
                                  sub.state_schema().field(n).type) for n in names})
    values = pa.table({"temperature": [changed[i].column("temperature")[j].as_py() for _, i, j in picked]})
    got = engine.refold(sub, values, starts, seeds)
    for k, (_, i, j) in enumerate(picked):
        want = truth[i].column[j].as_py()
        for label, arr in got.fields.items():
            assert arr[k].as_py() == (pytest.approx(want[label]) if want[label] is not None else None), (label, k)
    # The last run of each device ends in the device's state, if the device is still kept.
    for r in range(len(starts)):
        end = starts[r + 1] - 1 if r + 1 < len(starts) else len(picked) - 1
        if end + 1 < len(picked) and dev[end + 1] == dev[end]:
            continue
        row = truth_state.filter(pa.compute.equal(truth_state.column(engine.KEY), dev[end])).to_pylist()
        if row and row[0][engine.EVENTS] == count[end]:
            for n in names:
                want_n = row[0][n]
                assert got.final.column(n)[r].as_py() == (pytest.approx(want_n) if want_n is not None else None)

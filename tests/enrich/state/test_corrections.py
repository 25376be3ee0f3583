"""What a bucket keeps for corrections and which kept events a batch's changes correct
(enrich.state.corrections), with the driver's changes made from real version state. Pure logic."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from enrich.columns import CAUSE, REVISION
from enrich.dimension.corrections import NO_BOUND_END, NO_BOUND_START
from enrich.ipc import from_ipc, to_ipc
from enrich.joins import JoinSpec
from enrich.state.corrections import (
    REVISIONS_SCHEMA,
    TS,
    Corrects,
    initial_written,
    keep,
    match,
    revisions,
    saved_chunks,
    with_revisions,
)
from enrich.state.layout import BucketLayout
from enrich.state.stored import WRITTEN
from tests.enrich.dimension.test_corrections import MIN, T0, Log, us

DEVICES = JoinSpec("devices", (("device_id", "device_id"),), (pa.string(),), (("site_id", "site_id"),),
                   (pa.string(),), "_devices_matched", False, "ts")
SITES = JoinSpec("sites", (("site_id", "id"),), (pa.int64(),), (("name", "site_name"),),
                 (pa.string(),), "_sites_matched", False, "ts")
BY_DEVICE = Corrects(DEVICES, ("device_id",), 3_600_000_000)
BY_SITE = Corrects(SITES, ("id",), 3_600_000_000)


def events(devices: list[str], minutes: list[int], offsets: list[int], sites: list[int] | None = None) -> pa.Table:
    cols = {"device_id": devices, "_partition": pa.array([0] * len(devices), pa.int32()),
            "_offset": pa.array(offsets, pa.int64())}
    if sites is not None:
        cols["site_id"] = pa.array([str(s) for s in sites])  # a string column joined on an int64 key
    return pa.table(cols)


def times(minutes: list[int]) -> list[int]:
    return [us(T0 + m * MIN) for m in minutes]


def change_table(key: str, rows: list[tuple[object, int, int, int, str]]) -> pa.Table:
    """(key value, valid_from, start, end, result) rows as the driver's changes."""
    return pa.table({key: [r[0] for r in rows], "__key": pa.array([f'{{"{key}":"{r[0]}"}}'.encode() for r in rows]),
                     "valid_from": pa.array([r[1] for r in rows], pa.int64()),
                     "start": pa.array([r[2] for r in rows], pa.int64()), "end": pa.array([r[3] for r in rows], pa.int64()),
                     "partition": pa.array([0] * len(rows), pa.int32()),
                     "offset": pa.array(range(7, 7 + len(rows)), pa.int64()),
                     "result": [r[4] for r in rows]})


def test_kept_events_are_those_within_the_horizon() -> None:
    log = keep(None, events(["d1", "d2"], [0, 10], [0, 1]), times([0, 10]), us(T0))
    log = keep(log, events(["d1"], [20], [2]), times([20]), us(T0 + 5 * MIN))
    assert log is not None and log.column("_offset").to_pylist() == [1, 2]
    assert log.column(REVISION).to_pylist() == [0, 0] and log.column(TS).to_pylist() == times([10, 20])
    assert keep(log, None, None, us(T0 + 21 * MIN)) is None


def test_a_change_corrects_its_keys_events_in_its_span_and_counts_revisions() -> None:
    log = keep(None, events(["d1", "d2", "d1", "d1"], [0, 15, 15, 30], [0, 1, 2, 3]), times([0, 15, 15, 30]),
               us(T0 - 60 * MIN))
    at, until = us(T0 + 10 * MIN), us(T0 + 20 * MIN)
    got = match(log, [(BY_DEVICE, change_table("device_id", [("d1", at, at, until, "corrected")]))])
    assert got is not None
    assert got.rows.column("_offset").to_pylist() == [2] and got.rows.column(REVISION).to_pylist() == [1]
    cause = got.rows.column(CAUSE).to_pylist()[0]
    assert (cause["dataset"], cause["key"], cause["partition"], cause["offset"]) == (
        "devices", '{"device_id":"d1"}', 0, 7)
    assert cause["valid_from"] == T0 + 10 * MIN
    assert got.log.column(REVISION).to_pylist() == [0, 0, 1, 0]
    # A second change of the same event: revision 2.
    again = match(got.log, [(BY_DEVICE,
                             change_table("device_id", [("d1", at, NO_BOUND_START, NO_BOUND_END, "beyond_horizon")]))])
    assert again is not None and again.rows.column("_offset").to_pylist() == [0, 2, 3]
    assert again.rows.column(REVISION).to_pylist() == [1, 2, 1]


def test_a_chunks_revisions_kept_apart_give_back_what_match_left() -> None:
    """The processor writes back a corrected chunk's revisions, not its rows: reading them onto the
    rows as kept gives the chunk :func:`match` left, and a second change goes on from there."""
    log = keep(None, events(["d1", "d2", "d1", "d1"], [0, 15, 15, 30], [0, 1, 2, 3]), times([0, 15, 15, 30]),
               us(T0 - 60 * MIN))
    assert log is not None and revisions(log).num_rows == 0 and with_revisions(log, None) is log
    at, until = us(T0 + 10 * MIN), us(T0 + 20 * MIN)
    got = match(log, [(BY_DEVICE, change_table("device_id", [("d1", at, at, until, "corrected")]))])
    assert got is not None
    revised = revisions(got.log)
    assert revised.schema == REVISIONS_SCHEMA and revised.to_pylist() == [{"row": 2, "revision": 1}]
    read = with_revisions(log, revised)
    assert read.equals(got.log)
    again = match(read, [(BY_DEVICE, change_table("device_id", [("d1", at, NO_BOUND_START, NO_BOUND_END,
                                                                  "beyond_horizon")]))])
    assert again is not None and again.rows.column(REVISION).to_pylist() == [1, 2, 1]
    assert with_revisions(log, revisions(again.log)).column(REVISION).to_pylist() == [1, 0, 2, 1]
    # A merged chunk holds revisions in its rows: the kept ones never go back.
    assert with_revisions(again.log, revised).column(REVISION).to_pylist() == [1, 0, 2, 1]


def test_a_chunks_refolded_accumulators_ride_with_its_revisions_and_a_savepoint_applies_them() -> None:
    """With state aggregates folded again, the revisions table also carries the rows' accumulators:
    the rows a fold marked (:data:`REFOLDED`) and those corrected; read back onto the rows as kept
    they give the chunk as the fold left it, and so does a savepoint's copy (:func:`saved_chunks`)."""
    from enrich.state.corrections import ACC, REFOLDED

    log = keep(None, events(["d1", "d1", "d1"], [0, 10, 20], [0, 1, 2]), times([0, 10, 20]), us(T0 - 60 * MIN))
    assert log is not None
    log = log.append_column(ACC + "x_max", pa.array([None, 1.0, 2.0], pa.float64()))
    folded = (log.set_column(log.schema.get_field_index(ACC + "x_max"), ACC + "x_max", pa.array([None, 1.0, 5.0]))
              .set_column(log.schema.get_field_index(REVISION), REVISION, pa.array([0, 0, 1], pa.int32()))
              .append_column(REFOLDED, pa.array([False, False, True])))
    side = revisions(folded)
    assert side.to_pylist() == [{"row": 2, "revision": 1, ACC + "x_max": 5.0}]
    read = with_revisions(log, side)
    assert read.column(ACC + "x_max").to_pylist() == [None, 1.0, 5.0]
    assert read.column(REVISION).to_pylist() == [0, 0, 1] and read.column(REFOLDED).to_pylist() == [False, False, True]
    assert revisions(read).equals(side)  # what the next write of the chunk's revisions keeps
    batch = pa.RecordBatch.from_pylist([{"rows": to_ipc(log), "revisions": to_ipc(side)}])
    (saved,) = list(saved_chunks(iter([batch])))
    assert from_ipc(saved.column("table")[0].as_py()).column(ACC + "x_max").to_pylist() == [None, 1.0, 5.0]


def test_a_savepoints_chunks_carry_their_revisions_and_a_fork_routes_each_event_to_its_devices_bucket() -> None:
    """A savepoint writes each kept chunk with its revisions applied (:func:`saved_chunks`); a fork
    splits each chunk by the bucket its events' devices fall in under its own layout
    (:func:`initial_written`), the one their events are hashed to: every event once, in its bucket."""
    devices = [f"d{i}" for i in range(40)]
    log = keep(None, events(devices, list(range(40)), list(range(40))), times(list(range(40))), us(T0 - 60 * MIN))
    assert log is not None
    at = us(T0 + 10 * MIN)
    got = match(log, [(BY_DEVICE, change_table("device_id", [("d12", at, at, NO_BOUND_END, "corrected")]))])
    assert got is not None
    saved = list(saved_chunks(iter([pa.RecordBatch.from_pydict(
        {"rows": pa.array([to_ipc(log), to_ipc(log.slice(0, 3))], pa.binary()),
         "revisions": pa.array([to_ipc(revisions(got.log)), None], pa.binary())})])))
    tables = [from_ipc(v) for b in saved for v in b.column("table").to_pylist()]
    assert len(tables) == 2 and tables[0].equals(got.log) and tables[1].equals(log.slice(0, 3))

    layout = BucketLayout.even(8)
    want = dict(zip(devices, layout.of(pa.array(devices)).tolist(), strict=True))
    assert len(set(want.values())) > 1   # the devices are spread: the test routes, not copies
    out = pa.Table.from_batches(list(initial_written(iter(saved[:1]), ids=layout.ids, key="device_id")))
    assert set(out.column("kind").to_pylist()) == {WRITTEN} and out.column("schema").null_count == out.num_rows
    seen = []
    for bucket, value in zip(out.column("_bucket").to_pylist(), out.column("table").to_pylist(), strict=True):
        piece = from_ipc(value)
        assert {want[d] for d in piece.column("device_id").to_pylist()} == {bucket}
        seen += [(r["device_id"], r[REVISION]) for r in piece.to_pylist()]
    assert sorted(seen) == sorted((d, 1 if d == "d12" else 0) for d in devices)


def test_unchanged_versions_and_other_keys_correct_nothing() -> None:
    log = keep(None, events(["d1", None], [5, 5], [0, 1]), times([5, 5]), us(T0))  # type: ignore[list-item]
    assert match(log, [(BY_DEVICE, change_table("device_id", [
        ("d1", 0, NO_BOUND_START, NO_BOUND_END, "unchanged"),
        ("d9", 0, NO_BOUND_START, NO_BOUND_END, "corrected")]))]) is None
    assert match(None, []) is None


def test_two_joins_changing_one_event_give_two_revisions_in_join_order() -> None:
    log = keep(None, events(["d1", "d2"], [5, 6], [0, 1], sites=[3, 4]), times([5, 6]), us(T0))
    got = match(log, [
        (BY_DEVICE, change_table("device_id", [("d1", 0, NO_BOUND_START, NO_BOUND_END, "corrected")])),
        (BY_SITE, pa.table({"id": pa.array([3], pa.int64()), "__key": [b'{"id":3}'],
                                   "valid_from": pa.array([0], pa.int64()),
                                   "start": pa.array([NO_BOUND_START], pa.int64()),
                                   "end": pa.array([NO_BOUND_END], pa.int64()),
                                   "partition": pa.array([1], pa.int32()), "offset": pa.array([4], pa.int64()),
                                   "result": ["corrected"]}))])
    assert got is not None
    assert got.rows.column("_offset").to_pylist() == [0, 0]
    assert got.rows.column(REVISION).to_pylist() == [1, 2]
    assert [c["dataset"] for c in got.rows.column(CAUSE).to_pylist()] == ["devices", "sites"]


def test_the_drivers_changes_correct_what_a_fresh_join_would_give_otherwise() -> None:
    # d1 at s-2 from 9:00; its events at 9:05..9:55. The move to s-6 as of 9:30 arrives late.
    state = Log()
    state.put(T0, [{"device_id": "d1", "site_id": "s-2"}, {"device_id": "d2", "site_id": "s-2"}])
    minutes = list(range(5, 60, 10))
    log = keep(None, events(["d1"] * len(minutes) + ["d2"], [*minutes, 40], list(range(len(minutes) + 1))),
               times([*minutes, 40]), us(T0 - timedelta(hours=1)))
    ch = state.batch(T0 - timedelta(hours=1), (T0 + 30 * MIN, [{"device_id": "d1", "site_id": "s-6"}]))
    got = match(log, [(BY_DEVICE, ch)])
    assert got is not None
    assert got.rows.column("_offset").to_pylist() == [3, 4, 5]  # 9:35, 9:45, 9:55


def test_hostile_keys_correct_exactly_their_own_events_and_are_named_in_the_cause() -> None:
    """Join keys with quotes, a backslash, a newline, a NUL, non-ASCII, JSON of their own, 10,000
    characters and case differences, beside near misses: a late change corrects the events of its
    exact key only, and ``_cause.key`` gives that key back."""
    import json

    changed = ['a"b', "c\\d", "e\nf", "g\0h", "ünï €", '{"device_id": "x"}', "k" * 10_000, "case"]
    near = ['a"b ', "c\\\\d", "e\rf", "g", "uni €", "x", "k" * 9_999, "Case"]
    log = Log()
    log.put(T0, [{"device_id": d, "site_id": "s-2"} for d in changed + near])
    at = T0 + 10 * MIN
    ch = log.batch(T0 - timedelta(days=1), (at, [{"device_id": d, "site_id": "s-6"} for d in changed]))
    devices = changed + near
    kept = keep(None, events(devices, [20] * len(devices), list(range(len(devices)))), times([20] * len(devices)),
                us(T0))
    got = match(kept, [(BY_DEVICE, ch)])
    assert got is not None
    assert got.rows.column("_offset").to_pylist() == list(range(len(changed)))
    assert [json.loads(c["key"])["device_id"] for c in got.rows.column(CAUSE).to_pylist()] == changed


def test_a_partitioned_bucket_finds_its_late_versions_and_deletes_from_its_own_records() -> None:
    """bucket_changes: a bucket's changelog records of a batch against its versions before and after
    (apply_changes, as the processor runs it): a backdated move and a delete are changes, a record
    of a key the bucket kept nothing after is timely, a move before the horizon is counted beyond it;
    tally/read_tallies sum the buckets' reports."""
    import dataclasses

    from enrich.joins.partitioned import apply_changes, partitioned_dim
    from enrich.state.corrections import bucket_changes, read_tallies, tally
    from refstream import contract
    from tests.enrich.joins.test_partitioned import SCHEMA, make_dim, records, upserts

    dim = partitioned_dim(0, "devices", "ref.devices", SCHEMA, dataclasses.replace(make_dim().join, time="ts"),
                          inner=False, history=timedelta(days=2))
    c = Corrects(dim.join, ("id",), 3_600_000_000, ("owner", "limit"), dim=0)

    def at(when: object, *messages: contract.Message, first: int) -> pa.Table:
        t = records(*messages, first=first)
        return (t.append_column("valid_from", pa.array([contract.format_time(when)] * t.num_rows))  # type: ignore[arg-type]
                .append_column("timestamp", pa.nulls(t.num_rows, pa.timestamp("us", tz="UTC"))))

    first = at(T0, contract.schema_message(SCHEMA), *upserts({"id": 1, "owner": "a", "limit": 1.0},
                                                             {"id": 2, "owner": "b", "limit": 2.0}), first=0)
    old, schema = apply_changes(dim, dim.empty(), SCHEMA, first)
    batch = pa.concat_tables([
        at(T0 + 10 * MIN, *upserts({"id": 1, "owner": "a2", "limit": 1.0}), first=3),       # backdated move
        at(T0 + 20 * MIN, *contract.delete_messages(SCHEMA, [{"id": 2}], 2, valid_from=T0 + 20 * MIN), first=4),
        at(T0 + 90 * MIN, *upserts({"id": 3, "owner": "c", "limit": 3.0}), first=5)])      # a new key, later
    new, _ = apply_changes(dim, old, schema, batch)
    got = bucket_changes(c, old, new, batch, us(T0), us(T0 + 60 * MIN))
    assert [(k, r) for k, r in zip(got.column("id").to_pylist(), got.column("result").to_pylist(), strict=True)] == [
        (1, "corrected"), (2, "corrected"), (3, "corrected")]
    assert got.column("start").to_pylist()[:2] == [us(T0 + 10 * MIN), us(T0 + 20 * MIN)]
    assert got.column("offset").to_pylist() == [3, 4, 5]
    # The same records in a bucket that kept nothing: nothing to correct, all timely.
    assert set(bucket_changes(c, old, new, batch, us(T0), None).column("result").to_pylist()) == {"timely"}
    # A horizon from T0 + 15m: the move at 10m reaches before it, the delete at 20m does not.
    late = bucket_changes(c, old, new, batch, us(T0 + 15 * MIN), us(T0 + 60 * MIN))
    assert late.column("result").to_pylist() == ["beyond_horizon", "corrected", "corrected"]
    # Kept events up to T0 + 30m: a version from 90m (after each of them) is timely.
    next_batch = at(T0 + 90 * MIN, *upserts({"id": 1, "owner": "a9", "limit": 1.0}), first=6)
    newer, _ = apply_changes(dim, new, schema, next_batch)
    later = bucket_changes(c, new, newer, next_batch, us(T0), us(T0 + 30 * MIN))
    assert later.column("result").to_pylist() == ["timely"]

    report = tally([(c, late, us(T0 + 15 * MIN))])
    assert report["counts"] == {"devices beyond_horizon": 1, "devices corrected": 2}
    assert report["beyond"]["devices"][1:] == [us(T0 + 10 * MIN), us(T0 + 15 * MIN)]
    counts, beyond = read_tallies({0: report, 1: tally([(c, got, us(T0))])})
    assert counts == {("devices", "beyond_horizon"): 1, ("devices", "corrected"): 5}
    assert list(beyond) == ["devices"] and '"id":1' in beyond["devices"][0].replace(" ", "")


def test_a_buckets_corrections_look_a_partitioned_join_up_again_retracting_and_clipping_as_a_fresh_join() -> None:
    """The processor's corrections of a corrected partitioned join: its columns from the bucket's
    versions after the batch; an inner one that lost its match (a delete as of before the event)
    retracts the event; ``_clipped`` found again (the event now after the key's oldest version)."""
    import dataclasses

    from enrich.joins.asof import CLIPPED
    from enrich.joins.partitioned import Version, apply_changes, partitioned_dim
    from enrich.state.engine import StateSpec
    from enrich.state.processor import DeviceStateProcessor
    from refstream import contract
    from tests.enrich.joins.test_partitioned import SCHEMA, make_dim, records, upserts

    dim = dataclasses.replace(
        partitioned_dim(0, "devices", "ref.devices", SCHEMA, dataclasses.replace(make_dim().join, time="ts"),
                        inner=False, history=timedelta(days=2)), inner=True)
    c = Corrects(dim.join, ("id",), 3_600_000_000, ("owner", "limit"), dim=0)
    proc = DeviceStateProcessor(StateSpec("device_id", pa.int64(), "ts", 10**9), ("device_id", "ts"), dims=(dim,),
                                corrected=(c,))

    def at(when: object, *messages: contract.Message, first: int) -> pa.Table:
        t = records(*messages, first=first)
        return (t.append_column("valid_from", pa.array([contract.format_time(when)] * t.num_rows))  # type: ignore[arg-type]
                .append_column("timestamp", pa.nulls(t.num_rows, pa.timestamp("us", tz="UTC"))))

    stored, schema = apply_changes(dim, dim.empty(), SCHEMA, at(T0 + 30 * MIN, contract.schema_message(SCHEMA), *upserts(
        {"id": 1, "owner": "a", "limit": 1.0}, {"id": 2, "owner": "b", "limit": 2.0}), first=0))
    # Late: device 1 existed from T0 (its events at 10m were clipped to the 30m version), device 2 deleted as of 5m.
    stored, schema = apply_changes(dim, stored, schema, pa.concat_tables([
        at(T0, *upserts({"id": 1, "owner": "a0", "limit": 1.0}), first=3),
        at(T0 + 5 * MIN, *contract.delete_messages(SCHEMA, [{"id": 2}], 2, valid_from=T0 + 5 * MIN), first=4)]))
    rows = pa.table({"device_id": pa.array([1, 2], pa.int64()),
                     "ts": pa.array([T0 + 10 * MIN] * 2, pa.timestamp("us", tz="UTC")),
                     "owner": ["a", "b"], "limit": [1.0, 2.0], "_devices_matched": [True, True], CLIPPED: [True, True],
                     TS: pa.array(times([10, 10]), pa.int64()), REVISION: pa.array([1, 1], pa.int32())})
    got, lost = proc._look_again(rows, [Version(dim, stored, schema)])
    assert got.column_names == rows.column_names
    assert got.column("owner").to_pylist() == ["a0", None]
    assert got.column("_devices_matched").to_pylist() == [True, False]
    assert got.column(CLIPPED).to_pylist() == [False, False]
    assert lost.tolist() == [False, True]


def test_a_correction_refolds_the_state_aggregates_over_the_join_columns_as_a_fresh_bucket_computes_them() -> None:
    """``state.aggregates`` over a corrected partitioned join's column (``limit``: max, mean, last),
    through the processor (PySpark's TwsTester). Device 1's events at 10, 20 and 30 minutes were
    joined with limits 1, 1 and 2 (versions from T0 and T0 + 25m); a version from T0 + 15m (limit
    5) learnt later corrects the event at 20m, and with it the state of the event at 30m (its own
    limit unchanged: a correction caused by the same version); the device's next event continues
    from the refolded state. A second late version (T0 + 5m, limit 3) corrects the first event and
    every later one's state. Then, behind a watermark, a call of one late event alone (never applied,
    kept without state) and one where a version from T0 + 35m corrects the events after it again,
    from the accumulators the earlier folds left. The latest record of each event equals what a
    bucket that had every version from the start writes."""
    import dataclasses

    import pandas as pd
    from pyspark.sql.streaming.tws_tester import TwsTester

    from enrich import packed
    from enrich.columns import FLAT, KIND, TS_US
    from enrich.joins.partitioned import partitioned_dim
    from enrich.state.engine import StateSpec
    from enrich.state.processor import DeviceStateProcessor
    from refstream import contract
    from tests.enrich.joins.test_partitioned import SCHEMA, make_dim, records, upserts

    dim = partitioned_dim(0, "devices", "ref.devices", SCHEMA, dataclasses.replace(make_dim().join, time="ts"),
                          inner=False, history=timedelta(days=2))
    c = Corrects(dim.join, ("id",), 3_600_000_000, ("owner", "limit"), dim=0)
    spec = StateSpec("device_id", pa.int64(), TS_US, 10**12, aggregates=(("limit", ("max", "mean", "last"), pa.float64()),),
                     timestamp_type=pa.int64())
    columns = ("device_id", "ts", "_error", "_partition", "_offset")
    offsets = iter(range(100))

    def versions(*puts: tuple[int, float, int]) -> pa.Table:
        """(device, limit, minutes after T0 it is valid from) versions, as the bucket's changelog records."""
        parts = []
        for device, limit, minutes in puts:
            first = next(offsets)
            t = records(*upserts({"id": device, "owner": "o", "limit": limit}), first=first)
            parts.append(t.append_column("valid_from", pa.array([contract.format_time(T0 + minutes * MIN)]))
                         .append_column("timestamp", pa.nulls(1, pa.timestamp("us", tz="UTC"))))
        schema = records(contract.schema_message(SCHEMA), first=99)
        schema = (schema.append_column("valid_from", pa.array([contract.format_time(T0 - 60 * MIN)]))
                  .append_column("timestamp", pa.nulls(1, pa.timestamp("us", tz="UTC"))))
        return pa.concat_tables([schema, *parts]).replace_schema_metadata({b"refstream.kind": dim.kind.encode()})

    def events(rows: list[tuple[int, int, int]]) -> pa.Table:
        """(device, minutes after T0, offset) events."""
        ts = [T0 + m * MIN for _, m, _ in rows]
        return pa.table({"device_id": pa.array([r[0] for r in rows], pa.int64()), "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
                         "_error": pa.nulls(len(rows), pa.string()), "_partition": pa.array([0] * len(rows), pa.int32()),
                         "_offset": pa.array([r[2] for r in rows], pa.int64()),
                         TS_US: pa.array([us(t) for t in ts], pa.int64())})

    def call(tester: TwsTester, *chunks: pa.Table) -> list[dict]:
        out = tester.testInPandas(3, pd.DataFrame({"_0": [3] * len(chunks), "rows": [to_ipc(x) for x in chunks]}))
        return pa.concat_tables([from_ipc(v) for v in out[packed.ROWS]]).to_pylist()

    def tester() -> TwsTester:
        return TwsTester(DeviceStateProcessor(spec, columns, dims=(dim,), corrected=(c,)), timeMode="EventTime",
                         eventTimeExtractor=lambda _: 2**62)

    batches = [events([(1, 10, 0), (1, 20, 1), (1, 30, 2), (2, 10, 3)]), events([(1, 40, 4)]), events([(1, 50, 5)]),
               events([(1, 30, 6)]), events([(2, 60, 7)])]
    late = [[], [(1, 5.0, 15)], [(1, 3.0, 5)], [], [(1, 7.0, 35)]]  # the versions learnt at each batch
    live, fresh = tester(), tester()
    written = call(live, versions((1, 1.0, 0), (1, 2.0, 25)), batches[0])
    second = call(live, versions(*late[1]), batches[1])
    third = call(live, versions(*late[2]), batches[2])
    watermark = (us(T0 + 45 * MIN)) // 1000
    live.setWatermark(watermark)
    fourth = call(live, batches[3])
    assert [r[FLAT + "events"] for r in fourth] == [None]  # late: not applied, kept without state
    fifth = call(live, versions(*late[4]), batches[4])
    assert sorted((r["_offset"], r["_revision"]) for r in fifth if r[KIND] == "correction") == [(4, 2), (5, 1)]
    want = call(fresh, versions((1, 1.0, 0), (1, 2.0, 25), *late[1], *late[2], *late[4]), batches[0])
    want += call(fresh, batches[1]) + call(fresh, batches[2])
    fresh.setWatermark(watermark)
    want += call(fresh, batches[3]) + call(fresh, batches[4])

    fields = [FLAT + f for f in ("events", "limit_max", "limit_mean", "limit_last")]

    def state(r: dict) -> tuple:
        return tuple(round(r[f], 9) if isinstance(r[f], float) else r[f] for f in fields)

    assert [state(r) for r in written] == [(1, 1.0, 1.0, 1.0), (2, 1.0, 1.0, 1.0), (3, 2.0, round(4 / 3, 9), 2.0), (1, None, None, None)]
    fixed = {(r["_offset"], r["_revision"]): r for r in second if r[KIND] == "correction"}
    # Event 1 (its limit 5 now) and event 2 (its state only), both caused by the version from 15m.
    assert sorted(fixed) == [(1, 1), (2, 1)]
    assert state(fixed[(1, 1)]) == (2, 5.0, 3.0, 5.0) and fixed[(1, 1)]["limit"] == 5.0
    assert state(fixed[(2, 1)]) == (3, 5.0, round(8 / 3, 9), 2.0) and fixed[(2, 1)]["limit"] == 2.0
    assert {r["_cause"]["valid_from"] for r in fixed.values()} == {T0 + 15 * MIN}
    assert [state(r) for r in second if r[KIND] == "event"] == [(4, 5.0, 2.5, 2.0)]  # from the refolded state
    # The second late version: event 0 corrected, every later event of device 1 a correction of its state.
    assert sorted((r["_offset"], r["_revision"]) for r in third if r[KIND] == "correction") == [
        (0, 1), (1, 2), (2, 2), (4, 1)]

    latest: dict[int, dict] = {}
    for r in written + second + third + fourth + fifth:
        if r["_offset"] not in latest or r["_revision"] > latest[r["_offset"]]["_revision"]:
            latest[r["_offset"]] = r
    assert {o: (state(r), r["limit"]) for o, r in latest.items()} == {r["_offset"]: (state(r), r["limit"]) for r in want}


def test_an_event_a_call_dead_lettered_counts_in_the_refold_and_gets_no_correction(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call made at every event (``on_error: dead_letter``) failed for device 1's event at 30
    minutes: a dead letter the state counted. A late version then corrects the event at 20 minutes:
    the dead letter is not corrected (no consumer has it as an event), and the state the device goes
    on with holds its limit, as a bucket that had every version from the start has it. A call made
    once per device whose request reads the state's ``limit_max`` is made again at the device's next
    event, with the refolded maximum."""
    import dataclasses

    import pandas as pd
    from pyspark.sql.streaming.tws_tester import TwsTester

    from enrich import packed
    from enrich.calls import step as call_step
    from enrich.calls.config import CallConfig, RetryConfig
    from enrich.calls.step import CallStep
    from enrich.calls.template import Template
    from enrich.columns import ERROR, FLAT, KIND, TS_US
    from enrich.joins.partitioned import partitioned_dim
    from enrich.state.engine import StateSpec
    from enrich.state.processor import DeviceStateProcessor
    from refstream import contract
    from tests.enrich.calls.server import serve
    from tests.enrich.joins.test_partitioned import SCHEMA, make_dim, records, upserts

    batch_id = iter(range(1, 100))
    monkeypatch.setattr(call_step, "_ids", lambda: ("q", next(batch_id)))
    dim = partitioned_dim(0, "devices", "ref.devices", SCHEMA, dataclasses.replace(make_dim().join, time="ts"),
                          inner=False, history=timedelta(days=2))
    c = Corrects(dim.join, ("id",), 3_600_000_000, ("owner", "limit"), dim=0)
    spec = StateSpec("device_id", pa.int64(), TS_US, 10**12, aggregates=(("limit", ("max", "mean"), pa.float64()),),
                     timestamp_type=pa.int64())
    offsets = iter(range(100))

    def versions(*puts: tuple[int, float, int], with_schema: bool = False) -> pa.Table:
        parts = [records(contract.schema_message(SCHEMA), first=99)] if with_schema else []
        times = [T0] if with_schema else []
        for device, limit, minutes in puts:
            parts.append(records(*upserts({"id": device, "owner": "o", "limit": limit}), first=next(offsets)))
            times.append(T0 + minutes * MIN)
        t = pa.concat_tables(parts)
        return (t.append_column("valid_from", pa.array([contract.format_time(w) for w in times]))
                .append_column("timestamp", pa.nulls(t.num_rows, pa.timestamp("us", tz="UTC")))
                .replace_schema_metadata({b"refstream.kind": dim.kind.encode()}))

    def events(rows: list[tuple[int, int]]) -> pa.Table:
        ts = [T0 + m * MIN for m, _ in rows]
        return pa.table({"device_id": pa.array([1] * len(rows), pa.int64()), "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
                         "_error": pa.nulls(len(rows), pa.string()), "_partition": pa.array([0] * len(rows), pa.int32()),
                         "_offset": pa.array([o for _, o in rows], pa.int64()), TS_US: pa.array([us(t) for t in ts], pa.int64())})

    with serve() as service:
        def tester(name: str) -> TwsTester:
            call = CallConfig(name="risk", url=service.url("/score"), retries=RetryConfig(attempts=1),
                              body=Template({"device": "{device_id}"}), response=(("score", "DOUBLE"),),
                              on_error="dead_letter", refresh=timedelta(0))
            quota = CallConfig(name="quota", url=service.url("/score"), retries=RetryConfig(attempts=1),
                               body=Template({"device": "{device_id}", "max": "{state.limit_max}"}),
                               response=(("score", "DOUBLE"),), on_error="null")
            step = CallStep((call, quota), pa.int64(), str(tmp_path / name))
            return TwsTester(DeviceStateProcessor(spec, ("device_id", "ts", "_error", "_partition", "_offset"),
                                                  dims=(dim,), corrected=(c,), calls=step),
                             timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)

        def call(t: TwsTester, *chunks: pa.Table, down: bool = False) -> list[dict]:
            service.down = down
            out = t.testInPandas(3, pd.DataFrame({"_0": [3] * len(chunks), "rows": [to_ipc(x) for x in chunks]}))
            return pa.concat_tables([from_ipc(v) for v in out[packed.ROWS]]).to_pylist()

        live, fresh = tester("live"), tester("fresh")
        got = call(live, versions((1, 1.0, 0), (1, 2.0, 25), with_schema=True), events([(10, 0), (20, 1)]))
        dead = call(live, events([(30, 2)]), down=True)
        assert dead[0][ERROR] == "call risk failed: HTTP 503" and dead[0][FLAT + "events"] == 3
        got += dead + call(live, versions((1, 5.0, 15)), events([(40, 3)]))
        assert [b["max"] for _, b in service.bodies if "max" in b] == [1.0, 5.0]
        want = call(fresh, versions((1, 1.0, 0), (1, 2.0, 25), (1, 5.0, 15), with_schema=True), events([(10, 0), (20, 1)]))
        want += call(fresh, events([(30, 2)]), down=True) + call(fresh, events([(40, 3)]))

    assert sorted((r["_offset"], r["_revision"]) for r in got if r[KIND] == "correction") == [(1, 1)]
    fields = [FLAT + f for f in ("events", "limit_max", "limit_mean")]

    def latest(rows: list[dict]) -> dict[int, tuple]:
        out: dict[int, dict] = {}
        for r in rows:
            if r["_offset"] not in out or r["_revision"] > out[r["_offset"]]["_revision"]:
                out[r["_offset"]] = r
        return {o: tuple(round(r[f], 9) if isinstance(r[f], float) else r[f] for f in fields)
                for o, r in out.items() if r[ERROR] is None}

    assert latest(got) == latest(want) and latest(got)[3] == (4, 5.0, 2.5)


def test_hostile_keys_of_a_partitioned_join_correct_exactly_their_own_events_in_the_bucket() -> None:
    """A partitioned join on a string key, through the processor (PySpark's TwsTester): late versions
    of keys with quotes, a backslash, a newline, a NUL, non-ASCII, JSON of their own, 10,000
    characters and case differences, beside near misses, found by the bucket in its own changelog
    records: exactly their keys' events are corrected (the new site, and ``site: [last]`` folded
    again), each cause naming its exact key."""
    import json

    import pandas as pd
    from pyspark.sql.streaming.tws_tester import TwsTester

    from enrich import packed
    from enrich.columns import FLAT, KIND, TS_US
    from enrich.joins.partitioned import partitioned_dim
    from enrich.state.engine import StateSpec
    from enrich.state.processor import DeviceStateProcessor
    from refstream import contract
    from refstream.contract import Column, DatasetSchema
    from tests.enrich.joins.test_partitioned import records

    schema = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("site", "string")))
    join = JoinSpec("devices", (("device_id", "device_id"),), (pa.string(),), (("site", "site"),), (pa.string(),),
                    "_devices_matched", False, "ts")
    dim = partitioned_dim(0, "devices", "ref.devices", schema, join, inner=False, history=timedelta(days=2))
    c = Corrects(join, ("device_id",), 3_600_000_000, ("site",), dim=0)
    spec = StateSpec("device_id", pa.string(), TS_US, 10**12, aggregates=(("site", ("last",), pa.string()),),
                     timestamp_type=pa.int64())
    t = TwsTester(DeviceStateProcessor(spec, ("device_id", "ts", "_error", "_partition", "_offset"), dims=(dim,),
                                       corrected=(c,)), timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)
    changed = ['a"b', "c\\d", "e\nf", "g\0h", "ünï €", '{"device_id": "x"}', "k" * 10_000, "case"]
    near = ['a"b ', "c\\\\d", "e\rf", "g", "uni €", "x", "k" * 9_999, "Case"]
    devices = changed + near

    def versions(keys: list[str], site: str, when: object, first: int, with_schema: bool = False) -> pa.Table:
        ms = ([contract.schema_message(schema)] if with_schema else []) + list(
            contract.upsert_messages(schema, [{"device_id": d, "site": site} for d in keys], 1))
        r = records(*ms, first=first)
        return (r.append_column("valid_from", pa.array([contract.format_time(when)] * r.num_rows))  # type: ignore[arg-type]
                .append_column("timestamp", pa.nulls(r.num_rows, pa.timestamp("us", tz="UTC")))
                .replace_schema_metadata({b"refstream.kind": dim.kind.encode()}))

    def call(*chunks: pa.Table) -> list[dict]:
        out = t.testInPandas(3, pd.DataFrame({"_0": [3] * len(chunks), "rows": [to_ipc(x) for x in chunks]}))
        return pa.concat_tables([from_ipc(v) for v in out[packed.ROWS]]).to_pylist()

    ts = T0 + 20 * MIN
    evs = pa.table({"device_id": devices, "ts": pa.array([ts] * len(devices), pa.timestamp("us", tz="UTC")),
                    "_error": pa.nulls(len(devices), pa.string()), "_partition": pa.array([0] * len(devices), pa.int32()),
                    "_offset": pa.array(range(len(devices)), pa.int64()),
                    TS_US: pa.array([us(ts)] * len(devices), pa.int64())})
    written = call(versions(devices, "s-2", T0, 0, with_schema=True), evs)
    assert {r["site"] for r in written} == {"s-2"}
    got = [r for r in call(versions(changed, "s-6", T0 + 10 * MIN, 100)) if r[KIND] == "correction"]
    assert sorted(r["_offset"] for r in got) == list(range(len(changed)))
    for r in got:
        assert r["device_id"] == changed[r["_offset"]]
        assert (r["site"], r[FLAT + "site_last"], r["_revision"]) == ("s-6", "s-6", 1)
        assert json.loads(r["_cause"]["key"]) == {"device_id": changed[r["_offset"]]}


def test_a_rollup_window_the_horizons_start_falls_in_is_moved_with_its_older_events_as_written() -> None:
    """A rollup by site (5-minute windows, ``moves``) over a corrected partitioned join with a
    15-minute horizon, through the state step (PySpark's TwsTester): the watermark at T0 + 19m puts
    the horizon's start at 4m, inside the window [0, 5m). A late version moves device 1 to s-6 as of
    2m: its events at 4.5m and 19m are corrected, the one at 3m (behind the horizon) is not, and the
    bucket's move starts at that window: it counts the 4.5m event at s-6 and the 3m one at s-2, as
    written. In a fresh bucket, the same events are corrected at a watermark of 10m (all three to
    s-6), then at 19m a version from 4m moves the later two to s-7: the window's move counts the 3m
    event at s-6, as its last correction wrote it, not as first written."""
    import pandas as pd
    from pyspark.sql.streaming.tws_tester import TwsTester

    from enrich.columns import KIND, PACK_KIND, ROWS, TS_US
    from enrich.joins.partitioned import partitioned_dim
    from enrich.rollups import engine as rollup_engine
    from enrich.rollups.spec import RollupSpec
    from enrich.state.engine import StateSpec
    from enrich.state.processor import DeviceStateProcessor
    from refstream import contract
    from refstream.contract import Column, DatasetSchema
    from tests.enrich.joins.test_partitioned import records

    schema = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("site", "string")))
    join = JoinSpec("devices", (("device_id", "device_id"),), (pa.string(),), (("site", "site"),), (pa.string(),),
                    "_devices_matched", False, "ts")
    dim = partitioned_dim(0, "devices", "ref.devices", schema, join, inner=False, history=timedelta(days=2))
    c = Corrects(join, ("device_id",), 15 * 60_000_000, ("site",), dim=0)
    rollup = RollupSpec(name="by_site", by=("site",), by_types=(pa.string(),), window_us=5 * 60_000_000,
                        correct_for_us=60 * 60_000_000, metrics=(("temp", ("max",), pa.float64()),), moves=True)
    spec = StateSpec("device_id", pa.string(), TS_US, 10**12, timestamp_type=pa.int64())
    t = TwsTester(DeviceStateProcessor(spec, ("device_id", "ts", "temp", "_error", "_partition", "_offset"), dims=(dim,),
                                       corrected=(c,), rollups=(rollup,), rollup_ids=(5,)),
                  timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)

    def versions(site: str, when: object, first: int, with_schema: bool = False) -> pa.Table:
        ms = ([contract.schema_message(schema)] if with_schema else []) + list(
            contract.upsert_messages(schema, [{"device_id": "d1", "site": site}], 1))
        r = records(*ms, first=first)
        return (r.append_column("valid_from", pa.array([contract.format_time(when)] * r.num_rows))  # type: ignore[arg-type]
                .append_column("timestamp", pa.nulls(r.num_rows, pa.timestamp("us", tz="UTC")))
                .replace_schema_metadata({b"refstream.kind": dim.kind.encode()}))

    def events(rows: list[tuple[float, float, int]]) -> pa.Table:
        ts = [T0 + timedelta(minutes=m) for m, _, _ in rows]
        return pa.table({"device_id": ["d1"] * len(rows), "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
                         "temp": pa.array([x for _, x, _ in rows], pa.float64()),
                         "_error": pa.nulls(len(rows), pa.string()), "_partition": pa.array([0] * len(rows), pa.int32()),
                         "_offset": pa.array([o for _, _, o in rows], pa.int64()),
                         TS_US: pa.array([us(x) for x in ts], pa.int64())})

    def call(*chunks: pa.Table) -> pd.DataFrame:
        return t.testInPandas(3, pd.DataFrame({"_0": [3] * len(chunks), "rows": [to_ipc(x) for x in chunks]}))

    call(versions("s-2", T0, 0, with_schema=True), events([(3, 30.0, 0), (4.5, 45.0, 1), (19, 19.0, 2)]))
    t.setWatermark(us(T0 + 19 * MIN) // 1000)
    out = call(versions("s-6", T0 + 2 * MIN, 10))
    fixed = [r for kind, v in zip(out[PACK_KIND], out[ROWS], strict=True) if kind == "events"
             for r in from_ipc(v).to_pylist() if r[KIND] == "correction"]
    assert [(r["_offset"], r["site"]) for r in fixed] == [(1, "s-6"), (2, "s-6")]
    moved = [from_ipc(v) for kind, v in zip(out[PACK_KIND], out[ROWS], strict=True) if kind.startswith("move:")]
    assert len(moved) == 1
    meta = moved[0].schema.metadata
    assert (int(meta[rollup_engine.MOVE_LO]), int(meta[rollup_engine.MOVE_HI])) == (us(T0), us(T0 + 20 * MIN))
    assert sorted((r["window_start"] - us(T0), r["site"], r["_events"], r["temp.max"]) for r in moved[0].to_pylist()) == [
        (0, "s-2", 1, 30.0), (0, "s-6", 1, 45.0), (15 * 60_000_000, "s-6", 1, 19.0)]

    # A fresh bucket: the 3m event corrected once within the horizon, then left behind it.
    t = TwsTester(DeviceStateProcessor(spec, ("device_id", "ts", "temp", "_error", "_partition", "_offset"), dims=(dim,),
                                       corrected=(c,), rollups=(rollup,), rollup_ids=(5,)),
                  timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)
    call(versions("s-2", T0, 0, with_schema=True), events([(3, 30.0, 0), (4.5, 45.0, 1), (19, 19.0, 2)]))
    t.setWatermark(us(T0 + 10 * MIN) // 1000)
    call(versions("s-6", T0 + 2 * MIN, 10))
    t.setWatermark(us(T0 + 19 * MIN) // 1000)
    out = call(versions("s-7", T0 + 4 * MIN, 20))
    moved = [from_ipc(v) for kind, v in zip(out[PACK_KIND], out[ROWS], strict=True) if kind.startswith("move:")]
    assert sorted((r["window_start"] - us(T0), r["site"], r["_events"]) for r in moved[0].to_pylist()) == [
        (0, "s-6", 1), (0, "s-7", 1), (15 * 60_000_000, "s-7", 1)]


class LimitMaxBucket:
    """Bucket 3 of the state step (PySpark's TwsTester) with ``limit: [max]`` over a corrected
    partitioned join of device 1's versions (``horizon_us``), and its events at ``minutes``."""

    def __init__(self, horizon_us: int, minutes: tuple[int, ...]) -> None:
        import dataclasses

        from pyspark.sql.streaming.tws_tester import TwsTester

        from enrich.columns import TS_US
        from enrich.joins.partitioned import partitioned_dim
        from enrich.state.engine import StateSpec
        from enrich.state.processor import DeviceStateProcessor
        from tests.enrich.joins.test_partitioned import SCHEMA, make_dim

        self.schema = SCHEMA
        self.dim = partitioned_dim(0, "devices", "ref.devices", SCHEMA, dataclasses.replace(make_dim().join, time="ts"),
                                   inner=False, history=timedelta(days=2))
        c = Corrects(self.dim.join, ("id",), horizon_us, ("owner", "limit"), dim=0)
        spec = StateSpec("device_id", pa.int64(), TS_US, 10**12, aggregates=(("limit", ("max",), pa.float64()),),
                         timestamp_type=pa.int64())
        self.tester = TwsTester(DeviceStateProcessor(spec, ("device_id", "ts", "_error", "_partition", "_offset"),
                                                     dims=(self.dim,), corrected=(c,)),
                                timeMode="EventTime", eventTimeExtractor=lambda _: 2**62)
        ts = [T0 + m * MIN for m in minutes]
        n = len(ts)
        self.events = pa.table({"device_id": pa.array([1] * n, pa.int64()), "ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
                                "_error": pa.nulls(n, pa.string()), "_partition": pa.array([0] * n, pa.int32()),
                                "_offset": pa.array(range(n), pa.int64()), TS_US: pa.array([us(x) for x in ts], pa.int64())})

    def version(self, limit: float, minutes: int, first: int, with_schema: bool = False) -> pa.Table:
        """Device 1's version with ``limit`` from ``minutes`` after T0, as the bucket's changelog records."""
        from refstream import contract
        from tests.enrich.joins.test_partitioned import records, upserts

        ms = ([contract.schema_message(self.schema)] if with_schema else []) + upserts({"id": 1, "owner": "o", "limit": limit})
        r = records(*ms, first=first)
        return (r.append_column("valid_from", pa.array([contract.format_time(T0 + minutes * MIN)] * r.num_rows))
                .append_column("timestamp", pa.nulls(r.num_rows, pa.timestamp("us", tz="UTC")))
                .replace_schema_metadata({b"refstream.kind": self.dim.kind.encode()}))

    def call(self, *chunks: pa.Table) -> list[tuple]:
        """One call with ``chunks``: (offset, kind, revision, limit, limit_max) of every row out."""
        import pandas as pd

        from enrich import packed
        from enrich.columns import FLAT, KIND

        out = self.tester.testInPandas(3, pd.DataFrame({"_0": [3] * len(chunks), "rows": [to_ipc(x) for x in chunks]}))
        return [(r["_offset"], r[KIND], r["_revision"], r["limit"], r[FLAT + "limit_max"])
                for v in out[packed.ROWS] for r in from_ipc(v).to_pylist()]


def test_a_refold_keeps_what_an_event_behind_the_horizon_was_last_corrected_to() -> None:
    """``limit: [max]`` over a corrected partitioned join with a 15-minute horizon: at a watermark
    of 10m a version from 2m corrects every event to limit 9; at 19m a version from 8m sets limit 2
    for the later two. The event at 3m is behind the horizon then: the fold keeps its corrected 9
    (not the 1 it was first written with), so the later events' maximum stays 9."""
    b = LimitMaxBucket(15 * 60_000_000, (3, 10, 19))
    assert b.call(b.version(1.0, 0, 0, with_schema=True), b.events) == [(o, "event", 0, 1.0, 1.0) for o in range(3)]
    b.tester.setWatermark(us(T0 + 10 * MIN) // 1000)
    assert b.call(b.version(9.0, 2, 10)) == [(o, "correction", 1, 9.0, 9.0) for o in range(3)]
    b.tester.setWatermark(us(T0 + 19 * MIN) // 1000)
    assert b.call(b.version(2.0, 8, 20)) == [(1, "correction", 2, 2.0, 9.0), (2, "correction", 2, 2.0, 9.0)]


def test_a_later_event_whose_state_a_fold_leaves_as_last_written_gets_no_correction() -> None:
    """``limit: [max]``: events at 10, 20 and 30 minutes. A late version from 28m (limit 9) corrects
    the 30m event (revision 1, maximum 9); then one from 15m (limit 5) corrects the 20m event: the
    30m event's maximum stays 9, as its last correction wrote it, so it gets no correction again."""
    b = LimitMaxBucket(3_600_000_000, (10, 20, 30))
    assert b.call(b.version(1.0, 0, 0, with_schema=True), b.events) == [
        (0, "event", 0, 1.0, 1.0), (1, "event", 0, 1.0, 1.0), (2, "event", 0, 1.0, 1.0)]
    assert b.call(b.version(9.0, 28, 10)) == [(2, "correction", 1, 9.0, 9.0)]
    assert b.call(b.version(5.0, 15, 20)) == [(1, "correction", 1, 5.0, 5.0)]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_each_kept_row_meets_the_change_of_its_key_whose_span_holds_its_time(data: st.DataObject) -> None:
    """``_pairs`` (a scan of each key's changes, and one search over every key at once) against a
    scan of every (row, change) pair: keys with several changes, in any order, whose spans touch or
    leave gaps, rows on and beside the spans' bounds, null keys on either side, keys of rows that no
    change has."""
    import numpy as np
    import pandas as pd

    from enrich.state.corrections import _by_key, _codes, _pairs

    def _hits(log_keys: np.ndarray, log_nulls: np.ndarray, ts: np.ndarray, ch_keys: np.ndarray,
              ch_nulls: np.ndarray, start: np.ndarray, end: np.ndarray, scan_most: int) -> tuple[np.ndarray, np.ndarray]:
        index = pd.Index(pd.unique(ch_keys), dtype=object)  # as prepare() and match() code them
        c_code = _codes(index, ch_keys, ch_nulls, -2)
        return _pairs(_codes(index, log_keys, log_nulls, -3), ts, c_code, start, end,
                      _by_key(c_code, start, len(index)), scan_most)

    keys = ["a", "b", "c", "d"]
    rarely = st.sampled_from([False, False, False, True])  # a null key
    changes: list[tuple[str, int, int, bool]] = []
    for k in keys[:3]:
        bounds = sorted(data.draw(st.sets(st.integers(0, 40), max_size=5), label=f"bounds {k}"))
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            if data.draw(st.booleans(), label="kept"):
                changes.append((k, lo, hi, data.draw(rarely, label="null")))
    changes = data.draw(st.permutations(changes), label="changes in any order")
    # Row times on a span's bounds and beside them as often as anywhere.
    near = sorted({b + d for _, lo, hi, _ in changes for b in (lo, hi) for d in (-1, 0, 1) if b + d >= 0})
    times = st.integers(0, 45) | st.sampled_from(near) | st.sampled_from(near) if near else st.integers(0, 45)
    rows = data.draw(st.lists(st.tuples(st.sampled_from(keys), times, rarely), max_size=30))
    # Keys as the joins give them (enrich.joins.event_keys): strings as objects, integers as int64.
    as_ints = data.draw(st.booleans(), label="integer keys")
    coded = {k: (np.int64(2**62 + i) if as_ints else k) for i, k in enumerate(keys)}

    def key_array(ks: list[str]) -> np.ndarray:
        return np.array([coded[k] for k in ks], np.int64 if as_ints else object)

    want = sorted((i, j) for i, (k, t, null) in enumerate(rows) for j, (ck, lo, hi, cnull) in enumerate(changes)
                  if not null and not cnull and k == ck and lo <= t < hi)
    # Both ways of matching: a scan of each key's few changes (8), and the search for keys with more (0).
    for scan_most in (0, 8):
        got_rows, got_found = _hits(key_array([k for k, _, _ in rows]), np.array([n for _, _, n in rows], bool),
                                    np.array([t for _, t, _ in rows], np.int64),
                                    key_array([k for k, _, _, _ in changes]),
                                    np.array([n for _, _, _, n in changes], bool),
                                    np.array([lo for _, lo, _, _ in changes], np.int64),
                                    np.array([hi for _, _, hi, _ in changes], np.int64), scan_most)
        assert sorted(zip(got_rows.tolist(), got_found.tolist(), strict=True)) == want, f"scan_most={scan_most}"

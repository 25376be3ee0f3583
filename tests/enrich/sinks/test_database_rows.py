"""A task's rows for write: events with corrections (enrich.sinks.database.sink.SlotRows): a correction
replaces its event's row, two of one event in a batch leave the later one, and corrections are not
counted as events. Pure logic."""

from __future__ import annotations

import pyarrow as pa

from enrich.columns import IDENTITY
from enrich.sinks.database.sink import TOPIC_ID, SlotRows, latest_per_key
from enrich.sinks.database.tables import TableSpec

NAMES = ("n", "_topic", TOPIC_ID, "_partition", "_offset", "_kind", "_revision", "_late")
SPEC = TableSpec("postgresql://u@h/d", "postgresql", "t", "t_commits", tuple((n, "TEXT") for n in NAMES),
                 ("_topic", TOPIC_ID, "_partition", "_offset"), 5.0)


def rows(items: list[tuple[int, int, str, int, bool]]) -> pa.Table:
    """(n, offset, kind, revision, late)."""
    return pa.table({"n": [i[0] for i in items], "_topic": ["e"] * len(items), TOPIC_ID: ["id"] * len(items),
                     "_partition": pa.array([0] * len(items), pa.int32()),
                     "_offset": pa.array([i[1] for i in items], pa.int64()), "_kind": [i[2] for i in items],
                     "_revision": pa.array([i[3] for i in items], pa.int32()), "_late": [i[4] for i in items]})


def test_two_corrections_of_one_event_leave_the_later_and_count_no_event() -> None:
    t = rows([(1, 0, "event", 0, True), (2, 1, "correction", 1, True), (2, 1, "correction", 2, False),
              (3, 2, "correction", 1, False)])
    out, events, late = SlotRows(SPEC, None, True).table([t])
    assert (events, late) == (1, 1)
    assert sorted(zip(out.column("n").to_pylist(), out.column("_revision").to_pylist(), strict=True)) == [
        (1, 0), (2, 2), (3, 1)]


def test_the_latest_revision_per_key_of_several_columns() -> None:
    t = rows([(1, 5, "correction", 1, False), (1, 5, "correction", 3, False), (1, 5, "correction", 2, False),
              (2, 6, "event", 0, False)])
    got = latest_per_key(t, ("_topic", TOPIC_ID, "_partition", "_offset"), "_revision")
    assert sorted(zip(got.column("_offset").to_pylist(), got.column("_revision").to_pylist(), strict=True)) == [
        (5, 3), (6, 0)]


def test_write_state_keeps_a_devices_latest_event_and_each_corrected_events_latest_revision() -> None:
    """write: state with corrections: per device the event with the greatest count, and every
    corrected event's latest revision (which of them the row holds is the database's to say: a
    device that expired and came back counts from 1 again); corrections count as no event."""
    spec = TableSpec("postgresql://u@h/d", "postgresql", "t", "t_commits",
                     tuple((n, "TEXT") for n in ("device_id", "events", "_topic", "_partition", "_offset", "_kind",
                                                 "_revision")), ("device_id",), 5.0, IDENTITY)
    items = [("a", 7, 30, "event", 0), ("a", 5, 20, "correction", 1), ("a", 6, 25, "correction", 1),
             ("a", 6, 25, "correction", 2), ("b", 3, 12, "correction", 1), ("c", None, 40, "event", 0)]
    t = pa.table({"device_id": [i[0] for i in items], "events": pa.array([i[1] for i in items], pa.int64()),
                  "_topic": ["e"] * len(items), "_partition": pa.array([0] * len(items), pa.int32()),
                  "_offset": pa.array([i[2] for i in items], pa.int64()), "_kind": [i[3] for i in items],
                  "_revision": pa.array([i[4] for i in items], pa.int32())})
    out, events, _ = SlotRows(spec, "device_id", False).table([t])
    assert events == 2  # a's event, and c's (late: no state, no row)
    assert sorted(zip(out.column("device_id").to_pylist(), out.column("_offset").to_pylist(),
                      out.column("_kind").to_pylist(), out.column("_revision").to_pylist(), strict=True)) == [
        ("a", 20, "correction", 1), ("a", 25, "correction", 2), ("a", 30, "event", 0), ("b", 12, "correction", 1)]

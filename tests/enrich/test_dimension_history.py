"""An as-of dimension's versions on the driver (enrich.dimension.history): pruning to the history,
and the state applied from changelog records. Pure logic, no broker."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa

from enrich.columns import DELETED, KEY_BYTES, VALID_FROM
from enrich.dimension.abc import Record
from enrich.dimension.history import HistoryState, micros_of, prune
from refstream import contract
from refstream.contract import Column, DatasetSchema

T0 = datetime(2026, 1, 1, tzinfo=UTC)
DAY = timedelta(days=1)
SCHEMA = DatasetSchema("devices", ("id",), (Column("id", "int64"), Column("owner", "string")))


def table(rows: list[tuple[str, str, float]]) -> pa.Table:
    """(key, value, days after T0) in changelog order."""
    return pa.table({KEY_BYTES: pa.array([k.encode() for k, _, _ in rows], pa.binary()),
                     "v": [v for _, v, _ in rows],
                     VALID_FROM: pa.array([micros_of(T0 + d * DAY) for _, _, d in rows], pa.int64())})


def kept(t: pa.Table) -> list[tuple[str, str]]:
    return list(zip([k.decode() for k in t.column(KEY_BYTES).to_pylist()], t.column("v").to_pylist(), strict=True))


def test_a_key_keeps_the_versions_of_its_window_and_the_one_valid_at_the_cut() -> None:
    t = table([("a", "a0", 0), ("a", "a1", 1), ("b", "b0", 0), ("a", "a2", 5), ("a", "a3", 9), ("a", "a4", 10),
               ("c", "c0", 0)])
    # a's newest is day 10, the cut day 7: a2 (valid from day 5 until day 9) holds at the cut.
    assert kept(prune(t, 3 * DAY)) == [("a", "a2"), ("a", "a3"), ("a", "a4"), ("b", "b0"), ("c", "c0")]
    assert kept(prune(t, 30 * DAY)) == [("a", "a0"), ("a", "a1"), ("a", "a2"), ("a", "a3"), ("a", "a4"),
                                        ("b", "b0"), ("c", "c0")]


def test_a_version_replaced_exactly_at_the_cut_goes_and_equal_times_keep_the_last() -> None:
    t = table([("a", "a0", 0), ("a", "a1", 7), ("a", "a1-again", 7), ("a", "a2", 10)])
    assert kept(prune(t, 3 * DAY)) == [("a", "a1-again"), ("a", "a2")]


def test_out_of_order_times_are_sorted_and_the_newest_time_counts() -> None:
    t = table([("a", "late", 10), ("a", "early", 2), ("a", "mid", 8)])
    assert kept(prune(t, DAY)) == [("a", "mid"), ("a", "late")]  # mid holds at the cut, day 9
    assert kept(prune(t, 9 * DAY)) == [("a", "early"), ("a", "mid"), ("a", "late")]


def record(offset: int, key: bytes, value: bytes | None, headers: list[tuple[str, bytes]],
           timestamp_ms: int | None = None) -> Record:
    return Record(0, offset, key, value, headers, timestamp_ms)


def changes(offset: int, rows: list[dict[str, object]], at: datetime, deletes: list[dict[str, object]] = ()
            ) -> list[Record]:  # type: ignore[assignment]
    out = [contract.upsert_messages(SCHEMA, rows, 1, valid_from=at)]
    if deletes:
        out.append(contract.delete_messages(SCHEMA, deletes, 1, valid_from=at))
    return [record(offset + i, m.key, m.value, m.headers) for i, m in enumerate(x for it in out for x in it)]


def test_the_state_keeps_versions_with_tombstones_and_ships_base_and_changes() -> None:
    state = HistoryState("devices", 2 * DAY, compact_min=2)
    schema = contract.schema_message(SCHEMA)
    state.apply([record(0, schema.key, schema.value, schema.headers)])
    state.apply(changes(1, [{"id": 1, "owner": "x"}, {"id": 2, "owner": "y"}], T0))
    snap = state.snapshot(["owner"])
    assert snap.overlay is None  # the first snapshot compacts: everything in the base
    assert snap.base.column_names == ["id", "owner", VALID_FROM, DELETED]
    state.apply(changes(3, [{"id": 1, "owner": "x2"}], T0 + DAY, deletes=[{"id": 2}]))
    snap = state.snapshot(["owner"])
    assert snap.overlay is not None and snap.overlay.column("owner").to_pylist() == ["x2", None]
    assert snap.overlay.column("id").to_pylist() == [1, 2] and snap.overlay.column(DELETED).to_pylist() == [False, True]
    assert state.live_rows() == 1
    state.apply(changes(5, [{"id": 1, "owner": "x3"}], T0 + 5 * DAY))
    state.compact()  # 1's newest is day 5: x (day 0) and x2 (day 1, valid until day 5 > cut day 3) ... x2 stays
    assert state.base is not None
    got = sorted(zip(state.base.column("id").to_pylist(), state.base.column("owner").to_pylist(),
                     state.base.column(DELETED).to_pylist(), strict=True), key=lambda r: (r[0], str(r[1])))
    assert got == [(1, "x2", False), (1, "x3", False), (2, None, True), (2, "y", False)]


def test_a_record_without_valid_from_is_valid_from_its_publish_time() -> None:
    state = HistoryState("devices", DAY)
    schema = contract.schema_message(SCHEMA)
    msg = next(contract.upsert_messages(SCHEMA, [{"id": 1, "owner": "x"}], 1))
    at_ms = int(T0.timestamp() * 1000)
    state.apply([record(0, schema.key, schema.value, schema.headers), record(1, msg.key, msg.value, msg.headers, at_ms)])
    assert state.snapshot().base.column(VALID_FROM).to_pylist() == [at_ms * 1000]


def test_live_rows_counts_the_keys_whose_newest_version_is_a_row() -> None:
    import random

    rng = random.Random(4)
    state = HistoryState("devices", 3 * DAY, compact_min=5, compact_fraction=0.5)
    schema = contract.schema_message(SCHEMA)
    state.apply([record(0, schema.key, schema.value, schema.headers)])
    newest: dict[int, tuple[float, bool]] = {}
    offset = 1
    for _ in range(30):
        day = rng.uniform(0, 10)
        ups = [{"id": rng.randint(1, 12), "owner": "x"} for _ in range(rng.randint(0, 3))]
        dels = [{"id": rng.randint(1, 12)} for _ in range(rng.randint(0, 2))]
        batch = changes(offset, ups, T0 + day * DAY, deletes=dels)
        offset += len(batch)
        state.apply(batch)
        for r in ups:
            if day >= newest.get(r["id"], (-1.0, False))[0]:
                newest[r["id"]] = (day, False)
        for r in dels:
            if day >= newest.get(r["id"], (-1.0, False))[0]:
                newest[r["id"]] = (day, True)
        if rng.random() < 0.3:
            state.snapshot()  # compacts now and then
        assert state.live_rows() == sum(1 for _, gone in newest.values() if not gone)

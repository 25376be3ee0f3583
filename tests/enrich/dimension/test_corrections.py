"""Which of a batch's new as-of versions correct events already written (enrich.dimension.corrections),
from the driver's real version state (enrich.dimension.history) fed changelog records. Pure logic."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa

from enrich.columns import KEY_BYTES
from enrich.dimension.abc import Record
from enrich.dimension.corrections import NO_BOUND_END, NO_BOUND_START, changes
from enrich.dimension.history import HistoryState, micros_of
from refstream import contract
from refstream.contract import Column, DatasetSchema

T0 = datetime(2026, 1, 1, 9, tzinfo=UTC)
MIN = timedelta(minutes=1)
SCHEMA = DatasetSchema("devices", ("device_id",),
                       (Column("device_id", "string"), Column("site_id", "string"), Column("note", "string")))


class Log:
    """A changelog of SCHEMA fed to a HistoryState, one batch at a time."""

    def __init__(self, compact_min: int = 10_000) -> None:
        self.state = HistoryState("devices", timedelta(days=2), compact_min=compact_min)
        self.offset = 0
        schema = contract.schema_message(SCHEMA)
        self._apply([(schema.key, schema.value, schema.headers)])

    def _apply(self, msgs: list[tuple[bytes, bytes | None, object]]) -> None:
        recs = [Record(0, self.offset + i, k, v, h) for i, (k, v, h) in enumerate(msgs)]  # type: ignore[arg-type]
        self.offset += len(recs)
        self.state.apply(recs)

    def put(self, at: datetime, rows: list[dict[str, object]] = (), deletes: list[str] = ()) -> None:  # type: ignore[assignment]
        msgs = [(m.key, m.value, m.headers) for m in contract.upsert_messages(SCHEMA, rows, 1, valid_from=at)]
        msgs += [(m.key, m.value, m.headers) for m in contract.delete_messages(
            SCHEMA, [{"device_id": d} for d in deletes], 1, valid_from=at)]
        self._apply(msgs)

    def batch(self, horizon_start: datetime = T0 - timedelta(days=1), *puts: tuple) -> pa.Table:  # type: ignore[type-arg]
        self.state.begin_journal()
        for p in puts:
            self.put(*p)
        entries, new, old = self.state.end_journal()
        assert new is not None
        return changes(entries, new, old, ("device_id",), ("site_id",), micros_of(horizon_start))


def rows(t: pa.Table) -> list[tuple[object, ...]]:
    return list(zip(t.column("device_id").to_pylist(), t.column("valid_from").to_pylist(), t.column("start").to_pylist(),
                    t.column("end").to_pylist(), t.column("result").to_pylist(), strict=True))


def us(t: datetime) -> int:
    return micros_of(t)


def test_a_backdated_move_corrects_the_events_from_its_time_on() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}, {"device_id": "d2", "site_id": "s-2"}])
    at = T0 + 60 * MIN
    got = log.batch(T0 - timedelta(days=1), (at, [{"device_id": "d1", "site_id": "s-6"}]))
    assert rows(got) == [("d1", us(at), us(at), NO_BOUND_END, "corrected")]
    assert got.column("partition").to_pylist() == [0] and got.column("offset").to_pylist() == [3]


def test_a_version_whose_joined_columns_equal_the_one_before_changes_nothing() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2", "note": "a"}])
    got = log.batch(T0, (T0 + 10 * MIN, [{"device_id": "d1", "site_id": "s-2", "note": "b"}]))
    assert rows(got) == [("d1", us(T0 + 10 * MIN), us(T0 + 10 * MIN), NO_BOUND_END, "unchanged")]


def test_a_delete_is_a_change_and_two_versions_of_a_key_split_its_time() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}])
    a, b = T0 + 10 * MIN, T0 + 20 * MIN
    got = log.batch(T0, (b, [{"device_id": "d1", "site_id": "s-6"}]), (a, [], ["d1"]))
    # Each covers its own span: the delete until the move, the move from then on.
    assert rows(got) == [("d1", us(b), us(b), NO_BOUND_END, "corrected"), ("d1", us(a), us(a), us(b), "corrected")]


def test_a_version_older_than_every_other_covers_the_clipped_events_before_it() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}])
    got = log.batch(T0 - timedelta(hours=5), (T0 - 60 * MIN, [{"device_id": "d1", "site_id": "s-1"}]))
    # Its time is within the horizon: what it covers before it is the clipped events, kept or not.
    assert rows(got) == [("d1", us(T0 - 60 * MIN), NO_BOUND_START, us(T0), "corrected")]


def test_a_change_reaching_before_the_horizon_is_counted_beyond_it() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}])
    got = log.batch(T0 + 30 * MIN, (T0 + 10 * MIN, [{"device_id": "d1", "site_id": "s-3"}]))
    assert rows(got)[0][-1] == "beyond_horizon"


def test_the_last_of_a_keys_records_with_one_time_is_its_version() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}])
    at = T0 + 5 * MIN
    got = log.batch(T0, (at, [{"device_id": "d1", "site_id": "s-4"}]), (at, [{"device_id": "d1", "site_id": "s-2"}]))
    assert rows(got) == [("d1", us(at), us(at), NO_BOUND_END, "unchanged")]  # s-2 again: as written
    assert got.column("offset").to_pylist() == [3]


def test_a_version_replaced_at_its_own_time_is_compared_with_what_it_was() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}])
    log.put(T0 + 10 * MIN, [{"device_id": "d1", "site_id": "s-3"}])
    # A data-entry fix: the same valid_from, another site. Events from 9:10 had s-3; now s-2.
    got = log.batch(T0, (T0 + 10 * MIN, [{"device_id": "d1", "site_id": "s-2"}]))
    assert rows(got) == [("d1", us(T0 + 10 * MIN), us(T0 + 10 * MIN), NO_BOUND_END, "corrected")]


def test_before_a_compaction_hides_the_state_every_version_is_a_change() -> None:
    log = Log(compact_min=1)
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}])
    log.state.begin_journal()
    log.put(T0 + MIN, [{"device_id": "d1", "site_id": "s-2"}])
    log.state.compact()
    entries, new, old = log.state.end_journal()
    assert old is None and new is not None
    got = changes(entries, new, old, ("device_id",), ("site_id",), us(T0))
    assert rows(got) == [("d1", us(T0 + MIN), us(T0 + MIN), NO_BOUND_END, "corrected")]


def test_a_batch_without_versions_has_no_changes() -> None:
    log = Log()
    log.state.begin_journal()
    assert log.state.end_journal() == ([], None, None)


def test_a_version_after_every_event_seen_is_timely_and_corrects_nothing() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}])
    log.state.begin_journal()
    log.put(T0 + 30 * MIN, [{"device_id": "d1", "site_id": "s-3"}])   # after every event seen: on time
    log.put(T0 + 5 * MIN, [{"device_id": "d2", "site_id": "s-3"}])    # a new key: earlier events clip to it
    entries, new, old = log.state.end_journal()
    assert new is not None
    got = changes(entries, new, old, ("device_id",), ("site_id",), us(T0 - timedelta(days=1)), us(T0 + 10 * MIN))
    assert rows(got) == [("d1", us(T0 + 30 * MIN), us(T0 + 30 * MIN), NO_BOUND_END, "timely"),
                         ("d2", us(T0 + 5 * MIN), NO_BOUND_START, NO_BOUND_END, "corrected")]


def test_a_pin_tried_again_keeps_the_versions_its_first_attempt_applied() -> None:
    log = Log()
    log.put(T0, [{"device_id": "d1", "site_id": "s-2"}])
    log.state.begin_journal()
    log.put(T0 + MIN, [{"device_id": "d1", "site_id": "s-3"}])
    log.state.end_journal(close=False)          # the attempt fails after this
    log.state.begin_journal()                   # the retry: goes on
    log.put(T0 + 2 * MIN, [{"device_id": "d2", "site_id": "s-3"}])
    entries, _, old = log.state.end_journal()
    assert [e.key for e in entries] == [b'{"device_id":"d1"}', b'{"device_id":"d2"}'] and old is not None
    log.state.begin_journal()
    assert log.state.end_journal()[0] == []


def test_nan_in_a_joined_column_is_equal_to_nan() -> None:
    from enrich.dimension.corrections import _equal

    assert _equal(float("nan"), float("nan")) and _equal(1.0, 1.0) and not _equal(1.0, float("nan"))


def test_hostile_keys_each_get_their_own_change_named_by_their_exact_key() -> None:
    """Keys with quotes, a backslash, a newline, a NUL, non-ASCII, JSON of their own, 10,000
    characters, and two that differ only in case: each late version is its own change, its key
    bytes the changelog's, which give the exact key back."""
    import json

    hostile = ['a"b', "c\\d", "e\nf", "g\0h", "ünï €", '{"device_id": "x"}', "k" * 10_000, "Case", "case"]
    log = Log()
    log.put(T0, [{"device_id": d, "site_id": "s-2"} for d in hostile])
    at = T0 + 30 * MIN
    got = log.batch(T0 - timedelta(days=1), (at, [{"device_id": d, "site_id": "s-6"} for d in hostile]))
    assert got.column("device_id").to_pylist() == hostile
    assert set(got.column("result").to_pylist()) == {"corrected"}
    assert [json.loads(k)["device_id"] for k in got.column(KEY_BYTES).to_pylist()] == hostile

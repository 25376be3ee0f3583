"""Pure logic of change detection (Arrow tables built in the test; no services needed)."""

from __future__ import annotations

import itertools
import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pyarrow as pa
import pytest

from refresh.diff import check_keys, diff, normalize, upsert_into, within
from refresh.errors import DuplicateKey
from refresh.stores.abc import with_valid_from
from refstream.contract import TIME_TYPE
from refstream.errors import DataError


def t(rows: list[dict], schema: pa.Schema | None = None) -> pa.Table:
    return normalize(pa.Table.from_pylist(rows, schema=schema))


def keyset(table: pa.Table, key: list[str]) -> set[tuple]:
    return {tuple(r[k] for k in key) for r in table.select(key).to_pylist()}


def test_inserts_updates_deletes_and_unchanged_rows_are_not_sent() -> None:
    old = t([{"id": 1, "v": "a"}, {"id": 2, "v": "b"}, {"id": 3, "v": "c"}])
    new = t([{"id": 2, "v": "b"}, {"id": 3, "v": "C"}, {"id": 4, "v": "d"}])
    ch = diff("ds", old, new, ["id"])
    assert (ch.inserts, ch.updates, ch.delete_count) == (1, 1, 1)
    assert sorted(ch.upserts.to_pylist(), key=lambda r: r["id"]) == [{"id": 3, "v": "C"}, {"id": 4, "v": "d"}]
    assert ch.deletes.to_pylist() == [{"id": 1}]


def test_composite_key_and_key_change_is_delete_plus_insert() -> None:
    old = t([{"a": "x", "b": 1, "v": 1.0}, {"a": "x", "b": 2, "v": 2.0}])
    new = t([{"a": "x", "b": 1, "v": 1.0}, {"a": "y", "b": 2, "v": 2.0}])  # key of the second row changed
    ch = diff("ds", old, new, ["a", "b"])
    assert ch.deletes.to_pylist() == [{"a": "x", "b": 2}]
    assert ch.upserts.to_pylist() == [{"a": "y", "b": 2, "v": 2.0}]
    assert (ch.inserts, ch.updates) == (1, 0)


def test_nulls_and_nans_compare_equal_to_themselves_but_not_to_values() -> None:
    old = t([{"id": 1, "f": None, "g": math.nan}, {"id": 2, "f": 1.0, "g": 1.0}, {"id": 3, "f": None, "g": 0.0}])
    new = t([{"id": 1, "f": None, "g": math.nan}, {"id": 2, "f": None, "g": 1.0}, {"id": 3, "f": 2.0, "g": 0.0}])
    ch = diff("ds", old, new, ["id"])
    assert sorted(r["id"] for r in ch.upserts.to_pylist()) == [2, 3]


def test_every_column_type_is_compared() -> None:
    import datetime as dt

    schema = pa.schema([("id", pa.int32()), ("d", pa.decimal128(12, 4)), ("day", pa.date32()),
                        ("ts", pa.timestamp("s")), ("b", pa.binary()), ("s", pa.large_string())])
    base = {"id": 1, "d": Decimal("1.2345"), "day": dt.date(2024, 5, 1),
            "ts": dt.datetime(2024, 5, 1, 12), "b": b"\x00\x01", "s": "ü"}
    old = t([base], schema)
    assert old.schema.field("id").type == pa.int64() and old.schema.field("s").type == pa.string()
    assert not diff("ds", old, t([base], schema), ["id"])
    for col, value in [("d", Decimal("1.2346")), ("day", dt.date(2024, 5, 2)),
                       ("ts", dt.datetime(2024, 5, 1, 12, 0, 1)), ("b", b"\x00"), ("s", "u")]:
        ch = diff("ds", old, t([{**base, col: value}], schema), ["id"])
        assert ch.updates == 1, col


def test_first_run_sends_everything_and_full_republishes_unchanged_rows() -> None:
    rows = t([{"id": 1, "v": "a"}, {"id": 2, "v": "b"}])
    first = diff("ds", None, rows, ["id"])
    assert (first.inserts, first.messages) == (2, 2)
    full = diff("ds", rows, rows, ["id"], republish_all=True)
    assert (full.inserts, full.updates, full.delete_count, full.upserts.num_rows) == (0, 0, 0, 2)


def test_schema_change_republishes_matched_rows() -> None:
    old = t([{"id": 1, "v": "a"}, {"id": 2, "v": "b"}])
    new = t([{"id": 1, "v": "a", "extra": 5}, {"id": 3, "v": "c", "extra": 6}])
    ch = diff("ds", old, new, ["id"])
    assert (ch.inserts, ch.updates, ch.delete_count) == (1, 1, 1)
    assert keyset(ch.upserts, ["id"]) == {(1,), (3,)}


def test_retyped_key_column_deletes_every_old_key() -> None:
    old = t([{"id": 1, "v": "a"}])
    new = t([{"id": "1", "v": "a"}])
    ch = diff("ds", old, new, ["id"])
    assert ch.deletes.to_pylist() == [{"id": 1}]
    assert ch.upserts.to_pylist() == [{"id": "1", "v": "a"}]


def test_duplicate_keys_are_refused_naming_the_key() -> None:
    rows = t([{"a": "x", "b": 1}, {"a": "x", "b": 2}, {"a": "x", "b": 1}])
    with pytest.raises(DuplicateKey, match=r'dataset ds: duplicate key \{"a":"x","b":1\} \(2 rows'):
        check_keys("ds", rows, ["a", "b"])
    with pytest.raises(DataError, match="key column id is NULL in 1 row"):
        check_keys("ds", t([{"id": 1}, {"id": None}]), ["id"])
    with pytest.raises(DataError, match=r"key column\(s\) \['nope'\] not in the data"):
        check_keys("ds", rows, ["nope"])


def test_window_and_upsert_into_build_the_incremental_snapshot() -> None:
    snap = t([{"id": i, "v": str(i)} for i in range(5)])
    window = t([{"id": 3, "v": "3"}, {"id": 4, "v": "four"}, {"id": 9, "v": "9"}])
    old = within(snap, window, ["id"])
    assert keyset(old, ["id"]) == {(3,), (4,)}
    ch = diff("ds", old, window, ["id"])
    assert ch.delete_count == 0 and keyset(ch.upserts, ["id"]) == {(4,), (9,)}
    merged = upsert_into(snap, ch.upserts, ["id"])
    assert sorted((r["id"], r["v"]) for r in merged.to_pylist()) == \
        [(0, "0"), (1, "1"), (2, "2"), (3, "3"), (4, "four"), (9, "9")]


_FILES = itertools.count()


def snapshot_file(table, path, part_rows: int | None = None):
    """``table`` written as a committed snapshot in parts (record batches) of ``part_rows``, opened as
    the store opens it."""
    from refresh.stores import files

    path = path.with_name(f"{path.name}-{next(_FILES)}.arrow")  # never rewritten while open
    with pa.ipc.new_file(str(path), table.schema, options=files._IPC_WRITE) as w:
        w.write_table(table, max_chunksize=part_rows)
    return files.open_snapshot_file(path)


def test_lazy_snapshot_and_sliced_comparison_give_the_same_changes(tmp_path, monkeypatch) -> None:
    import refresh.diff as d

    old = t([{"id": i, "v": str(i), "w": float(i)} for i in range(100)])
    new = t([{"id": i, "v": str(i) if i % 7 else "x", "w": float(i) if i % 11 else -1.0} for i in range(5, 120)])
    expected = diff("ds", old, new, ["id"])
    monkeypatch.setattr(d, "COMPARE_SLICE", 8)
    lazy = diff("ds", snapshot_file(old, tmp_path / "s"), new, ["id"])
    assert (lazy.inserts, lazy.updates, lazy.delete_count) == (expected.inserts, expected.updates, expected.delete_count)
    assert sorted(lazy.upserts.column("id").to_pylist()) == sorted(expected.upserts.column("id").to_pylist())
    assert expected.updates == len([i for i in range(5, 100) if i % 7 == 0 or i % 11 == 0])
    assert sorted(lazy.deletes.column("id").to_pylist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ordered_lazy_comparison_with_gaps_matches_the_eager_diff(tmp_path, monkeypatch, seed: int) -> None:
    """Rows deleted and inserted between matched ones (runs of matched rows with holes on both sides),
    over many parts and compare slices: the lazy, ordered comparison finds what the eager one does."""
    import random

    import refresh.diff as d

    rng = random.Random(seed)
    old_ids = sorted(rng.sample(range(1000), 300))
    new_ids = sorted(set(i for i in old_ids if rng.random() > 0.1) | set(rng.sample(range(1000), 40)))
    def row(i: int, changed: bool) -> dict:
        return {"id": i, "v": f"value {i}" + ("!" if changed else ""), "n": None if i % 13 == 0 else i}
    old = t([row(i, False) for i in old_ids])
    new = t([row(i, rng.random() < 0.1) for i in new_ids])
    expected = diff("ds", old, new, ["id"])
    monkeypatch.setattr(d, "COMPARE_SLICE", 5)
    assert expected.updates > 0 and expected.inserts > 0 and expected.delete_count > 0
    prefetched = snapshot_file(old, tmp_path / "s", 16)
    assert prefetched.prefetch(1 << 20)  # read whole in the background: the same changes
    lazy_one = snapshot_file(old, tmp_path / "s", 16)
    assert len(list(lazy_one.column_parts("id"))) == 19  # 300 rows in parts of 16
    for snapshot in (snapshot_file(old, tmp_path / "s", 16), prefetched):
        lazy = diff("ds", snapshot, new, ["id"])
        assert (lazy.inserts, lazy.updates, lazy.delete_count) == \
            (expected.inserts, expected.updates, expected.delete_count)
        assert lazy.upserts.to_pylist() == expected.upserts.to_pylist()
        assert lazy.deletes.to_pylist() == expected.deletes.to_pylist()


def test_a_prefetch_is_bounded_and_a_failed_one_falls_back_to_reading_on_demand(tmp_path, monkeypatch) -> None:
    old = t([{"id": i, "v": str(i)} for i in range(50)])
    new = t([{"id": i, "v": str(i) if i % 5 else "x"} for i in range(50)])
    assert not snapshot_file(old, tmp_path / "s").prefetch(10)  # larger than 10 bytes: on demand
    failing = snapshot_file(old, tmp_path / "s")
    real = failing._read

    def broken(names):
        if names is None:
            raise OSError("disk went away")
        return real(names)

    monkeypatch.setattr(failing, "_read", broken)
    assert failing.prefetch(1 << 20)
    assert diff("ds", failing, new, ["id"]).updates == 10


# ----------------------------------------------------------------------------- valid-from times

T0, T1 = datetime(2024, 5, 1, tzinfo=UTC), datetime(2024, 6, 1, tzinfo=UTC)


def at(when: datetime, n: int) -> pa.Array:
    return pa.array([when] * n, TIME_TYPE)


@pytest.mark.parametrize("republish_all", [False, True])
def test_an_unchanged_row_keeps_its_time_and_a_changed_one_takes_the_fresh_one(
        tmp_path, monkeypatch, republish_all: bool) -> None:
    import refresh.diff as d

    old = t([{"id": i, "v": str(i)} for i in range(50)])
    old_from = pa.array([T0 + timedelta(seconds=i) for i in range(50)], TIME_TYPE)
    new = t([{"id": i, "v": str(i) if i % 5 else "x"} for i in range(10, 60)])  # 10-49 matched, 1 in 5 changed
    monkeypatch.setattr(d, "COMPARE_SLICE", 7)
    expect = {i: T1 if i >= 50 or i % 5 == 0 else T0 + timedelta(seconds=i) for i in range(10, 60)}
    stored = snapshot_file(with_valid_from(old, old_from), tmp_path / "s", 16)
    for snapshot, times in ((old, old_from), (stored, stored.valid_from())):
        ch = diff("ds", snapshot, new, ["id"], republish_all=republish_all, fresh=at(T1, new.num_rows),
                  old_valid_from=times)
        assert ch.snapshot_valid_from is not None and ch.valid_from is not None
        assert dict(zip(new.column("id").to_pylist(), ch.snapshot_valid_from.to_pylist(), strict=True)) == expect
        published = dict(zip(ch.upserts.column("id").to_pylist(), ch.valid_from.to_pylist(), strict=True))
        assert published == (expect if republish_all else {i: T1 for i in published})
        assert len(published) == (50 if republish_all else 18)


def test_fresh_times_per_row_and_without_published_ones() -> None:
    old = t([{"id": 1, "v": "a"}, {"id": 2, "v": "b"}])
    new = t([{"id": 1, "v": "a"}, {"id": 2, "v": "B"}, {"id": 3, "v": "c"}])
    fresh = pa.array([T1, T1 + timedelta(seconds=2), T1 + timedelta(seconds=3)], TIME_TYPE)  # a cursor's
    ch = diff("ds", old, new, ["id"], fresh=fresh, old_valid_from=at(T0, 2))
    assert ch.snapshot_valid_from.to_pylist() == [T0, fresh[1].as_py(), fresh[2].as_py()]
    assert ch.valid_from.to_pylist() == [fresh[2].as_py(), fresh[1].as_py()]  # inserts, then updates
    # A snapshot written before times were kept: every row takes its fresh time.
    assert diff("ds", old, new, ["id"], fresh=fresh).snapshot_valid_from.to_pylist() == fresh.to_pylist()
    # The first run: everything is new. Without fresh times, none are computed.
    assert diff("ds", None, new, ["id"], fresh=fresh).valid_from.to_pylist() == fresh.to_pylist()
    assert diff("ds", old, new, ["id"]).valid_from is None
    # A schema change makes every matched row an update: fresh times throughout.
    wider = new.append_column("w", pa.array([1, 2, 3]))
    assert diff("ds", old, wider, ["id"], fresh=fresh, old_valid_from=at(T0, 2)).snapshot_valid_from.to_pylist() \
        == fresh.to_pylist()

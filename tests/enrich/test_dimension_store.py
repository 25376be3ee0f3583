"""DimensionState: pure logic over changelog records built with the contract codec."""

from __future__ import annotations

from decimal import Decimal

import pytest

from enrich.columns import DELETED
from enrich.dimension.abc import Record
from enrich.dimension.store import DimensionState
from refstream import contract
from refstream.contract import Column, DatasetSchema
from refstream.errors import ContractError

SCHEMA = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("model", "string"),
                                                   Column("price", "decimal(10,2)")))


def records(msgs: list[contract.Message], start: int = 0) -> list[Record]:
    return [Record(0, start + i, m.key, m.value, m.headers) for i, m in enumerate(msgs)]


def rows(state: DimensionState) -> dict[str, dict]:
    snap = state.snapshot()
    out = {r["device_id"]: r for r in snap.base.to_pylist()}
    if snap.overlay is not None:
        for r in snap.overlay.to_pylist():
            if r.pop(DELETED):
                out.pop(r["device_id"], None)
            else:
                out[r["device_id"]] = r
    return out


def test_upsert_replace_delete_reinsert_in_offset_order() -> None:
    s = DimensionState("devices")
    msgs = [contract.schema_message(SCHEMA)]
    msgs += contract.upsert_messages(SCHEMA, [{"device_id": "a", "model": "m1", "price": Decimal("1.50")},
                                              {"device_id": "b", "model": "m2", "price": None}], 1)
    s.apply(records(msgs))
    s.compact()
    base_gen = s.base_gen
    later = list(contract.upsert_messages(SCHEMA, [{"device_id": "a", "model": "m9", "price": "2.00"}], 2))
    later += contract.delete_messages(SCHEMA, [{"device_id": "b"}], 2)
    later += contract.delete_messages(SCHEMA, [{"device_id": "c"}], 2)
    later += contract.upsert_messages(SCHEMA, [{"device_id": "c", "model": "m3", "price": "3"}], 2)
    s.apply(records(later, 10))
    got = rows(s)
    assert s.base_gen == base_gen, "a few changes must not rebuild the base"
    assert got == {"a": {"device_id": "a", "model": "m9", "price": Decimal("2.00")},
                   "c": {"device_id": "c", "model": "m3", "price": Decimal("3.00")}}
    s.compact()
    assert rows(s) == got and s.snapshot().overlay is None


def test_compaction_after_many_changes_and_column_projection() -> None:
    s = DimensionState("devices", compact_min=5, compact_fraction=0.0)
    s.apply(records([contract.schema_message(SCHEMA)]))
    s.apply(records(list(contract.upsert_messages(
        SCHEMA, [{"device_id": f"d{i}", "model": f"m{i}", "price": i} for i in range(20)], 1)), 1))
    snap = s.snapshot(["price"])
    assert snap.overlay is None and snap.base.num_rows == 20
    assert snap.base.column_names == ["device_id", "price"]
    assert str(snap.base.schema.field("price").type) == "decimal128(10, 2)"


def test_schema_change_keeps_rows_and_adds_columns() -> None:
    s = DimensionState("devices")
    s.apply(records([contract.schema_message(SCHEMA),
                     *contract.upsert_messages(SCHEMA, [{"device_id": "a", "model": "m", "price": 1}], 1)]))
    wider = DatasetSchema("devices", SCHEMA.key, SCHEMA.columns + (Column("site", "int64"),), 2)
    s.apply(records([contract.schema_message(wider),
                     *contract.upsert_messages(wider, [{"device_id": "b", "model": "n", "price": 2, "site": 7}], 2)], 5))
    assert rows(s) == {"a": {"device_id": "a", "model": "m", "price": Decimal("1.00"), "site": None},
                       "b": {"device_id": "b", "model": "n", "price": Decimal("2.00"), "site": 7}}


def test_bad_record_is_skipped_not_fatal() -> None:
    s = DimensionState("devices")
    bad = Record(0, 1, None, b"{}", [])
    s.apply([*records([contract.schema_message(SCHEMA)]), bad,
             *records(list(contract.upsert_messages(SCHEMA, [{"device_id": "a", "model": "m", "price": 1}], 1)), 2)])
    assert set(rows(s)) == {"a"}


def test_dropped_joined_column_is_refused_naming_dataset_and_column() -> None:
    s = DimensionState("devices")
    s.apply(records([contract.schema_message(SCHEMA),
                     *contract.upsert_messages(SCHEMA, [{"device_id": "a", "model": "m", "price": 1}], 1)]))
    narrower = DatasetSchema("devices", SCHEMA.key, SCHEMA.columns[:2], 2)
    s.apply(records([contract.schema_message(narrower)], 5))
    assert s.snapshot(["model"]).base.column_names == ["device_id", "model"]
    with pytest.raises(ContractError, match=r"dataset devices: column\(s\) price selected by a join"):
        s.snapshot(["model", "price"])


def test_a_re_key_leaves_exactly_the_rows_published_under_the_new_key() -> None:
    """The refresher re-keys by tombstoning every old key and upserting every row under the new key.
    Executors look rows up by the new key, so the old rows must be gone from what is shipped, also
    the one deleted in the same change set (its tombstone cannot match a lookup by the new key)."""
    old = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("serial", "string")))
    new = DatasetSchema("devices", ("serial",), old.columns, version=2)
    s = DimensionState("devices")
    devices = [{"device_id": d, "serial": f"s-{d}"} for d in ("a", "b", "c")]
    s.apply(records([contract.schema_message(old), *contract.upsert_messages(old, devices, 1)]))
    s.compact()
    rekey = [contract.schema_message(new), *contract.delete_messages(old, devices, 2),
             *contract.upsert_messages(new, devices[:2], 2)]  # c was deleted with the re-key
    s.apply(records(rekey, 10))
    snap = s.snapshot()
    assert snap.schema.key == ("serial",)
    view = {r["serial"]: r for r in snap.base.to_pylist()}
    if snap.overlay is not None:  # what executors do: the overlay, looked up by the key, wins
        for r in snap.overlay.to_pylist():
            if r["serial"] is not None:
                (view.pop(r["serial"], None) if r.pop(DELETED) else view.__setitem__(r["serial"], r))
    assert sorted(view) == ["s-a", "s-b"]


def test_completeness_is_the_least_of_each_partitions_latest_heartbeat() -> None:
    from datetime import UTC, datetime, timedelta

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    s = DimensionState("devices")
    beat = [contract.heartbeat_message("devices", v, t0, t0 + timedelta(minutes=v)) for v in range(4)]

    def on(partition: int, m: contract.Message, offset: int) -> Record:
        return Record(partition, offset, m.key, m.value, m.headers)

    s.apply([on(0, beat[1], 0), on(0, contract.heartbeat_message("devices", 9, t0), 1)])  # none: says nothing
    assert s.complete_as_of([0]) == t0 + timedelta(minutes=1)
    assert s.complete_as_of([0, 1]) is None  # partition 1 has had no heartbeat yet
    s.apply([on(1, beat[3], 0), on(0, beat[2], 2)])
    assert s.complete_as_of([0, 1]) == t0 + timedelta(minutes=2)
    s.apply([on(0, beat[0], 3)])  # an older one (a replayed run) does not move it back
    assert s.complete_as_of([0, 1]) == t0 + timedelta(minutes=2)

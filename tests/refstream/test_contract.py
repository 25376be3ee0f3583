from __future__ import annotations

import json
import math
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import pyarrow as pa
import pytest

from refstream import contract as c
from refstream.errors import ContractError


def sample() -> pa.Table:
    return pa.table({
        "id": ["d-1", "d-2"],
        "price": pa.array([Decimal("1.50"), None], pa.decimal128(10, 2)),
        "day": [date(2024, 5, 1), None],
        "ts": [datetime(2024, 5, 1, 12), datetime(2024, 5, 1, 12, 0, 0, 123)],
        "tz": pa.array([datetime(2024, 5, 1, 14, tzinfo=timezone(timedelta(hours=2))), None],
                       pa.timestamp("us", tz="UTC")),
        "raw": [b"\x00\x01", None],
        "f": [1.5, 2.0],
        "n": [1, None],
        "text": ["ünï ✓ 漢字", None],
        "ok": [True, False],
    })


def test_key_is_canonical_in_declared_order() -> None:
    assert c.encode_key(["b", "a"], {"a": 1, "b": "x", "z": 3}) == b'{"b":"x","a":1}'
    assert c.encode_key(["device_id"], {"device_id": "d-17"}) == b'{"device_id":"d-17"}'


def test_value_encoding_of_every_type() -> None:
    t = sample()
    schema = c.DatasetSchema.from_arrow("dev", ["id"], t.schema, 3)
    msgs = list(c.upsert_messages(schema, t, 3))
    assert msgs[0].value == (
        '{"id":"d-1","price":"1.50","day":"2024-05-01","ts":"2024-05-01T12:00:00",'
        '"tz":"2024-05-01T12:00:00+00:00","raw":"AAE=","f":1.5,"n":1,"text":"ünï ✓ 漢字","ok":true}'
    ).encode()
    assert b'"ts":"2024-05-01T12:00:00.000123"' in msgs[1].value
    assert dict(msgs[0].headers) == {"op": b"upsert", "dataset": b"dev", "version": b"3", "contract": b"1"}


def test_decode_values_round_trips_types() -> None:
    t = sample()
    schema = c.DatasetSchema.from_arrow("dev", ["id"], t.schema, 1)
    back = c.decode_values(schema, [m.value for m in c.upsert_messages(schema, t, 1)])
    assert back.schema == schema.arrow_schema()
    assert back.to_pylist() == t.cast(schema.arrow_schema()).to_pylist()
    assert back.column("tz")[0].as_py() == datetime(2024, 5, 1, 12, tzinfo=UTC)


def test_non_finite_floats_and_tombstones() -> None:
    schema = c.DatasetSchema("d", ("k",), (c.Column("k", "int64"), c.Column("f", "float64")))
    msg = next(c.upsert_messages(schema, [{"k": 1, "f": math.nan}], 2))
    assert msg.value == b'{"k":1,"f":"NaN"}'
    assert math.isnan(c.decode_values(schema, [msg.value]).column("f")[0].as_py())
    tomb = next(c.delete_messages(schema, [{"k": 1}], 2))
    assert tomb.value is None
    change = c.decode(tomb.key, tomb.value, tomb.headers)
    assert (change.op, change.version, change.dataset) == ("delete", 2, "d")


def test_schema_record_round_trip_and_spark_ddl() -> None:
    schema = c.DatasetSchema.from_arrow("dev", ["id"], sample().schema, 7)
    msg = c.schema_message(schema)
    change = c.decode(msg.key, msg.value, msg.headers)
    assert change.op == "schema" and change.schema == schema
    assert schema.spark_ddl(["id", "price", "ts", "tz"]) == (
        "`id` STRING, `price` DECIMAL(10,2), `ts` TIMESTAMP_NTZ, `tz` TIMESTAMP")


def test_contract_errors_name_the_problem() -> None:
    with pytest.raises(ContractError, match="key column"):
        c.DatasetSchema("d", ("missing",), (c.Column("k", "int64"),))
    with pytest.raises(ContractError, match="unknown column type"):
        c.Column("k", "uuid")
    schema = c.DatasetSchema("d", ("k",), (c.Column("k", "int64"),))
    with pytest.raises(ContractError, match="value #1"):
        c.decode_values(schema, [b'{"k":1}', b'{"k":"not-a-number"}'])
    floats = c.DatasetSchema("d", ("k",), (c.Column("k", "int64"), c.Column("f", "float64")))
    with pytest.raises(ContractError, match=r"value #0 .* does not fit"):   # only NaN and the infinities as text
        c.decode_values(floats, [b'{"k":1,"f":"lots"}'])


def test_one_rule_for_decimal_widths() -> None:
    assert c.decimal_type(38, 4) == pa.decimal128(38, 4)
    assert c.decimal_type(39, 4) == pa.decimal256(39, 4)
    assert c.decimal_type(1000, 4) == pa.decimal256(76, 4)  # PostgreSQL numeric: capped
    assert c.type_to_arrow("decimal(12,2)") == c.decimal_type(12, 2)
    assert c.type_to_arrow("decimal(40,2)") == c.decimal_type(40, 2)
    assert (c.type_to_spark("decimal(38,2)"), c.type_to_spark("decimal(39,2)")) == ("DECIMAL(38,2)", "STRING")


# ------------------------------------------------------------------------------- time in the changelog

def test_times_are_iso_8601_utc_with_microseconds_and_z() -> None:
    assert c.format_time(datetime(2024, 5, 1, 14, tzinfo=timezone(timedelta(hours=2)))) == "2024-05-01T12:00:00.000000Z"
    assert c.format_time(datetime(2024, 5, 1, 12, 0, 0, 5)) == "2024-05-01T12:00:00.000005Z"  # naive: UTC
    assert c.format_time(datetime(5, 1, 2, tzinfo=UTC)) == "0005-01-02T00:00:00.000000Z"
    assert c.parse_time("2024-05-01T12:00:00.000005Z") == datetime(2024, 5, 1, 12, 0, 0, 5, tzinfo=UTC)
    assert c.parse_time(b"2024-05-01T14:00:00+02:00") == datetime(2024, 5, 1, 12, tzinfo=UTC)
    times = pa.array([datetime(2024, 5, 1, 12, 0, 0, 5, tzinfo=UTC), datetime(1, 1, 1, tzinfo=UTC),
                      datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)], c.TIME_TYPE)
    assert c.format_times(times) == [c.format_time(t).encode() for t in times.to_pylist()]
    with pytest.raises(ContractError, match="not an ISO 8601 time"):
        c.parse_time("yesterday")


def test_every_change_carries_its_valid_from_one_per_row_or_one_for_all() -> None:
    schema = c.DatasetSchema("d", ("k",), (c.Column("k", "int64"), c.Column("v", "string")))
    n = 70_000  # more than one bulk-encoded batch: each batch takes its own slice of the times
    rows = pa.table({"k": pa.array(range(n), pa.int64()), "v": pa.array([str(i) for i in range(n)])})
    base = datetime(2024, 5, 1, tzinfo=UTC)
    times = pa.array([base + timedelta(seconds=i % 7) for i in range(n)], c.TIME_TYPE)
    bulk = list(c.upsert_messages(schema, rows, 3, valid_from=times))
    assert [c.decode(m.key, m.value, m.headers).valid_from for m in bulk] == times.to_pylist()
    assert bulk[1].headers == [*c.headers("upsert", "d", 3), ("valid_from", b"2024-05-01T00:00:01.000000Z")]
    # The row-wise path gives the same records; a list of times works too.
    first = rows.slice(0, 10)
    assert list(c.upsert_messages(schema, first.to_pylist(), 3, valid_from=times.slice(0, 10).to_pylist())) \
        == bulk[:10]
    # One time for every record: shared headers, in batches too.
    tombs = list(c.delete_batches(schema, rows.select(["k"]), 3, valid_from=base))
    assert all(b.valid_from is None and dict(b.headers)["valid_from"] == b"2024-05-01T00:00:00.000000Z"
               for b in tombs)
    change = c.decode(tombs[0].keys[0], None, tombs[0].headers)
    assert (change.op, change.valid_from) == ("delete", base)
    # Without: no header (records written before valid-from times existed decode with None).
    old = next(c.upsert_messages(schema, [{"k": 1, "v": "a"}], 1))
    assert "valid_from" not in dict(old.headers) and c.decode(old.key, old.value, old.headers).valid_from is None
    with pytest.raises(ContractError, match="2 valid-from times for 1 rows"):
        list(c.upsert_batches(schema, [{"k": 1, "v": "a"}], 1, valid_from=[base, base]))
    with pytest.raises(ContractError, match=r"record b'\{\"k\":1\}': bad valid_from header 'soon'"):
        c.decode(old.key, old.value, [*old.headers, ("valid_from", b"soon")])


def test_a_heartbeat_carries_the_runs_completeness() -> None:
    at, complete = datetime(2024, 5, 1, 12, 0, 1, tzinfo=UTC), datetime(2024, 5, 1, 12, tzinfo=UTC)
    beat = c.heartbeat_message("d", 4, at, complete)
    change = c.decode(beat.key, beat.value, beat.headers)
    assert (change.op, change.version, change.complete_as_of, change.valid_from) == ("heartbeat", 4, complete, None)
    assert dict(beat.headers)["complete_as_of"] == b"2024-05-01T12:00:00.000000Z"
    assert json.loads(beat.value or b"")["complete_as_of"] == "2024-05-01T12:00:00.000000Z"
    legacy = c.heartbeat_message("d", 4, at)  # as written before completeness existed
    assert c.decode(legacy.key, legacy.value, legacy.headers).complete_as_of is None


def test_a_readers_completeness_is_the_smallest_over_the_partitions() -> None:
    t1, t2 = datetime(2024, 5, 1, 12, tzinfo=UTC), datetime(2024, 5, 1, 13, tzinfo=UTC)
    assert c.complete_as_of({0: t2, 1: t1}, [0, 1]) == t1
    assert c.complete_as_of({0: t2}, [0, 1]) is None          # partition 1: no heartbeat read yet
    assert c.complete_as_of({0: t2, 1: None}, [0, 1]) is None
    assert c.complete_as_of({0: t2, 5: t1}, [0]) == t2

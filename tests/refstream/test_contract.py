from __future__ import annotations

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

"""SQL column types to Arrow types (pure: driver metadata is faked)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from types import SimpleNamespace

import pyarrow as pa
import pytest

from refresh.sources.sqltypes import TextConverter, mysql_type, parse_time, pg_type, unify
from refstream.errors import DataError


def test_value_that_does_not_fit_its_column_type_names_the_column() -> None:
    with pytest.raises(DataError, match="dataset ds: column c: value 'x' does not fit int64"):
        TextConverter("ds", "c", pa.int64())(["1", "x"])


def _my(type_code: int, length: int = 0, scale: int = 0, flags: int = 0, charsetnr: int = 45) -> object:
    return SimpleNamespace(type_code=type_code, length=length, scale=scale, flags=flags, charsetnr=charsetnr)


def test_mysql_decimal_width_from_the_field_length() -> None:
    assert mysql_type(_my(246, length=7, scale=2)) == pa.decimal128(5, 2)             # -123.45
    assert mysql_type(_my(246, length=6, scale=2, flags=32)) == pa.decimal128(5, 2)   # unsigned
    assert mysql_type(_my(246, length=11, scale=0)) == pa.decimal128(10, 0)           # no point
    assert mysql_type(_my(246, length=67, scale=30)) == pa.decimal256(65, 30)


def test_mysql_text_and_binary_by_character_set() -> None:
    assert mysql_type(_my(253, charsetnr=45)) == pa.string()
    assert mysql_type(_my(252, charsetnr=63)) == pa.binary()
    assert mysql_type(_my(245, charsetnr=63)) == pa.string()  # JSON reports the binary set
    assert mysql_type(_my(6)) == pa.string()                  # the NULL literal


def test_pg_numeric_widths() -> None:
    def d(p: int | None, s: int | None) -> object:
        return SimpleNamespace(type_code=1700, precision=p, scale=s)

    assert pg_type(d(12, 2)) == pa.decimal128(12, 2)
    assert pg_type(d(60, 2)) == pa.decimal256(60, 2)
    assert pg_type(d(1000, 2)) == pa.decimal256(76, 2)
    assert pg_type(d(None, None)) is None  # unconstrained: typed from the values


def test_unify_widens_decimals_to_hold_every_chunk() -> None:
    chunks = [[pa.array([Decimal("1.5")], pa.decimal128(2, 1))],
              [pa.array([Decimal("123.25")], pa.decimal128(5, 2))]]
    batches = list(unify(chunks, ["d"]))
    assert {b.schema.field("d").type for b in batches} == {pa.decimal128(5, 2)}


def test_parse_time() -> None:
    assert parse_time(b"-838:59:59.5") == -dt.timedelta(hours=838, minutes=59, seconds=59, microseconds=500000)
    assert parse_time("01:02:03") == dt.timedelta(hours=1, minutes=2, seconds=3)

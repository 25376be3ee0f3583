"""SQL column types to Arrow types, and driver values to Arrow arrays of those types.

Column types come from the driver's result metadata, not from the values, so an all-NULL chunk or
column keeps its type and DECIMAL keeps its precision and scale (:func:`refstream.contract.
decimal_type`, the one rule for decimal widths):

    MySQL/MariaDB  DECIMAL(p,s) -> decimal128(p,s) (exact), integers/YEAR -> int64, FLOAT/DOUBLE ->
                   float64, DATE -> date32, DATETIME/TIMESTAMP -> timestamp[us] (as the session sees
                   them, no zone), TIME -> duration[us], BINARY/VARBINARY/BLOB/BIT -> binary,
                   text/ENUM/SET/JSON -> string
    PostgreSQL     numeric(p,s), integers, floats, bool, text, bytea, date, timestamp, timestamptz
                   (UTC), time, json/jsonb (as JSON text), uuid
    SQLite         a table's columns declared DATETIME or TIMESTAMP -> timestamp[us], DATE -> date32,
                   from ISO-8601 text (as CURRENT_TIMESTAMP writes it; a zone offset read as its UTC
                   time) (:func:`sqlite_type`)
    others         (and the rest of SQLite's columns, every column of a SQLite query) typed from the
                   values read (:func:`unify`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from refstream.contract import decimal_type
from refstream.errors import DataError

__all__ = ["SqliteTimeConverter", "TextConverter", "fits", "mysql_type", "parse_time", "pg_type", "sqlite_type",
           "unify", "value_fixer"]

log = logging.getLogger(__name__)

# PyMySQL FIELD_TYPE codes.
_MY_INT = {1, 2, 3, 8, 9, 13}
_MY_FLOAT = {4, 5}
_MY_DECIMAL = {0, 246}
_MY_DATE = {10, 14}
_MY_DATETIME = {7, 12}
_MY_TIME = 11
_MY_BIT = 16
_MY_TEXTISH = {15, 245, 247, 248, 249, 250, 251, 252, 253, 254}
_MY_JSON = 245
_MY_GEOMETRY = 255
_MY_BINARY_CHARSET = 63
_MY_UNSIGNED = 32

# PostgreSQL type OIDs.
_PG = {16: pa.bool_(), 20: pa.int64(), 21: pa.int64(), 23: pa.int64(), 26: pa.int64(),
       700: pa.float64(), 701: pa.float64(), 17: pa.binary(), 25: pa.string(), 1043: pa.string(),
       1042: pa.string(), 19: pa.string(), 18: pa.string(), 2950: pa.string(), 114: pa.string(),
       3802: pa.string(), 1082: pa.date32(), 1114: pa.timestamp("us"),
       1184: pa.timestamp("us", tz="UTC"), 1083: pa.time64("us")}
_PG_NUMERIC = 1700


def mysql_type(f: Any) -> pa.DataType:
    """Arrow type of a MySQL result field (PyMySQL's field descriptor, :func:`refstream.compat.
    pymysql_fields`)."""
    tc = f.type_code
    if tc in _MY_INT:
        return pa.int64()
    if tc in _MY_FLOAT:
        return pa.float64()
    if tc in _MY_DECIMAL:
        # The field length counts the digits, the point (if any) and the sign (unless unsigned).
        scale = int(f.scale or 0)
        unsigned = bool(f.flags & _MY_UNSIGNED)
        precision = int(f.length) - (1 if scale else 0) - (0 if unsigned else 1)
        return decimal_type(max(precision, scale, 1), scale)
    if tc in _MY_DATE:
        return pa.date32()
    if tc in _MY_DATETIME:
        return pa.timestamp("us")
    if tc == _MY_TIME:
        return pa.duration("us")
    if tc in (_MY_BIT, _MY_GEOMETRY):
        return pa.binary()
    if tc in _MY_TEXTISH:
        return pa.binary() if f.charsetnr == _MY_BINARY_CHARSET and tc != _MY_JSON else pa.string()
    return pa.string()  # the NULL literal (6) and anything unknown


def pg_type(d: Any) -> pa.DataType | None:
    """Arrow type of a psycopg2 ``cursor.description`` entry (None: type it from the values)."""
    oid = d.type_code
    if oid == _PG_NUMERIC:
        p, s = d.precision, d.scale
        if p and 0 < p <= 1000 and s is not None and 0 <= s <= p:
            return decimal_type(p, s)
        return None  # unconstrained numeric: typed from the values
    return _PG.get(oid)


def sqlite_type(declared: str | None) -> pa.DataType | None:
    """Arrow type of a SQLite column declared ``declared`` (``PRAGMA table_info``): times for the
    declarations SQLite's own date functions and applications use, None (from the values) otherwise.
    SQLite stores such values as text; reading them as times makes a cursor on them a time cursor, so
    a row is valid from its own ``last_update`` rather than from the clock when it was read."""
    word = (declared or "").strip().split("(")[0].split(" ")[0].upper()
    if word in ("DATETIME", "TIMESTAMP"):
        return pa.timestamp("us")
    if word == "DATE":
        return pa.date32()
    return None


class TextConverter:
    """MySQL text values of one column -> an Arrow array of its type, cast vectorised."""

    def __init__(self, dataset: str, column: str, t: pa.DataType | None) -> None:
        self.dataset, self.column = dataset, column
        self.type = t if t is not None else pa.string()
        self.warned = False

    def __call__(self, values: Sequence[Any] | pa.Array) -> pa.Array:
        t = self.type
        first: Any
        if isinstance(values, pa.Array):  # the fast reader hands out a binary array per column
            if pa.types.is_large_binary(values.type):
                raise DataError(f"dataset {self.dataset}: column {self.column}: over 2 GB of values in "
                                f"one chunk of {len(values)} rows; lower chunk_rows")
            raw = values
            if pa.types.is_duration(t):
                return pa.array([None if v is None else parse_time(v) for v in raw.to_pylist()], t)
            first = b""
        else:
            if pa.types.is_duration(t):
                return pa.array([None if v is None else parse_time(v) for v in values], t)
            first = next((v for v in values if v is not None), None)
            if isinstance(first, bytes | bytearray):
                raw = pa.array(values, pa.binary())
        if isinstance(first, bytes | bytearray):
            if pa.types.is_binary(t):
                return raw
            try:
                text = raw.cast(pa.string())
            except pa.ArrowInvalid as exc:
                raise DataError(f"dataset {self.dataset}: column {self.column}: text is not UTF-8: {exc}") from None
        else:
            if pa.types.is_binary(t):
                return pa.array(values, pa.binary())
            text = pa.array(values, pa.string())
        if pa.types.is_string(t):
            return text
        try:
            return pc.cast(text, t)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            reason = str(exc)
            if pa.types.is_timestamp(t) or pa.types.is_date(t):
                zero = pc.fill_null(pc.starts_with(text, "0000-00-00"), False)
                if pc.any(zero).as_py():
                    if not self.warned:
                        log.warning("dataset %s: column %s holds zero dates (0000-00-00); read as NULL",
                                    self.dataset, self.column)
                        self.warned = True
                    try:
                        return pc.cast(pc.if_else(zero, pa.scalar(None, pa.string()), text), t)
                    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as again:
                        reason = str(again)
            bad = next((v for v in text.to_pylist() if v is not None and not _fits_text(v, t)), None)
            raise DataError(f"dataset {self.dataset}: column {self.column}: value {bad!r} does not fit "
                            f"{t}: {reason}") from None


class SqliteTimeConverter(TextConverter):
    """SQLite values of a column declared a time (:func:`sqlite_type`): ISO-8601 text, or an error
    naming the value (a number there, an epoch count, is not read as a time by guesswork). A time
    with a zone offset (``Z``, ``+02:00``, as Python's sqlite3 writes an aware datetime) is read as
    its UTC time; one without is UTC already."""

    def __call__(self, values: Sequence[Any] | pa.Array) -> pa.Array:
        bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
        if bad is not None:
            raise DataError(f"dataset {self.dataset}: column {self.column}: value {bad!r} is not ISO-8601 "
                            f"text (the column is declared a time, read as {self.type}){_SQLITE_REMEDY}")
        text = pa.array(values, pa.string())  # SQLite hands out Python values, checked above to be text
        if pa.types.is_timestamp(self.type):
            zoned = pc.fill_null(pc.match_substring_regex(text, _ZONE_SUFFIX), False)
            if pc.any(zoned).as_py():
                none = pa.scalar(None, pa.string())
                try:
                    naive = pc.cast(pc.if_else(zoned, none, text), self.type)
                    utc = pc.cast(pc.cast(pc.if_else(zoned, text, none), pa.timestamp("us", tz="UTC")), self.type)
                    return pc.if_else(zoned, utc, naive)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    pass  # the text path names the value at fault
        try:
            return super().__call__(text)  # the text array, built once
        except DataError as exc:
            raise DataError(f"{exc}{_SQLITE_REMEDY}") from None


_ZONE_SUFFIX = r"(?:Z|[+-]\d\d:?\d\d)$"
_SQLITE_REMEDY = ("; a column that holds other values than its declared time (epoch numbers, datetimes in a "
                  "DATE) is read typed from its values through query: (SELECT ... FROM the table) instead of table:")


def _fits_text(v: str, t: pa.DataType) -> bool:
    try:
        pc.cast(pa.array([v], pa.string()), t)
        return True
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False


def parse_time(v: str | bytes) -> dt.timedelta:
    """MySQL TIME text (``-838:59:59.000000`` .. ``838:59:59``) as a timedelta."""
    if isinstance(v, bytes | bytearray):
        v = v.decode("ascii")
    neg = v.startswith("-")
    h, m, rest = v.lstrip("-").split(":")
    sec, _, frac = rest.partition(".")
    td = dt.timedelta(hours=int(h), minutes=int(m), seconds=int(sec),
                      microseconds=int((frac + "000000")[:6]) if frac else 0)
    return -td if neg else td


def value_fixer(t: pa.DataType | None, dialect: str) -> Callable[[Any], Any] | None:
    """Per-value conversion a driver's Python values need before Arrow takes them (None: none)."""
    if t is None:
        return None
    if pa.types.is_binary(t):
        return bytes if dialect == "postgresql" else None  # psycopg2 hands out memoryview
    if pa.types.is_string(t) and dialect == "postgresql":
        return lambda v: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
    if pa.types.is_string(t) and dialect == "mysql":
        return lambda v: v if isinstance(v, str) else v.decode("utf-8") if isinstance(v, bytes) else \
            ",".join(sorted(v)) if isinstance(v, set) else str(v)
    return None


def fits(v: Any, t: pa.DataType) -> bool:
    """Whether Arrow takes the Python value ``v`` as a ``t``."""
    try:
        pa.array([v], type=t)
        return True
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        return False


def unify(chunks: list[list[pa.Array]], columns: list[str]) -> Iterator[pa.RecordBatch]:
    """Give every chunk of an untyped source the same column types (nulls take the others' type,
    ints become floats beside floats, decimals widen to hold them all, anything else mixed becomes
    text)."""
    if not chunks:
        return
    final: list[pa.DataType] = []
    for i in range(len(columns)):
        ts = {c[i].type for c in chunks if not pa.types.is_null(c[i].type)}
        if not ts:
            final.append(pa.null())
        elif len(ts) == 1:
            final.append(ts.pop())
        elif all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in ts):
            final.append(pa.float64())
        elif all(pa.types.is_decimal(t) for t in ts):
            scale = max(t.scale for t in ts)
            final.append(decimal_type(max(t.precision - t.scale for t in ts) + scale, scale))
        else:
            final.append(pa.string())
    for c in chunks:
        arrays = []
        for a, t in zip(c, final, strict=True):
            if a.type != t:
                a = pa.array([None if v is None else str(v) for v in a.to_pylist()], pa.string()) \
                    if pa.types.is_string(t) and not pa.types.is_null(a.type) else a.cast(t)
            arrays.append(a)
        yield pa.RecordBatch.from_arrays(arrays, names=columns)

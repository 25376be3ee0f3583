"""Incremental mode: the cursor window and the watermark.

A run reads rows with ``column >= watermark - lag`` (``watermark`` = the highest cursor value already
published). ``>=`` keeps rows sharing the boundary value; the lag re-reads rows committed late by long
transactions whose cursor value was assigned before the previous run: ``lag`` (a duration) for time
cursors, ``numeric_lag`` (cursor units: ids) for integer and decimal ones, such as an auto-increment
id taken by a transaction that commits after a later id was read. Rows read again unchanged are
dropped by comparison with the published snapshot, so the window may overlap freely.

The new watermark is the highest cursor value read, but never beyond the database's own "now" (a row
stamped in the future by a skewed client clock must not push the window past rows still to come);
the clock is read in UTC, and caps ``timestamp_tz`` cursors as well as naive ones.

Rows whose cursor is NULL never match the window: only a reconcile (a full read) sees them, and it
counts them in a warning.

Time (the contract's ``valid_from`` and ``complete_as_of``): a row is valid from its cursor value when
the cursor is a time - the row says when it changed - and from the database clock at the start of
the read otherwise (a NULL cursor, an integer or text one). A run is complete as of that clock minus
``lag``: a row committed later carries a cursor value above it, as the lag assumes.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from refstream.contract import TIME_TYPE, type_from_arrow
from refstream.errors import DataError

__all__ = [
    "TIME_CURSORS",
    "advance",
    "column_type",
    "complete_as_of",
    "from_json",
    "null_cursors",
    "to_json",
    "utc",
    "valid_from",
    "window_start",
]

#: Cursor types whose values are times a row is valid from.
TIME_CURSORS = ("timestamp", "timestamp_tz", "date")


def to_json(value: Any) -> Any:
    """A cursor value as stored in state.json."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    raise DataError(f"cursor value {value!r} ({type(value).__name__}) cannot be a watermark")


def from_json(value: Any, ctype: str | None) -> Any:
    if value is None:
        return None
    if ctype in ("timestamp", "timestamp_tz"):
        return datetime.fromisoformat(value)
    if ctype == "date":
        return date.fromisoformat(value)
    if ctype and ctype.startswith("decimal"):
        return Decimal(value)
    return value


def window_start(watermark: Any, lag: timedelta, numeric_lag: int = 0) -> Any:
    """Lowest cursor value to read: ``watermark - lag`` for times, ``watermark - numeric_lag`` for
    numbers, the watermark itself otherwise (text)."""
    if watermark is None:
        return None
    if isinstance(watermark, datetime):
        return watermark - lag
    if isinstance(watermark, date):
        return watermark - timedelta(days=max(lag.days, 0))
    if isinstance(watermark, int | float | Decimal) and not isinstance(watermark, bool):
        return watermark - numeric_lag
    return watermark


def null_cursors(rows: pa.Table, column: str) -> int:
    """Rows of ``rows`` whose cursor is NULL (invisible to incremental runs)."""
    return rows.column(column).null_count if column in rows.column_names else 0


def advance(old: Any, rows: pa.Table, column: str, db_now: Any) -> Any:
    """The watermark after publishing ``rows``."""
    if column not in rows.column_names:
        raise DataError(f"incremental column {column} is not among the columns read {rows.column_names}")
    if rows.num_rows == 0:
        return old
    top = pc.max(rows.column(column)).as_py()
    if top is None:
        return old
    if isinstance(top, datetime) and isinstance(db_now, datetime) and (top.tzinfo is None) != (db_now.tzinfo is None):
        # The clock is naive UTC (sessions read in UTC); a timestamp_tz cursor is aware.
        db_now = db_now.replace(tzinfo=UTC) if db_now.tzinfo is None else db_now.astimezone(UTC).replace(tzinfo=None)
    if db_now is not None and _comparable(top, db_now) and top > db_now:
        top = db_now
    if old is not None and _comparable(top, old) and old > top:
        return old
    return top


def column_type(rows: pa.Table, column: str) -> str:
    return type_from_arrow(rows.schema.field(column).type)


def _comparable(a: Any, b: Any) -> bool:
    if isinstance(a, datetime) and isinstance(b, datetime):
        return (a.tzinfo is None) == (b.tzinfo is None)
    if isinstance(a, datetime) or isinstance(b, datetime):
        return False
    if isinstance(a, date) and isinstance(b, date):
        return True
    return isinstance(a, int | float | Decimal) and isinstance(b, int | float | Decimal)


def utc(clock: Any) -> datetime:
    """A database clock reading (naive UTC: every session reads in UTC) as an aware UTC time."""
    if not isinstance(clock, datetime):
        raise DataError(f"the database clock read {clock!r}, not a time")
    return clock.replace(tzinfo=UTC) if clock.tzinfo is None else clock.astimezone(UTC)


def valid_from(rows: pa.Table, column: str, at: datetime) -> pa.Array:
    """When each row of ``rows`` is valid from (``timestamp[us, UTC]``): its ``column`` value where the
    cursor is a time (a naive one read as UTC, a date as its midnight) and not NULL, else ``at``."""
    if column not in rows.column_names or column_type(rows, column) not in TIME_CURSORS:
        return pa.repeat(pa.scalar(at, TIME_TYPE), rows.num_rows)
    col = rows.column(column)
    if pa.types.is_date(col.type):
        col = pc.cast(col, pa.timestamp("us"))
    # Through the epoch count: a naive time is UTC (sessions read in UTC), a zoned one is converted.
    times = pc.cast(pc.cast(pc.cast(col, pa.timestamp("us", tz=col.type.tz)), pa.int64()), TIME_TYPE)
    filled = pc.fill_null(times, pa.scalar(at, TIME_TYPE))
    return filled.combine_chunks() if isinstance(filled, pa.ChunkedArray) else filled


def complete_as_of(at: datetime, cursor_type: str | None, lag: timedelta) -> datetime:
    """The completeness of an incremental run whose read began at ``at`` (the database clock): every
    row committed later has a cursor value above ``at - lag`` (the lag's premise), hence a later
    valid-from time. A date cursor: the end of the day before that bound's (a row committed later may
    still carry the bound's date, valid from its midnight). An integer or text cursor: ``at`` itself,
    the time its rows are valid from."""
    if cursor_type in ("timestamp", "timestamp_tz"):
        return at - lag
    if cursor_type == "date":
        day = (at - lag).date()
        return datetime.combine(day, time(), tzinfo=UTC) - timedelta(microseconds=1)
    return at

"""MySQL/MariaDB read by ConnectorX (Rust, Arrow-native), into the same Arrow table as the PyMySQL path.

ConnectorX reads the binary protocol into Arrow without a Python object per value, optionally in
parallel key ranges (:func:`ranges`: one statement per range, each on a connection of its own). Its
Arrow types are not the contract's, so the table is made identical to what
:mod:`refresh.sources.sql` reads with PyMySQL:

- the column types come from the same result metadata (:func:`refresh.sources.sqltypes.mysql_type`
  of PyMySQL's field descriptors, from a query for no rows);
- columns whose binary-protocol values ConnectorX reads exactly are selected as they are and cast
  to the contract's type (integers of every width and YEAR to int64, DOUBLE, DATE, DATETIME,
  TIMESTAMP, text, ENUM/SET/JSON, binary and BIT);
- DECIMAL (ConnectorX keeps 28 digits and fails on wider values), FLOAT (PyMySQL reads the text
  protocol's 6 significant digits, not the float's bits), TIME (ConnectorX refuses negative times and
  times past 24h) and the type of a bare ``NULL`` are selected as ``CAST(... AS CHAR)`` and converted
  by the PyMySQL path's own :class:`refresh.sources.sqltypes.TextConverter`;
- a column type ConnectorX cannot read (GEOMETRY, any type not named here) or a value it refuses
  (zero or invalid dates: PyMySQL reads ``0000-00-00`` as NULL) raise :class:`Unreadable`: the
  caller reads with PyMySQL instead.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from refresh.sources.sqltypes import TextConverter, mysql_type
from refstream.errors import DataError

__all__ = [
    "Column",
    "Unreadable",
    "available",
    "convert",
    "partition_key",
    "plan",
    "read",
    "select",
    "server_error",
    "url_for",
]

# PyMySQL FIELD_TYPE codes (see refresh.sources.sqltypes).
_NATIVE = {1, 2, 3, 8, 9, 13,            # TINYINT, SMALLINT, INT, BIGINT, MEDIUMINT, YEAR
           5,                            # DOUBLE
           10, 14, 7, 12,                # DATE, NEWDATE, TIMESTAMP, DATETIME
           16,                           # BIT
           15, 245, 247, 248, 249, 250, 251, 252, 253, 254}  # text, JSON, ENUM, SET, blobs, (VAR)CHAR/BINARY
_AS_TEXT = {0, 246,                      # DECIMAL
            4,                           # FLOAT
            11,                          # TIME
            6}                           # the NULL literal
_INTEGER = {1, 2, 3, 8, 9}
_PRI_KEY = 2                             # field flag: part of the primary key
_UTF8 = ("utf8", "utf8mb4", "utf8mb3")
_SERVER_ERROR = re.compile(r"ERROR (\d+)")
_ROW = "__refresh_row"


class Unreadable(Exception):
    """ConnectorX cannot read this result exactly (a column type, or a value it refuses)."""


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType   # the contract's Arrow type (as the PyMySQL path reads it)
    text: bool          # selected as CAST(... AS CHAR) and converted from MySQL text


@functools.cache
def available() -> bool:
    """Whether connectorx imports here (a platform without its wheel reads with PyMySQL)."""
    try:
        import connectorx  # noqa: F401
    except ImportError:
        return False
    return True


def url_for(host: str | None, port: int | None, user: str | None, password: str | None,
            database: str | None, query: dict[str, Any]) -> tuple[str | None, str]:
    """ConnectorX's URL for a SQLAlchemy MySQL URL's parts, or None and why it cannot honour them
    (only ``charset`` set to a UTF-8 one is understood among the URL's options)."""
    from urllib.parse import quote

    options = dict(query)
    charset = options.pop("charset", "utf8mb4")
    if options:
        return None, f"URL option(s) {', '.join(sorted(options))}"
    if charset not in _UTF8:
        return None, f"charset {charset}"
    if not host:
        return None, "a URL without a host"
    auth = quote(user or "root", safe="")
    if password:
        auth += ":" + quote(password, safe="")
    return f"mysql://{auth}@{host}:{port or 3306}/{quote(database or '', safe='')}", ""


def plan(fields: Sequence[Any]) -> list[Column]:
    """How to read each column of a result with these PyMySQL field descriptors."""
    names = [f.name for f in fields]
    if len(set(names)) != len(names):
        raise Unreadable("repeated column names")
    out = []
    for f in fields:
        if f.type_code in _NATIVE:
            out.append(Column(f.name, mysql_type(f), False))
        elif f.type_code in _AS_TEXT:
            out.append(Column(f.name, mysql_type(f), True))
        else:
            raise Unreadable(f"column {f.name} (MySQL type code {f.type_code})")
    return out


def partition_key(fields: Sequence[Any]) -> str | None:
    """The table's primary key column when it is one integer column (ConnectorX splits its range)."""
    keys = [f for f in fields if f.flags & _PRI_KEY]
    return keys[0].name if len(keys) == 1 and keys[0].type_code in _INTEGER else None


def select(columns: Sequence[Column], quote: Callable[[str], str], source: str, tag: str,
           where: str | None) -> str:
    """The statement ConnectorX runs. ``source`` is a quoted table name or ``(query)``; ``tag`` names
    it in the server's process list (how a stop finds the read's connections to kill them)."""
    exprs = ", ".join(f"CAST({quote(c.name)} AS CHAR) AS {quote(c.name)}" if c.text else quote(c.name)
                      for c in columns)
    sql = f"SELECT {exprs} FROM {source} AS {quote(tag)}"
    return f"{sql} WHERE {where}" if where else sql


def ranges(column: str, low: int, high: int, n: int) -> list[str]:
    """WHERE conditions splitting the integer ``column`` (quoted) into at most ``n`` ranges of about
    equal width over ``[low, high]``. The first and the last are open-ended: together they take every
    row, one inserted outside ``[low, high]`` after they were measured included."""
    n = max(1, min(n, high - low + 1))
    if n == 1:
        return []
    bounds = [low + (high - low + 1) * i // n for i in range(1, n)]
    conds = [f"{column} < {bounds[0]}"]
    conds += [f"{column} >= {a} AND {column} < {b}" for a, b in zip(bounds, bounds[1:], strict=False)]
    conds.append(f"{column} >= {bounds[-1]}")
    return conds


def suspects(read: pa.Table, now: pa.Table, key: Sequence[str]) -> pa.Table:
    """The dataset keys (columns ``key``) a read in key ranges cannot vouch for: read in two ranges,
    or in ``now`` (the keys read in one statement after the ranges) but in no range. Each range's
    statement sees its own moment, so a row whose primary key changed range in between (updated, or
    deleted and inserted again under another id) shows in both ranges or in neither; a row inserted
    into a range already read is missing too."""
    key = list(key)
    keys = read.select(key)
    counts = keys.group_by(key, use_threads=False).aggregate([([], "count_all")])
    twice = counts.filter(pc.greater(counts.column("count_all"), 1)).select(key)
    missing = now.select(key).join(keys, key, join_type="left anti")
    return pa.concat_tables([twice, missing.cast(twice.schema)])


def rows_of(table: pa.Table, keys: pa.Table, key: Sequence[str], *, keep: bool) -> pa.Array:
    """The indices, ascending, of the rows of ``table`` whose key is in ``keys`` (``keep``) or not."""
    key = list(key)
    indexed = table.select(key).append_column(_ROW, pa.array(np.arange(table.num_rows, dtype=np.int64)))
    hit = indexed.join(keys, key, join_type="left semi" if keep else "left anti").column(_ROW)
    return pc.take(hit, pc.sort_indices(hit)).combine_chunks()


def read(url: str, queries: Sequence[str], settings: list[str]) -> pa.Table:
    """Run ``queries`` with ConnectorX, in parallel, each on a connection of its own, their rows in
    one table (``settings``: statements each connection runs first). A Rust panic (a value it
    refuses) becomes :class:`Unreadable`; server and connection errors stay ConnectorX's
    ``RuntimeError`` (see :func:`server_error`)."""
    import connectorx as cx

    try:
        return cx.read_sql(url, list(queries) if len(queries) > 1 else queries[0], return_type="arrow",
                           protocol="binary", pre_execution_query=settings or None)
    except BaseException as exc:
        if type(exc).__name__ == "PanicException":  # pyo3's, a BaseException
            raise Unreadable(str(exc).strip().splitlines()[0] if str(exc).strip() else "a panic") from None
        raise


def running(url: str, tag: str, timeout: float) -> bool:
    """Whether a statement naming ``tag`` runs on the server of ConnectorX's ``url``, asked on a
    connection PyMySQL opens to it as ConnectorX would (same host, user, password and database)
    within ``timeout`` seconds. PyMySQL's error when it cannot connect."""
    from urllib.parse import unquote, urlsplit

    import pymysql

    u = urlsplit(url)
    conn = pymysql.connect(host=u.hostname or "", port=u.port or 3306, user=unquote(u.username or ""),
                           password=unquote(u.password or ""), database=unquote(u.path.lstrip("/")) or None,
                           connect_timeout=max(1, math.ceil(timeout)), read_timeout=max(1, math.ceil(timeout)),
                           write_timeout=max(1, math.ceil(timeout)), charset="utf8mb4")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM information_schema.processlist WHERE INSTR(info, %s) > 0 "
                        "AND id <> CONNECTION_ID() LIMIT 1", (tag,))
            return cur.fetchone() is not None
    finally:
        conn.close()


def server_error(exc: BaseException) -> int | None:
    """The MySQL error code in a ConnectorX error message (None: a client or connection error)."""
    m = _SERVER_ERROR.search(str(exc))
    return int(m.group(1)) if m else None


def convert(dataset: str, table: pa.Table, columns: Sequence[Column], key: str | None) -> pa.Table:
    """ConnectorX's table as the PyMySQL path's: the contract's types, the same column order and, for a
    read split into ranges of ``key``, the rows in key order again (ConnectorX hands the ranges back
    in the order they finished; each range comes in key order)."""
    if key is not None:
        batches = [b for b in table.to_batches() if b.num_rows]
        batches.sort(key=lambda b: b.column(key)[0].as_py())
        table = pa.Table.from_batches(batches, schema=table.schema) if batches else table
        del batches
    arrays = []
    for c in columns:
        col = table.column(c.name)
        # Each of ConnectorX's columns is let go once converted: the caller passes the only reference.
        table = table.drop_columns([c.name])
        if c.text:
            conv = TextConverter(dataset, c.name, c.type)
            chunks = [conv(chunk.cast(pa.string())) for chunk in col.chunks]
        else:
            chunks = [_cast(dataset, c, chunk) for chunk in col.chunks]
        del col
        arrays.append(pa.chunked_array(chunks, c.type))
    return pa.Table.from_arrays(arrays, names=[c.name for c in columns])


def _cast(dataset: str, c: Column, a: pa.Array) -> pa.Array:
    t = c.type
    if pa.types.is_binary(t) != (pa.types.is_binary(a.type) or pa.types.is_large_binary(a.type)):
        # Text read as bytes or bytes as text: ConnectorX typed the column otherwise than its metadata.
        raise Unreadable(f"column {c.name}: ConnectorX read {a.type} for {t}")
    try:
        return a.cast(t)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(f"dataset {dataset}: column {c.name}: a value does not fit {t}: {exc}") from None

"""Connections to the configured database and the dialects' statements: identifiers quoted, a table
of rows upserted in bulk (PostgreSQL: ``COPY`` into a temporary table, then one ``INSERT ... ON
CONFLICT``; MySQL/MariaDB: multi-row ``INSERT ... ON DUPLICATE KEY UPDATE``)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

from enrich.config import DatabaseDialect
from refstream.errors import TerminalError, TransientError

log = logging.getLogger(__name__)

__all__ = ["connect", "quote", "upsert", "fence_insert", "transient"]


def connect(url: str, dialect: DatabaseDialect) -> Any:
    """A DB-API connection, autocommit off, read committed, times in UTC."""
    try:
        if dialect == "postgresql":
            import psycopg

            conninfo = "postgresql://" + url.split("://", 1)[1]  # libpq takes the URL without a driver suffix
            pg = psycopg.connect(conninfo, autocommit=False)
            pg.execute("SET TIME ZONE 'UTC'")
            pg.commit()
            return pg
        import pymysql
        from sqlalchemy.engine import make_url

        u = make_url(url)
        conn = pymysql.connect(host=u.host or "127.0.0.1", port=u.port or 3306, user=u.username or "root",
                               password=u.password or "", database=u.database,
                               charset=str(u.query.get("charset", "utf8mb4")), autocommit=False,
                               init_command="SET time_zone = '+00:00'")
        with conn.cursor() as cur:  # no gap locks: the slots' upserts and fence rows never wait on each other
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        return conn
    except Exception as exc:  # noqa: BLE001 - the drivers' errors differ; classified here
        raise transient(exc, "connecting to the database") from exc


def transient(exc: BaseException, what: str) -> Exception:
    """A database error as the job's transient (retried) or terminal error: lost connections,
    deadlocks, serialisation failures and timeouts are transient; SQL errors (a bad table, a bad
    type) are terminal."""
    import psycopg
    import pymysql

    if isinstance(exc, psycopg.OperationalError) or isinstance(exc, psycopg.errors.SerializationFailure) \
            or isinstance(exc, psycopg.errors.DeadlockDetected):
        return TransientError(f"{what}: {exc}")
    if isinstance(exc, pymysql.err.OperationalError):
        return TransientError(f"{what}: {exc}")
    if isinstance(exc, ConnectionError | TimeoutError):
        return TransientError(f"{what}: {exc}")
    return TerminalError(f"{what}: {exc}")


def quote(dialect: DatabaseDialect, name: str) -> str:
    if dialect == "postgresql":
        return '"' + name.replace('"', '""') + '"'
    return "`" + name.replace("`", "``") + "`"


def fence_insert(cur: Any, dialect: DatabaseDialect, fence: str, query_id: str, slot: int, batch_id: int) -> bool:
    """Insert the fence row; False when it is there already (committed by an earlier attempt, or by
    one that held it open and committed meanwhile: the insert waits for it)."""
    q = quote(dialect, fence)
    if dialect == "postgresql":
        cur.execute(f"INSERT INTO {q} (query_id, slot, batch_id) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                    (query_id, slot, batch_id))
    else:
        cur.execute(f"INSERT IGNORE INTO {q} (query_id, slot, batch_id) VALUES (%s, %s, %s)",
                    (query_id, slot, batch_id))
    return bool(cur.rowcount == 1)


def _csv_ok(table: pa.Table) -> bool:
    """Whether pyarrow's CSV writer renders every column as PostgreSQL's COPY reads it."""
    return all(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_string(t)
               or pa.types.is_large_string(t) or pa.types.is_timestamp(t) or pa.types.is_date(t)
               or pa.types.is_decimal(t) for t in table.schema.types)


def _py_rows(table: pa.Table) -> list[tuple]:
    """Rows as Python tuples; nested values as JSON text."""
    cols = []
    for col in table.columns:
        values = col.to_pylist()
        t = col.type
        if pa.types.is_struct(t) or pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_map(t):
            values = [None if v is None else json.dumps(v, default=str) for v in values]
        cols.append(values)
    return list(zip(*cols, strict=True)) if cols else []


def upsert(cur: Any, dialect: DatabaseDialect, name: str, table: pa.Table, key: Sequence[str]) -> None:
    """Insert the rows of ``table`` into table ``name`` (columns by name), replacing the row of a key
    that exists. ``key`` must be unique within ``table``."""
    if not table.num_rows:
        return
    cols = table.column_names
    def q(n: str) -> str:
        return quote(dialect, n)

    names = ", ".join(q(c) for c in cols)
    rest = [c for c in cols if c not in key]
    if dialect == "postgresql":
        tmp = q(f"_load_{name}")
        cur.execute(f"CREATE TEMPORARY TABLE IF NOT EXISTS {tmp} (LIKE {q(name)}) ON COMMIT DELETE ROWS")
        if _csv_ok(table):
            # The session's time zone is UTC: times as UTC wall clock, which pyarrow writes about five
            # times faster than with a zone.
            for i, t in enumerate(table.schema.types):
                if pa.types.is_timestamp(t) and t.tz is not None:
                    table = table.set_column(i, table.column_names[i], table.column(i).cast(pa.timestamp(t.unit)))
            buf = io.BytesIO()
            pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=False, quoting_style="needed"))
            with cur.copy(f"COPY {tmp} ({names}) FROM STDIN (FORMAT csv)") as cp:
                cp.write(buf.getbuffer())
        else:
            with cur.copy(f"COPY {tmp} ({names}) FROM STDIN") as cp:
                for row in _py_rows(table):
                    cp.write_row(row)
        update = (f"DO UPDATE SET {', '.join(f'{q(c)} = EXCLUDED.{q(c)}' for c in rest)}" if rest
                  else "DO NOTHING")
        cur.execute(f"INSERT INTO {q(name)} ({names}) SELECT {names} FROM {tmp} "
                    f"ON CONFLICT ({', '.join(q(c) for c in key)}) {update}")
        return
    update = ", ".join(f"{q(c)} = VALUES({q(c)})" for c in (rest or list(key)[:1]))
    cur.executemany(f"INSERT INTO {q(name)} ({names}) VALUES ({', '.join(['%s'] * len(cols))}) "
                    f"ON DUPLICATE KEY UPDATE {update}", _py_rows(table))


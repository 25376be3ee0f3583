"""Connections to the configured database and the dialects' statements: identifiers quoted, a table
of rows upserted in bulk (PostgreSQL: ``COPY`` into a temporary table, then one ``INSERT ... ON
CONFLICT``; MySQL/MariaDB: multi-row ``INSERT ... ON DUPLICATE KEY UPDATE``)."""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv

from enrich.config import DatabaseDialect
from refstream.errors import ConfigError, RefstreamError, TerminalError, TransientError

log = logging.getLogger(__name__)

__all__ = ["connect", "quote", "upsert", "fence_insert", "transient", "percent"]


#: The statement timeout of a connection opened without one (``output.database.statement_timeout``'s default).
DEFAULT_TIMEOUT = 30.0
#: How much longer than the statement timeout the MySQL client waits for an answer: the server's
#: own limit ends a statement first, with an error that says so.
CLIENT_MARGIN = 5
#: libpq's TCP keepalives: a peer that stops answering is given up on within about a minute.
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}


def connect(url: str, dialect: DatabaseDialect, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """A DB-API connection, autocommit off, read committed, times in UTC, and every statement
    bounded by ``timeout`` seconds, lock waits included (PostgreSQL ``statement_timeout`` and
    ``lock_timeout``; MariaDB ``max_statement_time``, MySQL ``max_execution_time``, both
    ``innodb_lock_wait_timeout`` and ``lock_wait_timeout``, and the client's read and write
    timeouts a little longer): a lock another session holds fails the statement, transiently
    (:func:`transient`), instead of hanging the batch."""
    secs = max(1, math.ceil(timeout))
    try:
        if dialect == "postgresql":
            import psycopg

            conninfo = "postgresql://" + url.split("://", 1)[1]  # libpq takes the URL without a driver suffix
            # libpq reads the URL's own parameters (sslmode, sslrootcert, connect_timeout...); ours where it sets none.
            given: dict[str, Any] = {} if "connect_timeout=" in conninfo else {"connect_timeout": secs + CLIENT_MARGIN}
            # libpq has no read timeout: a server that went away without a word (a host down, a
            # network cut) would leave the task waiting for good. Keepalives end such a wait.
            for name, value in KEEPALIVES.items():
                if f"{name}=" not in conninfo:
                    given[name] = value
            pg = psycopg.connect(conninfo, autocommit=False, **given)
            ms = max(1, round(timeout * 1000))
            pg.execute("SET TIME ZONE 'UTC'")
            pg.execute(f"SET statement_timeout = {ms}")
            pg.execute(f"SET lock_timeout = {ms}")
            pg.commit()
            return pg
        import pymysql

        conn = pymysql.connect(**mysql_args(url, secs + CLIENT_MARGIN))
        mariadb = "mariadb" in str(conn.get_server_info()).lower()
        # MariaDB bounds any statement; MySQL's max_execution_time covers SELECTs only, its writes
        # are bounded by the lock waits and the client's read timeout.
        limit = (f"max_statement_time = {timeout:.3f}" if mariadb
                 else f"max_execution_time = {max(1, round(timeout * 1000))}")
        with conn.cursor() as cur:  # no gap locks: the slots' upserts and fence rows never wait on each other
            cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            # After the URL's own init_command, which may set another time zone.
            cur.execute(f"SET SESSION time_zone = '+00:00', SESSION {limit}, SESSION innodb_lock_wait_timeout = {secs}, "
                        f"SESSION lock_wait_timeout = {secs}")
        return conn
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the drivers' errors differ; classified here
        raise transient(exc, "connecting to the database") from exc


def mysql_args(url: str, timeout: int) -> dict[str, Any]:
    """PyMySQL's arguments for ``url`` as the refresher's SQLAlchemy engine reads the same URL (its
    query's ``ssl_ca``, ``ssl_cert``, ``ssl_key``, ``ssl_check_hostname``... as TLS settings, and
    ``connect_timeout``, ``read_timeout``, ``charset``, ``init_command``... as given), with UTF-8 and
    ``timeout`` (seconds) for what the URL leaves unset; a :class:`ConfigError` naming a query
    parameter PyMySQL does not take."""
    import inspect

    import pymysql
    from sqlalchemy.dialects.mysql.pymysql import MySQLDialect_pymysql
    from sqlalchemy.engine import make_url

    u = make_url(url)
    _, args = MySQLDialect_pymysql().create_connect_args(u)
    if "client_flag" not in u.query:
        args.pop("client_flag", None)  # SQLAlchemy's FOUND_ROWS would change what rowcount counts
    known = set(inspect.signature(pymysql.connections.Connection.__init__).parameters)
    unknown = sorted(k for k in args if k not in known)
    if unknown:
        raise ConfigError(f"output.database.url: unknown parameter(s) {unknown} in the URL's query (PyMySQL "
                          "takes e.g. ssl_ca, ssl_cert, ssl_key, ssl_check_hostname, connect_timeout, read_timeout, "
                          "write_timeout, charset, init_command)")
    args.setdefault("host", "127.0.0.1")
    args.setdefault("user", "root")
    args.setdefault("charset", "utf8mb4")
    for name in ("connect_timeout", "read_timeout", "write_timeout"):
        args.setdefault(name, timeout)
    args["autocommit"] = False
    return dict(args)


#: MySQL/MariaDB errors of a statement that ran out of time: lock wait timeout, MariaDB's
#: max_statement_time, MySQL's max_execution_time.
_MYSQL_TIMEOUTS = {1205, 1969, 3024}


def timed_out(exc: BaseException) -> bool:
    """Whether the database ended a statement for running (or waiting for a lock) too long, or the
    client gave up waiting for its answer."""
    import psycopg
    import pymysql

    if isinstance(exc, psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable):
        return True
    if isinstance(exc, pymysql.err.MySQLError) and exc.args and isinstance(exc.args[0], int):
        return exc.args[0] in _MYSQL_TIMEOUTS or (exc.args[0] == 2013 and "timed out" in str(exc))
    return isinstance(exc, TimeoutError)


def transient(exc: BaseException, what: str) -> Exception:
    """A database error as the job's transient (retried) or terminal error: lost connections,
    deadlocks, serialisation failures and timeouts are transient; SQL errors (a bad table, a bad
    type) are terminal. A timeout says so (``output.database.statement_timeout``)."""
    import psycopg
    import pymysql

    if timed_out(exc):
        return TransientError(f"{what}: timed out (output.database.statement_timeout, lock waits included): "
                              f"{str(exc).strip()}")
    if isinstance(exc, psycopg.OperationalError) or isinstance(exc, psycopg.errors.SerializationFailure) \
            or isinstance(exc, psycopg.errors.DeadlockDetected):
        return TransientError(f"{what}: {exc}")
    if isinstance(exc, pymysql.err.OperationalError):
        return TransientError(f"{what}: {exc}")
    if isinstance(exc, ConnectionError | TimeoutError):
        return TransientError(f"{what}: {exc}")
    return TerminalError(f"{what}: {exc}")


@contextmanager
def classified(what: str) -> Iterator[None]:
    """The drivers' errors raised in the block as the job's transient or terminal errors
    (:func:`transient`, ``what`` naming the work); the job's own errors as they are."""
    try:
        yield
    except RefstreamError:
        raise
    except Exception as exc:  # noqa: BLE001 - the drivers' errors, classified by transient()
        raise transient(exc, what) from exc


def quote(dialect: DatabaseDialect, name: str) -> str:
    if dialect == "postgresql":
        return '"' + name.replace('"', '""') + '"'
    return "`" + name.replace("`", "``") + "`"


def percent(sql: str) -> str:
    """``sql`` (names, no placeholders yet) with its ``%`` doubled, for a statement run with
    parameters: both drivers' paramstyle reads ``%`` there (a column named ``load%``)."""
    return sql.replace("%", "%%")


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
        tmp = _pg_load(cur, name, table)
        update = (f"DO UPDATE SET {', '.join(f'{q(c)} = EXCLUDED.{q(c)}' for c in rest)}" if rest
                  else "DO NOTHING")
        cur.execute(f"INSERT INTO {q(name)} ({names}) SELECT {names} FROM {tmp} "
                    f"ON CONFLICT ({', '.join(q(c) for c in key)}) {update}")
        return
    update = ", ".join(f"{q(c)} = VALUES({q(c)})" for c in (rest or list(key)[:1]))
    cur.executemany(percent(f"INSERT INTO {q(name)} ({names}) VALUES ") + f"({', '.join(['%s'] * len(cols))})"
                    + percent(f" ON DUPLICATE KEY UPDATE {update}"), _py_rows(table))


def replace_held(cur: Any, dialect: DatabaseDialect, name: str, table: pa.Table, key: Sequence[str],
                 identity: Sequence[str]) -> int:
    """Replace with each row of ``table`` the row of table ``name`` with its ``key`` that holds the
    same event (``identity`` equal); a key whose row holds another event, or none, is left as it is
    (nothing inserted). (``key``, ``identity``) must be unique within ``table``. The number of rows
    replaced (a replacement changes the row's ``_revision`` at least, so MySQL's count of changed
    rows is that of matched ones)."""
    if not table.num_rows:
        return 0
    def q(n: str) -> str:
        return quote(dialect, n)

    cols = table.column_names
    rest = [c for c in cols if c not in key]
    match = [*key, *identity]
    if dialect == "postgresql":
        tmp = _pg_load(cur, name, table, clear=True)  # an upsert of this transaction left its rows there
        cur.execute(f"UPDATE {q(name)} AS t SET {', '.join(f'{q(c)} = s.{q(c)}' for c in rest)} FROM {tmp} AS s "
                    f"WHERE {' AND '.join(f't.{q(c)} = s.{q(c)}' for c in match)}")
        return max(int(cur.rowcount), 0)
    sets = ", ".join(f"{percent(q(c))} = %s" for c in rest)
    where = " AND ".join(f"{percent(q(c))} = %s" for c in match)
    cur.executemany(f"UPDATE {percent(q(name))} SET {sets} WHERE {where}", _py_rows(table.select([*rest, *match])))
    return max(int(cur.rowcount), 0)


def _pg_load(cur: Any, name: str, table: pa.Table, *, clear: bool = False) -> str:
    """PostgreSQL: ``table``'s rows COPYed into the session's load table for table ``name`` (made
    like it, emptied at each commit; ``clear``: emptied first); its quoted name."""
    tmp = quote("postgresql", f"_load_{name}")
    names = ", ".join(quote("postgresql", c) for c in table.column_names)
    cur.execute(f"CREATE TEMPORARY TABLE IF NOT EXISTS {tmp} (LIKE {quote('postgresql', name)}) ON COMMIT DELETE ROWS")
    if clear:
        cur.execute(f"DELETE FROM {tmp}")
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
    return tmp


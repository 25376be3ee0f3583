"""Any SQLAlchemy database as a source, read in chunks straight into Arrow.

The rows are streamed with a server-side cursor (PyMySQL ``SSCursor``, a psycopg2 named cursor) and
converted ``chunk_rows`` at a time into Arrow arrays, so at most one chunk of Python tuples exists at
once. Column types come from the driver's result metadata (:mod:`refresh.sources.sqltypes`). With
PyMySQL the values are read as the text MySQL sent and cast per column, by the fast reader
(:mod:`refresh.sources.mysql_fast`) when the connection speaks UTF-8. MySQL/MariaDB sources are read
by ConnectorX instead where it can read the URL and every column exactly (``reader``,
:mod:`refresh.sources.mysql_cx`): the same table, without a Python step per row.

Every session reads in UTC (MySQL/MariaDB ``time_zone``, PostgreSQL ``TimeZone``): ``TIMESTAMP``
columns and the database clock give the same instants whatever the server's or the URL's time zone
(and across daylight-saving changes), so a watermark means the same thing from run to run. The
source config's timeouts bound connecting, waiting for the server and a statement's run time (lock
waits included); :meth:`SqlSource.interrupt` aborts a read from another thread.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from refresh.config import SqlSourceConfig
from refresh.sources import mysql_cx
from refresh.sources.abc import IncrementalSource
from refresh.sources.mysql_fast import ColumnReader, Columns
from refresh.sources.sqltypes import (
    SqliteTimeConverter,
    TextConverter,
    fits,
    mysql_type,
    pg_type,
    sqlite_type,
    unify,
    value_fixer,
)
from refstream import compat
from refstream.errors import DataError, TerminalError, TransientError

__all__ = ["SqlSource"]

log = logging.getLogger(__name__)

_UTF8 = ("utf8", "utf8mb4", "utf-8")


class SqlSource(IncrementalSource):
    """A table (``SELECT *``) or a query of any SQLAlchemy URL."""

    def __init__(self, dataset: str, cfg: SqlSourceConfig, key: Sequence[str] = ()) -> None:
        self.dataset = dataset
        self.cfg = cfg
        self.key = tuple(key)  # the dataset's key, which a read in key ranges checks (empty: unknown)
        if not cfg.url:
            raise TerminalError(f"dataset {dataset}: SQL source without url")
        try:
            url = sa.engine.make_url(cfg.url)
            # NullPool: a daemon running for months must not hold idle connections between runs.
            self.engine = sa.create_engine(url, poolclass=NullPool, connect_args=_connect_args(url, cfg))
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError) as exc:
            raise TerminalError(f"dataset {dataset}: bad database URL {cfg.describe()}: {exc}") from None
        self.dialect = self.engine.dialect.name
        self._pymysql = self.dialect == "mysql" and self.engine.dialect.driver == "pymysql"
        if self.dialect == "mysql":
            sa.event.listen(self.engine, "connect", self._mysql_session)
        self._lock = threading.Lock()
        self._active: Any = None  # the DBAPI connection of the read in progress
        self._session = ""        # the SET statement every MySQL session runs first
        # ConnectorX reads: the URL, the tag naming the running read's statements (interrupt), and
        # the event telling the waiting thread to give the read up.
        self._cx_url = self._connectorx_url(url) if self.dialect == "mysql" else None
        self._cx_tag: str | None = None
        self._cx_abandon = threading.Event()

    def _connectorx_url(self, url: sa.URL) -> str | None:
        """ConnectorX's URL when this source reads with it (``reader``), else None."""
        reader = self.cfg.reader
        if reader == "pymysql":
            return None
        cx_url, why = mysql_cx.url_for(url.host, url.port, url.username, url.password, url.database,
                                       dict(url.query))
        if not mysql_cx.available():
            cx_url, why = None, "connectorx is not installed"
        elif not self._pymysql:  # the column types come from PyMySQL's result metadata
            cx_url, why = None, "the URL's driver is not PyMySQL (mysql+pymysql://)"
        if cx_url is None:
            if reader == "connectorx":
                raise TerminalError(f"dataset {self.dataset}: reader connectorx cannot read "
                                    f"{self.cfg.describe()}: {why}; use reader: pymysql (or auto)")
            log.info("dataset %s: reading with PyMySQL (connectorx cannot: %s)", self.dataset, why)
        return cx_url

    @property
    def reader(self) -> str:
        """What reads this source: ``connectorx`` or the SQLAlchemy driver's name."""
        return "connectorx" if self._cx_url is not None else self.engine.dialect.driver

    def _mysql_session(self, dbapi_conn: Any, _record: Any) -> None:
        """UTC and the statement timeout for every MySQL/MariaDB session (after the URL's own
        ``init_command``, which may set another time zone)."""
        settings = ["time_zone = '+00:00'"]
        limit = self.cfg.statement_timeout
        if limit is not None:
            secs = limit.total_seconds()
            cur = dbapi_conn.cursor()
            try:
                cur.execute("SELECT VERSION()")
                mariadb = "mariadb" in str(cur.fetchone()[0]).lower()
            finally:
                cur.close()
            # MariaDB bounds any statement, lock waits included; MySQL's limit covers SELECTs only.
            settings.append(f"SESSION max_statement_time = {secs:.3f}" if mariadb
                            else f"SESSION max_execution_time = {max(1, round(secs * 1000))}")
            # Metadata-lock waits (a table under LOCK TABLES or DDL) end just after the statement limit.
            settings.append(f"SESSION lock_wait_timeout = {math.ceil(secs) + 1}")
        self._session = "SET " + ", ".join(settings)  # ConnectorX's sessions run it too
        cur = dbapi_conn.cursor()
        try:
            cur.execute(self._session)
        finally:
            cur.close()

    def describe(self) -> str:
        return self.cfg.describe()

    # ------------------------------------------------------------------------------------ SQL
    def _q(self, name: str) -> str:
        prep = self.engine.dialect.identifier_preparer
        return ".".join(prep.quote(part) for part in name.split("."))

    def _base(self) -> str:
        if self.cfg.table:
            return f"SELECT * FROM {self._q(self.cfg.table)}"
        return (self.cfg.query or "").strip().rstrip(";")

    def _since_sql(self, column: str, condition: str = "{col} >= :low") -> str:
        where = condition.format(col=self._q(column))
        if self.cfg.table:
            return f"{self._base()} WHERE {where}"
        return f"SELECT * FROM ({self._base()}) AS refresh_src WHERE {where}"

    def batches(self) -> Iterator[pa.RecordBatch]:
        return self.batches_since("", None)

    def batches_since(self, column: str, low: Any) -> Iterator[pa.RecordBatch]:
        if self._cx_url is not None:
            return self._cx_stream(column, low)
        return self._driver_stream(column, low)

    def _driver_stream(self, column: str, low: Any) -> Iterator[pa.RecordBatch]:
        if low is None:
            return self._stream(self._base(), {})
        if self.dialect == "sqlite" and isinstance(low, dt.date):
            # SQLite stores times as text, and text compares as text: through julianday() a stored
            # offset (-05:00), a 'T' or fewer fraction digits compare as the times they are.
            low = low.isoformat(" ") if isinstance(low, dt.datetime) else low.isoformat()
            return self._stream(self._since_sql(column, "julianday({col}) >= julianday(:low)"), {"low": low})
        return self._stream(self._since_sql(column), {"low": low})

    def now(self) -> Any:
        """The database's "now" in UTC, naive (every session reads in UTC)."""
        sql = {"postgresql": "SELECT LOCALTIMESTAMP", "mysql": "SELECT CURRENT_TIMESTAMP(6)"}.get(
            self.dialect, "SELECT CURRENT_TIMESTAMP")
        with self._errors("read the database clock"), self.engine.connect() as conn:
            value = conn.exec_driver_sql(sql).scalar()
        if isinstance(value, str):  # SQLite
            value = dt.datetime.fromisoformat(value)
        return value

    def probe(self) -> str:
        """Connect and run the read's query for no rows: the table or query exists and is readable."""
        with self._errors("probe"), self.engine.connect() as conn:
            result = conn.exec_driver_sql(f"SELECT * FROM ({self._base()}) AS refresh_src WHERE 1 = 0")
            columns = list(result.keys())
        return f"reachable, columns {', '.join(columns)}"

    def interrupt(self) -> None:
        """Abort the read in progress from another thread (a stop request): the blocked call fails
        at once, and the server stops the statement (MySQL ``KILL``, PostgreSQL cancel)."""
        with self._lock:
            conn, tag = self._active, self._cx_tag
        if tag is not None:
            self._cx_abandon.set()
            self._kill_tagged(tag)
        if conn is None:
            return
        try:
            if self.dialect == "mysql" and hasattr(conn, "thread_id"):
                thread_id = int(conn.thread_id())
                if self._pymysql:
                    compat.pymysql_shutdown(conn)  # the reading thread goes on at once
                # Otherwise the statement would wait on the server (for a lock, say) with nobody reading.
                with self.engine.connect() as killer:
                    killer.exec_driver_sql(f"KILL {thread_id}")
            elif self.dialect == "postgresql" and hasattr(conn, "cancel"):
                conn.cancel()
            elif isinstance(conn, sqlite3.Connection):
                conn.interrupt()
        except Exception as exc:  # noqa: BLE001 - best effort: the connection may be gone already
            log.debug("dataset %s: interrupting the read: %s", self.dataset, exc)

    def _kill_tagged(self, tag: str) -> None:
        """KILL the server connections running a statement that names ``tag`` (a ConnectorX read's)."""
        try:
            with self.engine.connect() as killer:
                ids = killer.exec_driver_sql(
                    "SELECT id FROM information_schema.processlist WHERE INSTR(info, %s) > 0 "
                    "AND id <> CONNECTION_ID()", (tag,)).scalars().all()
                for thread_id in ids:
                    killer.exec_driver_sql(f"KILL {int(thread_id)}")
        except Exception as exc:  # noqa: BLE001 - best effort: the statements may be gone already
            log.debug("dataset %s: killing the connectorx read: %s", self.dataset, exc)

    # ---------------------------------------------------------------------------------- errors
    def _errors(self, what: str) -> Any:
        return _ErrorMap(self, what)

    # ------------------------------------------------------------------------------- connectorx
    def _cx_stream(self, column: str, low: Any) -> Iterator[pa.RecordBatch]:
        """The read by ConnectorX: the column types from a PyMySQL query for no rows, then one
        ConnectorX read (the rows as the PyMySQL path would type them), handed out in chunks. A
        column or value ConnectorX cannot read exactly makes it read with PyMySQL (logged)."""
        where = None
        if low is not None:
            import pymysql.converters

            where = f"{self._q(column)} >= {pymysql.converters.escape_item(low, 'utf8mb4')}"
        fields, key, span = self._describe(where)
        try:
            columns = mysql_cx.plan(fields)
        except mysql_cx.Unreadable as exc:
            log.warning("dataset %s: connectorx cannot read %s exactly; reading with PyMySQL",
                        self.dataset, exc)
            yield from self._driver_stream(column, low)
            return
        tag = f"refresh_cx_{uuid.uuid4().hex[:12]}"
        source = self._q(self.cfg.table) if self.cfg.table else f"({self._base()})"
        parts = [] if key is None or span is None else \
            mysql_cx.ranges(self._q(key), span[0], span[1], self.cfg.read_partitions)
        queries = [mysql_cx.select(columns, self._q, source, tag, _both(where, part)) for part in parts] \
            or [mysql_cx.select(columns, self._q, source, tag, where)]
        try:
            table = mysql_cx.convert(self.dataset, self._cx_read(queries, tag), columns,
                                     key if len(queries) > 1 else None)
            if len(queries) > 1 and key is not None:
                checked = self._check_ranges(table, columns, key, source, tag, where)
                if checked is None:
                    del table  # before the whole table is read again
                    checked = mysql_cx.convert(self.dataset, self._cx_read(
                        [mysql_cx.select(columns, self._q, source, tag, where)], tag), columns, None)
                table = checked
        except mysql_cx.Unreadable as exc:
            log.warning("dataset %s: connectorx cannot read this table exactly (%s); reading with PyMySQL",
                        self.dataset, exc)
            yield from self._driver_stream(column, low)
            return
        batches = table.to_batches(max_chunksize=self.cfg.chunk_rows)
        if not batches:
            batches = [pa.RecordBatch.from_arrays([pa.array([], c.type) for c in columns],
                                                  names=[c.name for c in columns])]
        yield from batches

    def _check_ranges(self, table: pa.Table, columns: list[mysql_cx.Column], pk: str, source: str, tag: str,
                      where: str | None) -> pa.Table | None:
        """``table``, read in ranges of the primary key ``pk``, made a state that every dataset key had
        during the read; None: read it all again in one statement.

        Each range's statement sees its own moment. A key whose row changed range between two of them
        (``pk`` updated, or the row deleted and inserted again under another id) is read in both
        ranges (a duplicate the run would refuse) or in neither (a tombstone for a row that never went
        away). So the dataset's keys are read once more, in one statement, after the ranges: a key read
        twice, or there now but in no range, is read again where it is now, in one statement, and
        replaces what the ranges read of it (a key read twice and gone now is gone). Every other key
        was read once, as it was at its range's moment. When ``pk`` is part of the key, a key cannot
        change range and none of this is needed."""
        key = list(self.key)
        if pk in key or not set(key) <= set(table.column_names):
            return table  # (key columns not in the data: the run refuses them itself)
        narrow = [c for c in columns if c.name in key or c.name == pk]
        now = mysql_cx.convert(self.dataset, self._cx_read(
            [mysql_cx.select(narrow, self._q, source, tag, where)], tag), narrow, None)
        doubt = mysql_cx.suspects(table, now, key)
        if not doubt.num_rows:
            return table
        if doubt.num_rows > REREAD_KEYS:
            log.warning("dataset %s: %d keys changed while the %d key ranges were read; reading again in one "
                        "statement", self.dataset, doubt.num_rows, self.cfg.read_partitions)
            return None
        found = now.take(mysql_cx.rows_of(now, doubt, key, keep=True))
        ids = ", ".join(str(int(i)) for i in pc.unique(found.column(pk)).to_pylist())
        fresh = table.schema.empty_table()
        if ids:
            fresh = mysql_cx.convert(self.dataset, self._cx_read([mysql_cx.select(
                columns, self._q, source, tag, _both(where, f"{self._q(pk)} IN ({ids})"))], tag), columns, None)
            fresh = fresh.take(mysql_cx.rows_of(fresh, doubt, key, keep=True))
        if len(mysql_cx.rows_of(found, fresh.select(key), key, keep=False)) or \
                len(mysql_cx.suspects(fresh, fresh.slice(0, 0), key)):
            # A key moved again (or is there twice) by now: only one statement can settle it.
            log.warning("dataset %s: keys kept changing while the %d key ranges were read; reading again in "
                        "one statement", self.dataset, self.cfg.read_partitions)
            return None
        log.info("dataset %s: %d key(s) changed range or were inserted while the %d key ranges were read: "
                 "re-read (%d row(s) now)", self.dataset, doubt.num_rows, self.cfg.read_partitions, fresh.num_rows)
        keep = np.ones(table.num_rows, bool)
        keep[mysql_cx.rows_of(table, doubt, key, keep=True).to_numpy()] = False
        # Filtered chunk by chunk (no copy of the whole table); the re-read rows come last.
        return pa.concat_tables([table.filter(pa.array(keep)), fresh])

    def _describe(self, where: str | None) -> tuple[list[Any], str | None, tuple[int, int] | None]:
        """PyMySQL's field descriptors of the read's result (a query for no rows), which also checks
        the table or query, bounded by the connect and read timeouts and interruptible; and, for a
        read in ``read_partitions`` key ranges, the key column and its lowest and highest value in
        the rows ``where`` selects (None: no rows)."""
        base = self._q(self.cfg.table) if self.cfg.table else f"({self._base()}) AS refresh_src"
        with self._errors("query"):
            raw = self.engine.raw_connection()
        ok = False
        driver = raw.driver_connection
        assert driver is not None
        with self._lock:
            self._active = driver
        try:
            with self._errors("query"):
                cur = driver.cursor()
                cur.execute(f"SELECT * FROM {base} LIMIT 0")
                fields = compat.pymysql_fields(cur)
                key = mysql_cx.partition_key(fields) if self.cfg.read_partitions > 1 else None
                if self.cfg.read_partitions > 1 and (key is None or not self.key):
                    log.info("dataset %s: read in one statement (read_partitions needs a primary key of one "
                             "integer column%s)", self.dataset, "" if self.key else " and the dataset's key")
                    key = None
                span = None
                if key is not None:
                    cur.execute(f"SELECT MIN({self._q(key)}), MAX({self._q(key)}) FROM {base}"
                                + (f" WHERE {where}" if where else ""))
                    low, high = cur.fetchone()
                    span = None if low is None else (int(low), int(high))
                cur.close()
            ok = True
            return fields, key, span
        finally:
            with self._lock:
                self._active = None
            try:
                raw.close() if ok else raw.invalidate()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                log.debug("closing the connection failed", exc_info=True)

    def _cx_read(self, queries: list[str], tag: str) -> pa.Table:
        """Run ConnectorX in a thread of its own and wait for it: :meth:`interrupt` kills its
        statements on the server and gives the wait up at once, even when the server cannot be
        reached to kill them (the thread then ends with its connection). A server that refuses
        ConnectorX's connections fails the read within about ``connect_timeout`` (:meth:`_cx_watch`)."""
        out: dict[str, Any] = {}
        done, waiting = threading.Event(), threading.Event()

        def work() -> None:
            try:
                out["table"] = mysql_cx.read(self._cx_url or "", queries,
                                             [self._session] if self._session else [])
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                out["error"] = exc
            finally:
                done.set()

        with self._lock:
            self._cx_tag = tag
            self._cx_abandon.clear()
        worker = threading.Thread(target=work, name=f"connectorx-{self.dataset}", daemon=True)
        worker.start()
        waiting.set()
        threading.Thread(target=self._cx_watch, args=(tag, done, waiting, out), name=f"connectorx-watch-{self.dataset}",
                         daemon=True).start()
        try:
            while not done.wait(0.1):
                if self._cx_abandon.is_set():
                    raise TransientError(f"dataset {self.dataset}: read on {self.describe()} interrupted")
        finally:
            waiting.clear()
            with self._lock:
                self._cx_tag = None
        if "table" in out:
            return out["table"]
        exc = out.get("error")
        if exc is None:  # ConnectorX still tries to connect: the watch's error tells why it cannot
            log.debug("dataset %s: giving up the connectorx read (it cannot connect)", self.dataset)
            with self._errors("connect"):
                raise out["connect"]
        if isinstance(exc, mysql_cx.Unreadable) or not isinstance(exc, Exception):
            raise exc
        raise self._cx_error(exc) from exc

    def _cx_watch(self, tag: str, done: threading.Event, waiting: threading.Event, out: dict[str, Any]) -> None:
        """Until the read's statements run on the server, check every half second that the server takes
        a connection like ConnectorX's (PyMySQL, within ``connect_timeout``): ConnectorX retries a
        connection it cannot open (refused, bad password) for 30 s whatever ``connect_timeout`` says.
        A check that cannot connect ends the wait with its error."""
        limit = self.cfg.connect_timeout
        timeout = limit.total_seconds() if limit is not None else 30.0  # "off": ConnectorX's own 30 s
        while not done.wait(0.5) and waiting.is_set():
            try:
                if mysql_cx.running(self._cx_url or "", tag, timeout):
                    return
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                if not done.is_set():
                    out["connect"] = exc
                    done.set()
                return

    def _cx_error(self, exc: Exception) -> Exception:
        """ConnectorX's error as the PyMySQL path would raise it: a statement timeout or a server
        error that no retry fixes is terminal, a connection error transient."""
        code = mysql_cx.server_error(exc)
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        limit = self.cfg.statement_timeout
        if limit is not None and code in (1969, 3024):
            return TerminalError(f"dataset {self.dataset}: read on {self.describe()} timed out after "
                                 f"statement_timeout {limit.total_seconds():g}s (a locked table?): {msg}")
        where = f"dataset {self.dataset}: read on {self.describe()} failed"
        if code is not None and code < 2000 and code not in _MYSQL_TRANSIENT:
            return TerminalError(f"{where}: {msg}")
        return TransientError(f"{where}: {msg}")

    # ---------------------------------------------------------------------------------- reading
    def _stream(self, sql: str, params: dict[str, Any]) -> Iterator[pa.RecordBatch]:
        compiled = sa.text(sql).bindparams(**params).compile(dialect=self.engine.dialect) if params \
            else None
        chunk = self.cfg.chunk_rows
        with self._errors("query"):
            raw = self.engine.raw_connection()
        finished = False
        cur = None
        with self._lock:
            self._active = raw.driver_connection
        try:
            with self._errors("query"):
                cur, text = self._cursor(raw)
                driver = raw.driver_connection
                if compiled is not None:
                    p = compiled.construct_params()
                    args: Any = tuple(p[n] for n in compiled.positiontup or ()) if compiled.positional else p
                    cur.execute(compiled.string, args)
                else:
                    cur.execute(sql)  # no parameters: drivers do no %-interpolation
                fetch = cur.fetchmany
                if text and driver is not None and driver.encoding in _UTF8:
                    fetch = ColumnReader.attach(cur) or fetch
                first = fetch(chunk)
                columns = [d[0] for d in cur.description]
                types = self._types(cur, text)
            yield from self._convert(fetch, first, columns, types, chunk, text)
            finished = True
        finally:
            with self._lock:
                self._active = None
            try:
                if finished:
                    raw.close()
                else:
                    # Abandoned mid-stream (error, stop): drop the connection rather than reset it,
                    # which would have to drain the rest of the result first.
                    if cur is not None and self._pymysql:
                        compat.pymysql_abandon(cur)
                    raw.invalidate()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                log.debug("closing the connection failed", exc_info=True)

    def _cursor(self, raw: Any) -> tuple[Any, bool]:
        """A cursor for one read, and whether its rows hold MySQL's text (cast per column by Arrow)."""
        if self._pymysql:
            # Text costs a fraction of building a Decimal or datetime per value. The connection is
            # this read's own (NullPool), so nothing else sees the change of decoders.
            cur = compat.pymysql_text_cursor(raw.driver_connection)
            if cur is not None:
                return cur, True
            import pymysql.cursors

            return raw.driver_connection.cursor(pymysql.cursors.SSCursor), False
        if self.dialect == "postgresql" and self.engine.dialect.driver == "psycopg2":
            cur = raw.driver_connection.cursor(name=f"refresh_{self.dataset}"[:60])
            cur.itersize = self.cfg.chunk_rows
            return cur, False
        return raw.cursor(), False

    def _types(self, cur: Any, text: bool) -> list[pa.DataType | None]:
        """Arrow type per column from the driver's metadata (None: infer from the values)."""
        if text:
            return [mysql_type(f) for f in compat.pymysql_fields(cur)]
        if self.dialect == "postgresql":
            return [pg_type(d) for d in cur.description]
        if self.dialect == "sqlite" and self.cfg.table:
            declared = self._sqlite_declared(cur.connection)
            return [sqlite_type(declared.get(d[0])) for d in cur.description]
        return [None] * len(cur.description)

    def _sqlite_declared(self, conn: Any) -> dict[str, str]:
        """The declared type of each column of the source's SQLite table (its result metadata has none)."""
        schema, _, table = self.cfg.table.rpartition(".") if self.cfg.table else ("", "", "")
        prep = self.engine.dialect.identifier_preparer
        pragma = f"PRAGMA {prep.quote(schema) + '.' if schema else ''}table_info({prep.quote(table)})"
        return {row[1]: row[2] for row in conn.execute(pragma).fetchall()}

    def _convert(self, fetch: Callable[[int], Any], first: Sequence[Sequence[Any]] | Columns,
                 columns: list[str], types: list[pa.DataType | None], chunk: int,
                 text: bool) -> Iterator[pa.RecordBatch]:
        inferred = any(t is None for t in types)
        fixers = [TextConverter(self.dataset, columns[i], t) if text
                  else SqliteTimeConverter(self.dataset, columns[i], t) if t is not None and self.dialect == "sqlite"
                  else value_fixer(t, self.dialect) for i, t in enumerate(types)]
        pending: list[list[pa.Array]] = []
        rows = first
        while True:
            if isinstance(rows, Columns):
                cols: list[Any] = rows.arrays
            else:
                cols = list(zip(*rows, strict=True)) if rows else [()] * len(columns)
            arrays = [self._array(columns[i], cols[i], types[i], fixers[i]) for i in range(len(columns))]
            if inferred:
                pending.append(arrays)  # the types settle only once every chunk was seen
            else:
                yield pa.RecordBatch.from_arrays(arrays, names=columns)
            if not rows:
                break
            with self._errors("read"):
                rows = fetch(chunk)
            if not rows and (not inferred or pending):
                break
        yield from unify(pending, columns)

    def _array(self, name: str, values: Sequence[Any], t: pa.DataType | None, fix: Any) -> pa.Array:
        if isinstance(fix, TextConverter):
            return fix(values)
        if fix is not None:
            values = [None if v is None else fix(v) for v in values]
        try:
            return pa.array(values, type=t) if t is not None else pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            if t is None:  # mixed value types in an untyped column: keep them as text
                return pa.array([None if v is None else str(v) for v in values], pa.string())
            bad = next((v for v in values if v is not None and not fits(v, t)), None)
            raise DataError(f"dataset {self.dataset}: column {name}: value {bad!r} does not fit "
                            f"{t}: {exc}") from None


class _ErrorMap:
    """Turn driver errors into TransientError (connection trouble) or TerminalError (bad SQL, data)."""

    def __init__(self, src: SqlSource, what: str) -> None:
        self.src, self.what = src, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, TerminalError | TransientError):
            return False
        src = self.src
        dbapi = src.engine.dialect.dbapi
        transient_types: tuple[type, ...] = (sa.exc.OperationalError, sa.exc.InterfaceError,
                                             sa.exc.DisconnectionError, ConnectionError, TimeoutError)
        if dbapi is not None:
            transient_types += (dbapi.OperationalError, dbapi.InterfaceError)
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        limit = src.cfg.statement_timeout
        if limit is not None and _statement_timed_out(exc):
            # Not retried within the run: the next one (schedule, retry) tries again.
            raise TerminalError(f"dataset {src.dataset}: {self.what} on {src.describe()} timed out after "
                                f"statement_timeout {limit.total_seconds():g}s (a locked table?): {msg}") from exc
        where = f"dataset {src.dataset}: {self.what} on {src.describe()} failed"
        if isinstance(exc, transient_types) and not _terminal_sqlite(exc):
            raise TransientError(f"{where}: {msg}") from exc
        if isinstance(exc, sa.exc.DBAPIError | sa.exc.SQLAlchemyError) or (
                dbapi is not None and isinstance(exc, dbapi.Error)):
            raise TerminalError(f"{where}: {msg}") from exc
        return False


#: A read in key ranges re-reads at most this many keys that changed range during the read (or were
#: inserted into a range already read); more (a mass change) and it reads everything again at once.
REREAD_KEYS = 10_000

# MySQL server errors worth a retry (too many connections, shutdown, lock timeout, deadlock, query
# interrupted, connection killed); client errors (2000+: cannot connect, server gone away) always are.
_MYSQL_TRANSIENT = {1040, 1053, 1205, 1213, 1317, 1927, 3024}


def _connect_args(url: sa.URL, cfg: SqlSourceConfig) -> dict[str, Any]:
    """Driver arguments for the timeouts of ``cfg`` (what the URL's query sets itself wins) and, for
    PostgreSQL, the UTC session."""
    driver = url.get_driver_name()
    have = set(url.query)
    args: dict[str, Any] = {}
    connect, read, statement = cfg.connect_timeout, cfg.read_timeout, cfg.statement_timeout
    if url.get_backend_name() == "mysql" and driver in ("pymysql", "mysqldb"):
        if connect is not None:
            args["connect_timeout"] = max(1, math.ceil(connect.total_seconds()))
        if read is not None:
            args["read_timeout"] = args["write_timeout"] = max(1, math.ceil(read.total_seconds()))
    elif url.get_backend_name() == "postgresql" and driver == "psycopg2":
        if connect is not None:
            args["connect_timeout"] = max(2, math.ceil(connect.total_seconds()))  # libpq's minimum
        options = ["-c TimeZone=UTC"]
        if statement is not None:
            options.append(f"-c statement_timeout={max(1, round(statement.total_seconds() * 1000))}")
        given = url.query.get("options")
        args["options"] = " ".join(([given] if isinstance(given, str) else list(given or ())) + options)
        have.discard("options")
    return {k: v for k, v in args.items() if k not in have}


def _both(where: str | None, cond: str) -> str:
    return f"({where}) AND {cond}" if where else cond


def _statement_timed_out(exc: BaseException) -> bool:
    """Whether the server ended a statement for running past its time limit."""
    inner = getattr(exc, "orig", exc)
    if getattr(inner, "pgcode", None) == "57014":  # query_canceled: statement_timeout (or a cancel)
        return "statement timeout" in str(inner)
    code = inner.args[0] if inner.args and isinstance(inner.args[0], int) else None
    # MariaDB max_statement_time exceeded; MySQL max_execution_time exceeded.
    return code in (1969, 3024) and type(inner).__module__.startswith(("pymysql", "MySQLdb"))


def _terminal_sqlite(exc: BaseException) -> bool:
    """Driver errors classed "operational" that no retry can fix."""
    inner = getattr(exc, "orig", exc)
    if isinstance(inner, sqlite3.OperationalError):
        return "no such" in str(inner) or "syntax" in str(inner)
    code = inner.args[0] if inner.args and isinstance(inner.args[0], int) else None
    if code is not None and type(inner).__module__.startswith(("pymysql", "MySQLdb")):
        return code < 2000 and code not in _MYSQL_TRANSIENT
    return False

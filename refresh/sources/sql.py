"""Any SQLAlchemy database as a source, read in chunks straight into Arrow.

The rows are streamed with a server-side cursor (PyMySQL ``SSCursor``, a psycopg2 named cursor) and
converted ``chunk_rows`` at a time into Arrow arrays, so at most one chunk of Python tuples exists at
once. Column types come from the driver's result metadata, not from the values, so an all-NULL chunk
or column keeps its type and DECIMAL keeps its precision and scale:

    MySQL/MariaDB  DECIMAL(p,s) -> decimal128(p,s) (exact), integers/YEAR -> int64, FLOAT/DOUBLE ->
                   float64, DATE -> date32, DATETIME/TIMESTAMP -> timestamp[us] (as the session sees
                   them, no zone), TIME -> duration[us], BINARY/VARBINARY/BLOB/BIT -> binary,
                   text/ENUM/SET/JSON -> string
    PostgreSQL     numeric(p,s), integers, floats, bool, text, bytea, date, timestamp, timestamptz
                   (UTC), time, json/jsonb (as JSON text), uuid
    others         (SQLite...) typed from the values read.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pymysql.err
import pymysql.protocol
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from refresh.config import SqlSourceConfig
from refresh.sources.abc import IncrementalSource
from refstream.errors import DataError, TerminalError, TransientError

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
_MY_GEOMETRY = 255
_MY_BINARY_CHARSET = 63
_MY_UNSIGNED = 32

# PostgreSQL type OIDs.
_PG = {16: pa.bool_(), 20: pa.int64(), 21: pa.int64(), 23: pa.int64(), 26: pa.int64(),
       700: pa.float64(), 701: pa.float64(), 17: pa.binary(), 25: pa.string(), 1043: pa.string(),
       1042: pa.string(), 19: pa.string(), 18: pa.string(), 2950: pa.string(), 114: pa.string(),
       3802: pa.string(), 1082: pa.date32(), 1114: pa.timestamp("us"),
       1184: pa.timestamp("us", tz="UTC"), 1083: pa.time64("us")}
_PG_JSON = {114, 3802}
_PG_NUMERIC = 1700


class SqlSource(IncrementalSource):
    """A table (``SELECT *``) or a query of any SQLAlchemy URL."""

    def __init__(self, dataset: str, cfg: SqlSourceConfig) -> None:
        self.dataset = dataset
        self.cfg = cfg
        if not cfg.url:
            raise TerminalError(f"dataset {dataset}: SQL source without url")
        try:
            # NullPool: a daemon running for months must not hold idle connections between runs.
            self.engine = sa.create_engine(cfg.url, poolclass=NullPool)
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError) as exc:
            raise TerminalError(f"dataset {dataset}: bad database URL {cfg.describe()}: {exc}") from None
        self.dialect = self.engine.dialect.name

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

    def _since_sql(self, column: str) -> str:
        if self.cfg.table:
            return f"{self._base()} WHERE {self._q(column)} >= :low"
        return f"SELECT * FROM ({self._base()}) AS refresh_src WHERE {self._q(column)} >= :low"

    def batches(self) -> Iterator[pa.RecordBatch]:
        return self._stream(self._base(), {})

    def batches_since(self, column: str, low: Any) -> Iterator[pa.RecordBatch]:
        if low is None:
            return self._stream(self._base(), {})
        return self._stream(self._since_sql(column), {"low": low})

    def now(self) -> Any:
        sql = {"postgresql": "SELECT LOCALTIMESTAMP", "mysql": "SELECT CURRENT_TIMESTAMP(6)"}.get(
            self.dialect, "SELECT CURRENT_TIMESTAMP")
        with self._errors("read the database clock"), self.engine.connect() as conn:
            value = conn.exec_driver_sql(sql).scalar()
        if isinstance(value, str):  # SQLite
            value = dt.datetime.fromisoformat(value)
        return value

    # ---------------------------------------------------------------------------------- errors
    def _errors(self, what: str) -> Any:
        return _ErrorMap(self, what)

    # ---------------------------------------------------------------------------------- reading
    def _stream(self, sql: str, params: dict[str, Any]) -> Iterator[pa.RecordBatch]:
        compiled = sa.text(sql).bindparams(**params).compile(dialect=self.engine.dialect) if params \
            else None
        chunk = self.cfg.chunk_rows
        with self._errors("query"):
            raw = self.engine.raw_connection()
        finished = False
        cur = None
        try:
            with self._errors("query"):
                cur = self._cursor(raw)
                if compiled is not None:
                    p = compiled.construct_params()
                    args: Any = tuple(p[n] for n in compiled.positiontup) if compiled.positional else p
                    cur.execute(compiled.string, args)
                else:
                    cur.execute(sql)  # no parameters: drivers do no %-interpolation
                fetch = cur.fetchmany
                if self._mysql_text() and raw.driver_connection.encoding in _UTF8:
                    fetch = _PyMySQLColumns.attach(cur) or fetch
                first = fetch(chunk)
                columns = [d[0] for d in cur.description]
                types = self._types(cur)
            yield from self._convert(fetch, first, columns, types, chunk)
            finished = True
        finally:
            try:
                if finished:
                    raw.close()
                else:
                    # Abandoned mid-stream (error, stop): drop the connection rather than reset it,
                    # which would have to drain the rest of the result first. PyMySQL would also try
                    # to drain it when the result is collected: tell it the stream is over.
                    result = getattr(cur, "_result", None)
                    if result is not None and getattr(result, "unbuffered_active", False):
                        result.unbuffered_active = False
                    raw.invalidate()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                log.debug("closing the connection failed", exc_info=True)

    def _mysql_text(self) -> bool:
        return self.dialect == "mysql" and self.engine.dialect.driver == "pymysql"

    def _cursor(self, raw: Any) -> Any:
        if self._mysql_text():
            import pymysql.cursors

            # Values stay the text MySQL sent (bytes for binary columns); Arrow casts them by column
            # (C++), which costs a fraction of building a Decimal or datetime per value. The
            # connection is this read's own (NullPool), so nothing else sees the change.
            raw.driver_connection.decoders = {}
            return raw.driver_connection.cursor(pymysql.cursors.SSCursor)
        if self.dialect == "postgresql" and self.engine.dialect.driver == "psycopg2":
            cur = raw.driver_connection.cursor(name=f"refresh_{self.dataset}"[:60])
            cur.itersize = self.cfg.chunk_rows
            return cur
        return raw.cursor()

    def _types(self, cur: Any) -> list[pa.DataType | None]:
        """Arrow type per column from the driver's metadata (None: infer from the values)."""
        if self.dialect == "mysql":
            fields = getattr(getattr(cur, "_result", None), "fields", None)
            if fields is not None:
                return [_mysql_type(f) for f in fields]
        if self.dialect == "postgresql":
            return [_pg_type(d) for d in cur.description]
        return [None] * len(cur.description)

    def _convert(self, fetch: Any, first: Sequence[Sequence[Any]], columns: list[str],
                 types: list[pa.DataType | None], chunk: int) -> Iterator[pa.RecordBatch]:
        inferred = any(t is None for t in types)
        text = self._mysql_text()
        fixers = [_text_converter(self.dataset, columns[i], t) if text else _fixer(t, self.dialect)
                  for i, t in enumerate(types)]
        pending: list[list[pa.Array]] = []
        rows = first
        while True:
            if isinstance(rows, _Columns):
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
        yield from _unify(pending, columns)

    def _array(self, name: str, values: Sequence[Any], t: pa.DataType | None, fix: Any) -> pa.Array:
        if isinstance(fix, _TextConverter):
            return fix(values)
        if fix is not None:
            values = [None if v is None else fix(v) for v in values]
        try:
            return pa.array(values, type=t) if t is not None else pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            if t is None:  # mixed value types in an untyped column: keep them as text
                return pa.array([None if v is None else str(v) for v in values], pa.string())
            bad = next((v for v in values if v is not None and not _fits(v, t)), None)
            raise DataError(f"dataset {self.dataset}: column {name}: value {bad!r} does not fit "
                            f"{t}: {exc}") from None


class _ErrorMap:
    """Turn driver errors into TransientError (connection trouble) or TerminalError (bad SQL, data)."""

    def __init__(self, src: SqlSource, what: str) -> None:
        self.src, self.what = src, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, TerminalError | TransientError):
            return False
        src = self.src
        dbapi = src.engine.dialect.dbapi
        transient_types: tuple[type, ...] = (sa.exc.OperationalError, sa.exc.InterfaceError,
                                             sa.exc.DisconnectionError, ConnectionError, TimeoutError)
        if dbapi is not None:
            transient_types += (dbapi.OperationalError, dbapi.InterfaceError)
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"dataset {src.dataset}: {self.what} on {src.describe()} failed"
        if isinstance(exc, transient_types) and not _terminal_sqlite(exc):
            raise TransientError(f"{where}: {msg}") from exc
        if isinstance(exc, sa.exc.DBAPIError | sa.exc.SQLAlchemyError) or (
                dbapi is not None and isinstance(exc, dbapi.Error)):
            raise TerminalError(f"{where}: {msg}") from exc
        return False


# MySQL server errors worth a retry (too many connections, shutdown, lock timeout, deadlock, query
# interrupted, connection killed); client errors (2000+: cannot connect, server gone away) always are.
_MYSQL_TRANSIENT = {1040, 1053, 1205, 1213, 1317, 1927, 3024}


def _terminal_sqlite(exc: BaseException) -> bool:
    """Driver errors classed "operational" that no retry can fix."""
    inner = getattr(exc, "orig", exc)
    if isinstance(inner, sqlite3.OperationalError):
        return "no such" in str(inner) or "syntax" in str(inner)
    code = inner.args[0] if inner.args and isinstance(inner.args[0], int) else None
    if code is not None and type(inner).__module__.startswith(("pymysql", "MySQLdb")):
        return code < 2000 and code not in _MYSQL_TRANSIENT
    return False


def _mysql_type(f: Any) -> pa.DataType:
    tc = f.type_code
    if tc in _MY_INT:
        return pa.int64()
    if tc in _MY_FLOAT:
        return pa.float64()
    if tc in _MY_DECIMAL:
        scale = int(f.scale or 0)
        unsigned = bool(f.flags & _MY_UNSIGNED)
        precision = int(f.length) - (1 if scale else 0) - (0 if unsigned else 1)
        precision = max(precision, scale, 1)
        return pa.decimal128(precision, scale) if precision <= 38 else pa.decimal256(min(precision, 76), scale)
    if tc in _MY_DATE:
        return pa.date32()
    if tc in _MY_DATETIME:
        return pa.timestamp("us")
    if tc == _MY_TIME:
        return pa.duration("us")
    if tc in (_MY_BIT, _MY_GEOMETRY):
        return pa.binary()
    if tc in _MY_TEXTISH:
        return pa.binary() if f.charsetnr == _MY_BINARY_CHARSET and tc != 245 else pa.string()
    if tc == 6:  # NULL literal
        return pa.string()
    return pa.string()


def _pg_type(d: Any) -> pa.DataType | None:
    oid = d.type_code
    if oid == _PG_NUMERIC:
        p, s = d.precision, d.scale
        if p and 0 < p <= 1000 and s is not None and 0 <= s <= p:
            return pa.decimal128(p, s) if p <= 38 else pa.decimal256(min(p, 76), s)
        return None  # unconstrained numeric: typed from the values
    return _PG.get(oid)


class _TextConverter:
    """MySQL text values of one column -> an Arrow array of its type, cast vectorised."""

    def __init__(self, dataset: str, column: str, t: pa.DataType) -> None:
        self.dataset, self.column, self.type = dataset, column, t
        self.warned = False

    def __call__(self, values: Sequence[Any] | pa.Array) -> pa.Array:
        t = self.type
        if isinstance(values, pa.Array):  # the fast row parser hands out a binary array per column
            if pa.types.is_large_binary(values.type):
                raise DataError(f"dataset {self.dataset}: column {self.column}: over 2 GB of values in "
                                f"one chunk of {len(values)} rows; lower chunk_rows")
            raw = values
            if pa.types.is_duration(t):
                return pa.array([None if v is None else _parse_time(v) for v in raw.to_pylist()], t)
            first = b""
        else:
            if pa.types.is_duration(t):
                return pa.array([None if v is None else _parse_time(v) for v in values], t)
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


def _fits_text(v: str, t: pa.DataType) -> bool:
    try:
        pc.cast(pa.array([v], pa.string()), t)
        return True
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False


_UTF8 = ("utf8", "utf8mb4", "utf-8")


class _Columns:
    """One chunk of a MySQL text result as one Arrow binary array per column (raw value bytes)."""

    __slots__ = ("arrays", "num_rows")

    def __init__(self, arrays: list[pa.Array], num_rows: int) -> None:
        self.arrays, self.num_rows = arrays, num_rows

    def __len__(self) -> int:
        return self.num_rows


class _PyMySQLColumns:
    """Rows of an unbuffered PyMySQL text result read straight off the connection's stream and split
    into columns vectorised. PyMySQL spends most of a large read in per-row and per-value Python calls;
    here Python only walks the packet headers (one step per row, same checks: sequence numbers, error
    and EOF packets), and numpy finds every value of a chunk column by column and gathers its bytes
    into an Arrow binary array (Arrow then validates and casts it per column). Attached only when
    PyMySQL's internals look as expected; otherwise ``fetchmany`` is used."""

    def __init__(self, cur: Any) -> None:
        self.result = cur._result
        self.conn = self.result.connection
        self.ncols = len(self.result.fields)

    @classmethod
    def attach(cls, cur: Any) -> Any:
        result = getattr(cur, "_result", None)
        conn = getattr(result, "connection", None)
        rfile = getattr(conn, "_rfile", None)
        if result is None or not getattr(result, "unbuffered_active", False) or not getattr(result, "fields", None) \
                or not all(hasattr(conn, a) for a in ("_next_seq_id", "_force_close", "encoding")) \
                or not hasattr(rfile, "peek") or not hasattr(rfile, "read"):
            return None
        return cls(cur).fetch

    def _lost(self, detail: str = "") -> pymysql.err.OperationalError:
        self.conn._force_close()
        return pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query" + detail)

    def _io(self, fn: Any, *args: Any) -> bytes:
        while True:
            try:
                return fn(*args)
            except InterruptedError:
                continue
            except OSError as exc:
                raise self._lost(f" ({exc})") from None
            except BaseException:
                self.conn._force_close()
                raise

    def _read_exactly(self, n: int) -> bytes:
        data = self._io(self.conn._rfile.read, n)
        if len(data) < n:
            raise self._lost()
        return data

    def _packet(self) -> bytes:
        """One whole logical packet, read the slow way (it straddles the read buffer, or is >= 16 MB)."""
        conn = self.conn
        parts = []
        while True:
            header = self._read_exactly(4)
            length = header[0] | header[1] << 8 | header[2] << 16
            if header[3] != conn._next_seq_id:
                raise self._lost(" (packet sequence number wrong)")
            conn._next_seq_id = (conn._next_seq_id + 1) % 256
            parts.append(self._read_exactly(length))
            if length < 0xFFFFFF:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def _end(self, payload: bytes) -> bool:
        """Handle a packet that is not a row: True at the end of the result, raises on an error."""
        result = self.result
        first = payload[0] if payload else -1
        if first == 0xFE and len(payload) < 9:  # EOF: the result is complete
            result._check_packet_is_eof(pymysql.protocol.MysqlPacket(payload, self.conn.encoding))
            result.unbuffered_active = False
            result.connection = None
            result.rows = None
            return True
        if first == 0xFF:  # an error packet: the query failed part of the way through
            result.unbuffered_active = False
            pymysql.protocol.MysqlPacket(payload, self.conn.encoding).raise_for_error()
        return False

    def fetch(self, size: int) -> _Columns | list[Any]:
        if not self.result.unbuffered_active:
            return []
        conn = self.conn
        rfile = conn._rfile
        out = bytearray()          # the chunk's row payloads (packet headers between them)
        starts: list[int] = []     # per row: offset of its payload in ``out`` and of its end
        ends: list[int] = []
        while len(starts) < size:
            # Walk the complete packets already in the read buffer without copying them one by one.
            block = self._io(rfile.peek, 1)
            if not block:
                raise self._lost()
            avail, p, seq = len(block), 0, conn._next_seq_id
            base = len(out)
            room = size - len(starts)
            done = False
            while room and p + 5 <= avail:
                length = block[p] | block[p + 1] << 8 | block[p + 2] << 16
                end = p + 4 + length
                if end > avail or length == 0xFFFFFF or length == 0:
                    break
                if block[p + 3] != seq:
                    self._io(rfile.read, p)
                    raise self._lost(" (packet sequence number wrong)")
                first = block[p + 4]
                if first == 0xFE and length < 9 or first == 0xFF:
                    done = True
                    break
                seq = (seq + 1) & 0xFF
                starts.append(base + p + 4)
                ends.append(base + end)
                p = end
                room -= 1
            if p:
                out += block[:p]
                self._io(rfile.read, p)  # from the buffer: no system call
                conn._next_seq_id = seq
            if not room:
                break
            if done or p == 0:
                # Not a row, or a packet the buffer does not hold whole: read it the slow way.
                payload = self._packet()
                if self._end(payload):
                    break
                starts.append(len(out))
                out += payload
                ends.append(len(out))
        if not starts:
            return []
        return _Columns(self._split(out, starts, ends), len(starts))

    def _split(self, out: bytearray, starts: list[int], ends: list[int]) -> list[pa.Array]:
        """Every value of every row in ``out`` as one binary array per column (NULL stays NULL)."""
        buf = np.frombuffer(out, np.uint8)
        end = np.array(ends, np.int64)
        pos = np.array(starts, np.int64)
        arrays = []
        for _ in range(self.ncols):
            if (pos >= end).any():
                raise self._malformed()
            n = buf[pos].astype(np.int64)
            hdr = np.ones_like(n)
            null = None
            big = np.flatnonzero(n >= 251)
            if len(big):
                code = n[big]
                width = np.select([code == 252, code == 253, code == 254], [2, 3, 8], 0)
                if (code == 255).any() or (pos[big] + 1 + width > end[big]).any():
                    raise self._malformed()
                at = pos[big] + 1
                length = np.zeros(len(big), np.int64)
                for k in range(8):  # little-endian length of 2, 3 or 8 bytes
                    has = width > k
                    length[has] |= buf[at[has] + k].astype(np.int64) << (8 * k)
                n[big] = length
                hdr[big] += width
                is_null = code == 251
                if is_null.any():
                    null = np.zeros(len(n), bool)
                    null[big[is_null]] = True
            start = pos + hdr
            pos = start + n
            arrays.append(_gather(buf, start, n, null))
        if not np.array_equal(pos, end):
            raise self._malformed()
        return arrays

    def _malformed(self) -> pymysql.err.InternalError:
        self.conn._force_close()
        return pymysql.err.InternalError("malformed row packet in a MySQL result")


def _gather(buf: np.ndarray, start: np.ndarray, length: np.ndarray, null: np.ndarray | None) -> pa.Array:
    """The byte ranges ``[start, start + length)`` of ``buf`` as one Arrow binary array."""
    offsets = np.zeros(len(length) + 1, np.int64)
    np.cumsum(length, out=offsets[1:])
    total = int(offsets[-1])
    # Index of every byte to copy: each range's start shifted by where it lands in the output.
    data = buf[np.repeat(start - offsets[:-1], length) + np.arange(total, dtype=np.int64)]
    t, otype = (pa.binary(), np.int32) if total < 2**31 else (pa.large_binary(), np.int64)
    validity = None
    if null is not None:
        validity = pa.py_buffer(np.packbits(~null, bitorder="little"))
    return pa.Array.from_buffers(t, len(length), [validity, pa.py_buffer(offsets.astype(otype)),
                                                  pa.py_buffer(data)], null_count=0 if null is None else int(null.sum()))


def _parse_time(v: str | bytes) -> dt.timedelta:
    """MySQL TIME text (``-838:59:59.000000`` .. ``838:59:59``) as a timedelta."""
    if isinstance(v, bytes | bytearray):
        v = v.decode("ascii")
    neg = v.startswith("-")
    h, m, rest = v.lstrip("-").split(":")
    sec, _, frac = rest.partition(".")
    td = dt.timedelta(hours=int(h), minutes=int(m), seconds=int(sec),
                      microseconds=int((frac + "000000")[:6]) if frac else 0)
    return -td if neg else td


def _text_converter(dataset: str, column: str, t: pa.DataType | None) -> _TextConverter:
    return _TextConverter(dataset, column, t if t is not None else pa.string())


def _fixer(t: pa.DataType | None, dialect: str) -> Any:
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


def _fits(v: Any, t: pa.DataType) -> bool:
    try:
        pa.array([v], type=t)
        return True
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
        return False


def _unify(chunks: list[list[pa.Array]], columns: list[str]) -> Iterator[pa.RecordBatch]:
    """Give every chunk of an untyped source the same column types (nulls take the others' type,
    ints become floats beside floats, anything else mixed becomes text)."""
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
            digits = max(t.precision - t.scale for t in ts) + scale
            final.append(pa.decimal128(digits, scale) if digits <= 38 else pa.decimal256(min(digits, 76), scale))
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

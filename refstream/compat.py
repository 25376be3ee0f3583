"""Every use of a third-party private API, in one place.

A few hot paths reach under a library's public surface: the fast MySQL reader reads PyMySQL's socket
buffer and result state, the join probes pandas' hash tables, the enrichment job parses Spark DDL.
Each use lives here behind a small function that checks the library version it was written against
(a supported range) and that the private names still exist. Outside the range, or when a name is
gone, it logs one warning naming the library, its version and what to do, and takes the public
fallback (slower, same result); where no fallback exists it raises :class:`CompatError`. An upgrade
therefore breaks here, with a clear message, and nowhere else.

Third-party libraries are imported inside the functions: the refresher must not need Spark, nor the
enrichment job PyMySQL.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np

from refstream.errors import TerminalError

if TYPE_CHECKING:
    from pyspark.sql.types import DataType, StructType

__all__ = [
    "PANDAS_SUPPORTED",
    "PYMYSQL_SUPPORTED",
    "PYSPARK_LOOKUP_SUPPORTED",
    "PYSPARK_SUPPORTED",
    "CompatError",
    "KeyIndex",
    "PyMySQLStream",
    "key_index",
    "pymysql_abandon",
    "pymysql_fields",
    "pymysql_shutdown",
    "pymysql_stream",
    "pymysql_text_cursor",
    "spark_ddl_type",
    "spark_logger_level",
    "spark_schema",
    "spark_skip_python_data_source_lookup",
    "spark_state_server_timeout",
    "supported",
    "version",
]

log = logging.getLogger(__name__)

#: Versions each private use was checked against: [low, high).
PYMYSQL_SUPPORTED = ((1, 1), (2,))
PANDAS_SUPPORTED = ((2, 0), (4,))
PYSPARK_SUPPORTED = ((3, 0), (5,))
PYSPARK_LOOKUP_SUPPORTED = ((4, 0), (5,))  # DataSourceManager.dataSourceBuilders

_warned: set[str] = set()


class CompatError(TerminalError):
    """An installed library lacks a private API this code needs and there is no fallback."""


@functools.cache
def version(dist: str) -> tuple[int, ...] | None:
    """The installed version of distribution ``dist`` as numbers (``"2.2.8rc1"`` -> (2, 2, 8)), None
    when it is not installed. Cached: every read asks, and the metadata lookup walks sys.path."""
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for part in text.split(".")[:3]:
        m = re.match(r"\d+", part)
        if m is None:
            break
        parts.append(int(m.group()))
    return tuple(parts)


def _shown(v: tuple[int, ...] | None) -> str:
    return "(not installed)" if v is None else ".".join(map(str, v))


def _range(supported: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
    low, high = supported
    return f">={_shown(low)},<{_shown(high)}"


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def supported(dist: str, name: str, what: str, rng: tuple[tuple[int, ...], tuple[int, ...]],
              fallback: str) -> bool:
    """Whether the installed ``dist`` is in ``rng``, the versions ``what`` was checked against; warns
    once (naming ``name``, the version, ``fallback`` and the fix) when it is not."""
    v = version(dist)
    if v is not None and rng[0] <= v < rng[1]:
        return True
    _warn_once(f"{dist}:{what}:version",
               "%s %s is outside the versions %s that %s was checked against: %s. Install %s%s, or "
               "check refstream/compat.py against this version and widen the range.",
               name, _shown(v), _range(rng), what, fallback, dist, _range(rng))
    return False


def _missing(dist: str, name: str, what: str, names: list[str], fallback: str,
             rng: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    _warn_once(f"{dist}:{what}:missing",
               "%s %s has no %s, which %s uses: %s. Adapt refstream/compat.py to this version, or "
               "install %s%s.", name, _shown(version(dist)), ", ".join(names), what, fallback, dist, _range(rng))


# ------------------------------------------------------------------------------------------- PyMySQL

_PYMYSQL_TEXT = "reading MySQL values as text"
_PYMYSQL_FAST = "the fast MySQL row reader"


def pymysql_text_cursor(conn: Any) -> Any | None:
    """An unbuffered cursor of PyMySQL connection ``conn`` whose rows hold the values as the text
    MySQL sent (bytes for binary columns), so that Arrow converts them per column; None when this
    PyMySQL is not one that was checked (then read with a plain ``SSCursor`` and PyMySQL's own
    conversions). ``conn`` must be the read's own connection: its decoders are switched off."""
    import pymysql.cursors

    fallback = "reading with PyMySQL's own value conversion (slower; types come from the values)"
    if not supported("PyMySQL", "PyMySQL", _PYMYSQL_TEXT, PYMYSQL_SUPPORTED, fallback):
        return None
    if not hasattr(conn, "decoders"):
        _missing("PyMySQL", "PyMySQL", _PYMYSQL_TEXT, ["Connection.decoders"], fallback, PYMYSQL_SUPPORTED)
        return None
    conn.decoders = {}
    return conn.cursor(pymysql.cursors.SSCursor)


def pymysql_fields(cur: Any) -> list[Any]:
    """The field descriptors (``type_code``, ``length``, ``scale``, ``flags``, ``charsetnr``) of the
    result of a cursor from :func:`pymysql_text_cursor`. No fallback: the public ``description`` has
    neither the unsigned flag nor the character set, and the rows are already raw text."""
    fields = getattr(getattr(cur, "_result", None), "fields", None)
    if fields is None:
        raise CompatError(f"PyMySQL {_shown(version('PyMySQL'))} has no cursor._result.fields, which "
                          f"{_PYMYSQL_TEXT} needs for the column types: adapt refstream/compat.py to "
                          f"this version, or install PyMySQL{_range(PYMYSQL_SUPPORTED)}")
    return list(fields)


def pymysql_abandon(cur: Any) -> None:
    """Tell an unbuffered PyMySQL result that its rows will not be read, before its connection is
    dropped: otherwise PyMySQL drains the rest of it from the dead connection when it is collected."""
    result = getattr(cur, "_result", None)
    if result is None or not supported("PyMySQL", "PyMySQL", "dropping an unread MySQL result",
                                       PYMYSQL_SUPPORTED, "PyMySQL may log an error when it is collected"):
        return
    if getattr(result, "unbuffered_active", False):
        result.unbuffered_active = False


def pymysql_shutdown(conn: Any) -> bool:
    """Shut down the socket of PyMySQL connection ``conn`` from another thread, so that a read blocked
    on it (a query waiting for a lock) fails at once; False when this PyMySQL keeps it elsewhere."""
    import socket

    sock = getattr(conn, "_sock", None)
    if sock is None:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False  # already closed
    return True


class PyMySQLStream:
    """The packet stream under an unbuffered PyMySQL result, for a reader that parses the row packets
    itself. ``peek``/``read`` are the connection's buffered socket reader (``BufferedReader``), ``seq``
    the sequence number the next packet must carry; :meth:`end` and :meth:`fail` leave PyMySQL's
    state as its own reader would after the last packet."""

    __slots__ = ("_conn", "_result", "ncols", "peek", "read")

    def __init__(self, result: Any) -> None:
        self._result = result
        self._conn = result.connection
        self.ncols = len(result.fields)
        rfile = self._conn._rfile
        self.peek: Callable[[int], bytes] = rfile.peek
        self.read: Callable[[int], bytes] = rfile.read

    @property
    def active(self) -> bool:
        """Whether rows remain to be read."""
        return bool(self._result.unbuffered_active)

    @property
    def seq(self) -> int:
        return int(self._conn._next_seq_id)

    @seq.setter
    def seq(self, value: int) -> None:
        self._conn._next_seq_id = value

    def force_close(self) -> None:
        """Close the connection without a goodbye (the stream is out of step)."""
        self._conn._force_close()

    def end(self, payload: bytes) -> None:
        """Take the EOF packet that ends the result."""
        import pymysql.protocol

        result = self._result
        result._check_packet_is_eof(pymysql.protocol.MysqlPacket(payload, self._conn.encoding))
        result.unbuffered_active = False
        result.connection = None
        result.rows = None

    def fail(self, payload: bytes) -> NoReturn:
        """Raise the server's error packet (the query failed part of the way through)."""
        import pymysql.protocol

        self._result.unbuffered_active = False
        pymysql.protocol.MysqlPacket(payload, self._conn.encoding).raise_for_error()
        raise AssertionError("raise_for_error returned")  # pragma: no cover


def pymysql_stream(cur: Any) -> PyMySQLStream | None:
    """The packet stream of an executed PyMySQL ``SSCursor`` with rows to read; None when the result
    has none, or when this PyMySQL is not one that was checked or lacks the internals (warned once;
    then read with the cursor's public ``fetchmany``, same values)."""
    fallback = "reading rows with the cursor's fetchmany (slower, same values)"
    if not supported("PyMySQL", "PyMySQL", _PYMYSQL_FAST, PYMYSQL_SUPPORTED, fallback):
        return None
    result = getattr(cur, "_result", None)
    if result is None:
        return None
    conn = getattr(result, "connection", None)
    rfile = getattr(conn, "_rfile", None)
    need = {"cursor._result.unbuffered_active": hasattr(result, "unbuffered_active"),
            "cursor._result.fields": hasattr(result, "fields"),
            "cursor._result._check_packet_is_eof": hasattr(result, "_check_packet_is_eof"),
            "cursor._result.connection": conn is not None,
            "Connection._next_seq_id": hasattr(conn, "_next_seq_id"),
            "Connection._force_close": hasattr(conn, "_force_close"),
            "Connection.encoding": hasattr(conn, "encoding"),
            "Connection._rfile.peek/read": hasattr(rfile, "peek") and hasattr(rfile, "read")}
    missing = [name for name, ok in need.items() if not ok]
    if missing:
        _missing("PyMySQL", "PyMySQL", _PYMYSQL_FAST, missing, fallback, PYMYSQL_SUPPORTED)
        return None
    if not result.unbuffered_active or not result.fields:
        return None  # no rows to stream (not a query, or already read)
    return PyMySQLStream(result)


# -------------------------------------------------------------------------------------------- pandas

class KeyIndex(Protocol):
    """Row positions of a fixed set of keys, probed many times."""

    def find(self, values: np.ndarray) -> np.ndarray:
        """Position of every value among the keys (int64), -1 where it is not one."""
        ...


class _HashTableIndex:
    """pandas' ``Int64HashTable`` / ``PyObjectHashTable``: ~1 ms per 10,000 probes of 1M strings."""

    __slots__ = ("_dtype", "_table")

    def __init__(self, keys: np.ndarray, ht: Any) -> None:
        ints = keys.dtype == np.int64
        self._dtype: type = np.int64 if ints else object
        self._table = ht.Int64HashTable(len(keys)) if ints else ht.PyObjectHashTable(len(keys))
        self._table.map_locations(np.ascontiguousarray(keys))

    def find(self, values: np.ndarray) -> np.ndarray:
        # Both sides hold the same kind of values (int64 or objects): see enrich.joins._key_values.
        found = self._table.lookup(np.ascontiguousarray(values, dtype=self._dtype))
        return found.astype(np.int64, copy=False)


class _PandasIndex:
    """The public route: ``pandas.Index.get_indexer``, 50-250 ms per 10,000 probes of 1M strings."""

    __slots__ = ("_index",)

    def __init__(self, keys: np.ndarray) -> None:
        import pandas as pd

        self._index = pd.Index(keys)

    def find(self, values: np.ndarray) -> np.ndarray:
        return self._index.get_indexer(values).astype(np.int64, copy=False)


@functools.cache
def _pandas_hashtable() -> Any | None:
    """``pandas._libs.hashtable`` when it is one that was checked, else None (warned once)."""
    what, fallback = "the join's key index", "probing keys with pandas.Index.get_indexer (slower, same result)"
    if not supported("pandas", "pandas", what, PANDAS_SUPPORTED, fallback):
        return None
    try:
        from pandas._libs import hashtable as ht  # type: ignore[attr-defined]  # private, untyped
    except ImportError:
        _missing("pandas", "pandas", what, ["pandas._libs.hashtable"], fallback, PANDAS_SUPPORTED)
        return None
    need = [f"pandas._libs.hashtable.{cls}.{method}" for cls in ("Int64HashTable", "PyObjectHashTable")
            for method in ("map_locations", "lookup") if not hasattr(getattr(ht, cls, None), method)]
    if need:
        _missing("pandas", "pandas", what, need, fallback, PANDAS_SUPPORTED)
        return None
    return ht


def key_index(keys: np.ndarray) -> KeyIndex:
    """An index of ``keys`` (int64 or objects, unique) to probe with :meth:`KeyIndex.find`: pandas'
    hash tables when this pandas has the ones checked, else ``pandas.Index``."""
    ht = _pandas_hashtable()
    return _HashTableIndex(keys, ht) if ht is not None else _PandasIndex(keys)


# ------------------------------------------------------------------------------------------- PySpark

def _ddl_parser() -> Callable[[str], DataType]:
    """``DataType.fromDDL`` (public since PySpark 4.0), else the private ``_parse_datatype_string`` it
    wraps, when this PySpark is one that was checked."""
    from pyspark.sql import types

    public = getattr(types.DataType, "fromDDL", None)
    if public is not None:
        return public
    what = "parsing Spark DDL"
    private = getattr(types, "_parse_datatype_string", None)
    if private is None:
        raise CompatError(f"PySpark {_shown(version('pyspark'))} has neither DataType.fromDDL nor "
                          f"pyspark.sql.types._parse_datatype_string, which {what} needs: adapt "
                          f"refstream/compat.py to this version, or install pyspark>=4.0")
    supported("pyspark", "PySpark", what, PYSPARK_SUPPORTED,
              "using pyspark.sql.types._parse_datatype_string as long as it works")
    return private


def spark_ddl_type(ddl: str) -> DataType:
    """The Spark type of a DDL string (``"a INT, b STRING"`` is a StructType); Spark parses it, so a
    SparkContext must be active. Bad DDL raises Spark's ``ParseException``."""
    return _ddl_parser()(ddl)


def spark_schema(ddl: str) -> StructType:
    """The StructType of a DDL field list (``"a INT, b STRING"``), as :func:`spark_ddl_type`."""
    from pyspark.sql.types import StructType

    t = spark_ddl_type(ddl)
    if not isinstance(t, StructType):
        raise ValueError(f"{ddl!r} is a {t.simpleString()}, not a list of fields")
    return t


def spark_logger_level(spark: Any, logger: str, level: str) -> bool:
    """Set the level of one of the driver JVM's log4j2 loggers (through py4j: PySpark has no public
    call for a single logger). Returns False, with one warning, when log4j2's API is not there."""
    try:
        jvm = spark.sparkContext._jvm
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
            logger, jvm.org.apache.logging.log4j.Level.toLevel(level))
        return True
    except Exception as exc:  # noqa: BLE001 - a quieter log is not worth failing the job for
        _warn_once(f"log4j:{logger}", "cannot set the level of Spark's logger %s (%s); its lines stay",
                   logger, exc)
        return False


#: Spark's setting naming how a query writes its checkpoint files, and its file-system based manager
#: (the package it moved to first).
SPARK_CHECKPOINT_FILES = "spark.sql.streaming.checkpointFileManagerClass"
_FS_CHECKPOINT_FILES = ("org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
                        "org.apache.spark.sql.execution.streaming.FileSystemBasedCheckpointFileManager")


def spark_local_checkpoint_files(spark: Any) -> str | None:
    """Have the queries of ``spark`` write their checkpoint files through Hadoop's ``FileSystem`` API
    instead of its ``FileContext`` API (Spark's default), unless the session names a manager of its
    own: the class set, or None. On a local file system both write a temporary file and rename it
    into place, but ``FileContext``'s rename first asks for both files' link status, which Hadoop's
    local file system (without its native library) answers by running ``readlink`` in a new process:
    dozens a micro-batch. Only for checkpoints on a local (or mounted) file system, where a rename is
    atomic either way. The setting stays on the session after the query stops. Returns None, with
    one warning, when neither class is there or the session cannot be asked."""
    try:
        if spark.conf.get(SPARK_CHECKPOINT_FILES, None):
            return None
        jvm = spark.sparkContext._jvm
        for name in _FS_CHECKPOINT_FILES:
            try:
                jvm.java.lang.Class.forName(name)
            except Exception as exc:  # noqa: BLE001 - py4j's error for a class that is not there
                if "ClassNotFoundException" not in str(exc):
                    raise
                continue
            spark.conf.set(SPARK_CHECKPOINT_FILES, name)
            return name
        _warn_once("spark:checkpoint-files", "Spark has no FileSystemBasedCheckpointFileManager (%s); the "
                   "checkpoint files are written through FileContext", ", ".join(_FS_CHECKPOINT_FILES))
    except Exception as exc:  # noqa: BLE001 - the files are written either way, only slower
        _warn_once("spark:checkpoint-files", "cannot choose Spark's checkpoint file manager (%s); the checkpoint "
                   "files are written through FileContext", exc)
    return None


def spark_skip_python_data_source_lookup(spark: Any) -> bool:
    """Tell the driver JVM that no installed package provides a Python data source, so that it does
    not start a Python process to look for them (``DataSourceManager.dataSourceBuilders``, a private
    Scala object field of Spark 4). Spark looks once per JVM, at the first data source registered or
    named; a Python daemon then imports PySpark to scan for ``pyspark_*`` packages: about 1 s of CPU
    and several seconds of a job's start on two loaded cores. Call it before registering a data
    source, in a session whose queries use no such package. Returns False, with one warning, when
    the field is not there (the lookup then runs as usual)."""
    if not supported("pyspark", "PySpark", "skipping the Python data source lookup", PYSPARK_LOOKUP_SUPPORTED,
                     "the lookup runs"):
        return False
    try:
        jvm = spark.sparkContext._jvm
        manager = getattr(getattr(jvm.org.apache.spark.sql.execution.datasources, "DataSourceManager$"), "MODULE$")
        if manager.dataSourceBuilders().isEmpty():  # not looked up yet
            empty = getattr(getattr(jvm.scala.collection.immutable, "Map$"), "MODULE$").empty()
            getattr(manager, "dataSourceBuilders_$eq")(jvm.scala.Some(empty))
        return True
    except Exception as exc:  # noqa: BLE001 - the lookup is only slower, not wrong
        _warn_once("spark:datasource-lookup", "cannot skip Spark's lookup of Python data sources (%s); it runs", exc)
        return False


def spark_state_server_timeout(handle: Any, seconds: float) -> bool:
    """Make a ``transformWithStateInPandas`` worker's requests to its task's state server fail with
    ``TimeoutError`` after ``seconds`` without an answer, instead of waiting forever (PySpark's
    ``StatefulProcessorApiClient``, the handle's private ``_statefulProcessorApiClient``, reads its
    socket, the private ``_client_socket``, with no timeout:
    a state server thread that died leaves the task, its batch and the query waiting). Call it with
    the processor's handle in ``init``, before its first request. Returns False, with one warning,
    when the socket is not there (requests then wait as PySpark's do)."""
    sock = getattr(getattr(handle, "_statefulProcessorApiClient", None), "_client_socket", None)
    if sock is None or not hasattr(sock, "settimeout"):
        _missing("pyspark", "PySpark", "bounding the wait on a state server",
                 ["StatefulProcessorHandle._statefulProcessorApiClient._client_socket"],
                 "a worker waits for its state server without a limit", PYSPARK_SUPPORTED)
        return False
    sock.settimeout(seconds)
    return True

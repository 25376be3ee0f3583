"""The private-API wrappers: each fallback is taken when the private API is gone or the library is
not a checked version, and gives the same result. Pure: fake PyMySQL objects, no Spark JVM
(the real reads are in tests/refresh/sources/test_mysql_fast.py)."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from refstream import compat


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    monkeypatch.setattr(compat, "_warned", set())
    compat._pandas_hashtable.cache_clear()
    caplog.set_level(logging.WARNING, "refstream.compat")
    yield
    compat._pandas_hashtable.cache_clear()


def test_version_reads_the_installed_distribution() -> None:
    import pymysql

    assert compat.version("PyMySQL") == pymysql.VERSION[:3]  # __version__ imitates mysqlclient's
    assert compat.version("no-such-distribution-here") is None


def test_unchecked_version_warns_once_naming_library_and_fix(caplog: pytest.LogCaptureFixture) -> None:
    rng = ((0, 1), (0, 2))
    assert not compat.supported("pandas", "pandas", "the thing", rng, "doing it slowly")
    assert not compat.supported("pandas", "pandas", "the thing", rng, "doing it slowly")
    [rec] = caplog.records
    assert rec.getMessage().startswith("pandas ") and "the thing" in rec.getMessage()
    assert "doing it slowly" in rec.getMessage() and "pandas>=0.1,<0.2" in rec.getMessage()
    assert compat.supported("pandas", "pandas", "the thing", ((1,), (99,)), "x")


# ------------------------------------------------------------------------------------------- PyMySQL

class _Conn:
    def __init__(self, packets: bytes) -> None:
        self._rfile = io.BufferedReader(io.BytesIO(packets))
        self._next_seq_id = 1
        self.encoding = "utf8"
        self.closed = False

    def _force_close(self) -> None:
        self.closed = True


class _Result:
    def __init__(self, conn: _Conn) -> None:
        self.connection = conn
        self.fields = [object(), object()]
        self.unbuffered_active = True
        self.rows = ()

    def _check_packet_is_eof(self, packet: Any) -> bool:
        return True


def _row(seq: int, *values: bytes | None) -> bytes:
    body = b"".join(b"\xfb" if v is None else bytes([len(v)]) + v for v in values)
    return len(body).to_bytes(3, "little") + bytes([seq]) + body


def _cursor() -> Any:
    eof = b"\xfe\x00\x00\x02\x00"
    packets = _row(1, b"1", b"a") + _row(2, b"2", None) + len(eof).to_bytes(3, "little") + b"\x03" + eof
    return SimpleNamespace(_result=_Result(_Conn(packets)))


def test_pymysql_stream_reads_the_packets_and_ends_the_result() -> None:
    cur = _cursor()
    stream = compat.pymysql_stream(cur)
    assert stream is not None and stream.active and stream.ncols == 2 and stream.seq == 1
    first = stream.peek(1)
    assert first.startswith(_row(1, b"1", b"a"))
    assert stream.read(len(_row(1, b"1", b"a"))) == _row(1, b"1", b"a")
    stream.seq = 2
    assert cur._result.connection._next_seq_id == 2
    stream.end(b"\xfe\x00\x00\x02\x00")
    assert not stream.active and cur._result.connection is None and cur._result.rows is None


@pytest.mark.parametrize("gone", ["_rfile", "_next_seq_id", "_force_close"])
def test_pymysql_stream_without_internals_falls_back(monkeypatch: pytest.MonkeyPatch, gone: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    cur = _cursor()
    conn = cur._result.connection
    if gone == "_force_close":
        monkeypatch.setattr(_Conn, "_force_close", property(lambda self: (_ for _ in ()).throw(AttributeError)))
    else:
        delattr(conn, gone)
    assert compat.pymysql_stream(cur) is None
    assert "PyMySQL" in caplog.text and f"Connection.{gone}" in caplog.text
    assert "fetchmany" in caplog.text


def test_pymysql_unchecked_version_falls_back(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(compat, "PYMYSQL_SUPPORTED", ((0, 1), (0, 2)))
    cur = _cursor()
    assert compat.pymysql_stream(cur) is None
    conn = SimpleNamespace(decoders={"x": 1})
    assert compat.pymysql_text_cursor(conn) is None and conn.decoders == {"x": 1}  # left alone
    compat.pymysql_abandon(cur)
    assert cur._result.unbuffered_active  # not touched either
    assert "outside the versions >=0.1,<0.2" in caplog.text


def test_pymysql_result_without_rows_is_not_streamed(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    cur = _cursor()
    cur._result.unbuffered_active = False
    assert compat.pymysql_stream(cur) is None
    assert compat.pymysql_stream(SimpleNamespace(_result=None)) is None
    assert caplog.records == []


def test_pymysql_abandon_stops_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    cur = _cursor()
    compat.pymysql_abandon(cur)
    assert not cur._result.unbuffered_active
    compat.pymysql_abandon(SimpleNamespace(_result=None))  # execute failed: nothing to do


def test_pymysql_text_cursor_needs_decoders(caplog: pytest.LogCaptureFixture) -> None:
    assert compat.pymysql_text_cursor(SimpleNamespace()) is None
    assert "Connection.decoders" in caplog.text


def test_pymysql_fields_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cur = _cursor()
    assert len(compat.pymysql_fields(cur)) == 2
    del cur._result.fields
    with pytest.raises(compat.CompatError, match=r"PyMySQL [\d.]+ has no cursor._result.fields.*install PyMySQL>="):
        compat.pymysql_fields(cur)


# -------------------------------------------------------------------------------------------- pandas

_KEYS = {"int": np.array([10, 3, 7, -1], np.int64),
         "str": np.array(["b", "a", "zz", "é"], object)}
_PROBES = {"int": np.array([7, 8, 10, -1, 3], np.int64),
           "str": np.array(["zz", "q", "a", "é", None], object)}


@pytest.mark.parametrize("kind", ["int", "str"])
def test_key_index_uses_pandas_hash_tables(kind: str) -> None:
    index = compat.key_index(_KEYS[kind])
    assert isinstance(index, compat._HashTableIndex)
    expected = {"int": [2, -1, 0, 3, 1], "str": [2, -1, 1, 3, -1]}[kind]
    assert index.find(_PROBES[kind]).tolist() == expected


@pytest.mark.parametrize("kind", ["int", "str"])
@pytest.mark.parametrize("how", ["no_module", "no_class", "version"])
def test_key_index_falls_back_to_pandas_index(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                              kind: str, how: str) -> None:
    fast = compat.key_index(_KEYS[kind]).find(_PROBES[kind])
    compat._pandas_hashtable.cache_clear()
    # Hidden from compat only: pandas itself keeps its reference to the module.
    import pandas._libs

    if how == "no_module":
        monkeypatch.delattr(pandas._libs, "hashtable")
        monkeypatch.setitem(sys.modules, "pandas._libs.hashtable", None)  # the import raises ImportError
    elif how == "no_class":
        from pandas._libs import hashtable

        monkeypatch.setattr(pandas._libs, "hashtable", SimpleNamespace(Int64HashTable=hashtable.Int64HashTable))
    else:
        monkeypatch.setattr(compat, "PANDAS_SUPPORTED", ((0, 1), (0, 2)))
    index = compat.key_index(_KEYS[kind])
    assert isinstance(index, compat._PandasIndex)
    slow = index.find(_PROBES[kind])
    assert slow.dtype == fast.dtype == np.int64 and slow.tolist() == fast.tolist()
    assert "pandas" in caplog.text and "get_indexer" in caplog.text


# ------------------------------------------------------------------------------------------- PySpark

def test_spark_ddl_uses_public_from_ddl(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.sql import types

    seen: list[str] = []
    monkeypatch.setattr(types.DataType, "fromDDL", classmethod(lambda cls, ddl: seen.append(ddl) or "public"))
    monkeypatch.setattr(types, "_parse_datatype_string", lambda ddl: "private")
    assert compat.spark_ddl_type("a INT") == "public" and seen == ["a INT"]


def test_spark_ddl_without_from_ddl_uses_the_private_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.sql import types

    struct = types.StructType([types.StructField("a", types.IntegerType())])
    monkeypatch.delattr(types.DataType, "fromDDL")
    monkeypatch.setattr(types, "_parse_datatype_string", lambda ddl: struct if ddl == "a INT" else None)
    assert compat.spark_ddl_type("a INT") is struct
    assert compat.spark_schema("a INT") is struct


def test_spark_ddl_without_either_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.sql import types

    monkeypatch.delattr(types.DataType, "fromDDL")
    monkeypatch.delattr(types, "_parse_datatype_string")
    with pytest.raises(compat.CompatError, match=r"PySpark [\d.]+ has neither DataType.fromDDL nor .*pyspark>=4.0"):
        compat.spark_ddl_type("a INT")


def test_spark_schema_wants_a_field_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspark.sql import types

    monkeypatch.setattr(types.DataType, "fromDDL", classmethod(lambda cls, ddl: types.IntegerType()))
    with pytest.raises(ValueError, match="'int' is a int, not a list of fields"):
        compat.spark_schema("int")


def test_installed_pyspark_from_ddl_wraps_the_private_parser() -> None:
    # Same result by construction in the PySpark versions checked; a change here means re-checking.
    import inspect

    from pyspark.sql import types

    assert "_parse_datatype_string" in inspect.getsource(types.DataType.fromDDL)


def test_skipping_the_data_source_lookup_without_the_field_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    class NoField:  # a JVM whose DataSourceManager has no such field
        def __getattr__(self, name: str) -> Any:
            raise AttributeError(name)

    class Context:
        _jvm = NoField()

    class Session:
        sparkContext = Context()

    with caplog.at_level(logging.WARNING, logger="refstream.compat"):
        assert compat.spark_skip_python_data_source_lookup(Session()) is False
        assert compat.spark_skip_python_data_source_lookup(Session()) is False
    assert len(caplog.records) == 1 and "lookup of Python data sources" in caplog.records[0].getMessage()


def test_skipping_the_data_source_lookup_on_an_unchecked_pyspark_leaves_it(monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(compat, "PYSPARK_LOOKUP_SUPPORTED", ((0, 1), (0, 2)))
    with caplog.at_level(logging.WARNING, logger="refstream.compat"):
        assert compat.spark_skip_python_data_source_lookup(object()) is False
    assert "skipping the Python data source lookup" in caplog.text


def test_the_state_server_timeout_reaches_the_installed_pysparks_socket() -> None:
    """Through PySpark's own handle class: a real socket that never answers times the read out."""
    import socket

    from pyspark.sql.streaming.stateful_processor import StatefulProcessorHandle

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    with listener, socket.create_connection(listener.getsockname()) as silent:
        client = SimpleNamespace(_client_socket=silent)
        assert compat.spark_state_server_timeout(StatefulProcessorHandle(client), 0.2) is True  # type: ignore[arg-type]
        with pytest.raises(TimeoutError):
            silent.makefile("rb").read(4)


def test_the_state_server_timeout_without_the_socket_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    assert compat.spark_state_server_timeout(SimpleNamespace(), 5) is False
    assert compat.spark_state_server_timeout(SimpleNamespace(), 5) is False
    assert len(caplog.records) == 1 and "bounding the wait on a state server" in caplog.records[0].getMessage()

"""The fast MySQL reader (``mysql_fast.ColumnReader``) against the real MariaDB: same table as
PyMySQL's own row decoding, every length encoding, values that need multi-packet rows, a query
killed mid-stream, and the fallbacks taken when PyMySQL's internals are not the expected ones."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
import sqlalchemy as sa

from refresh.config import SqlSourceConfig
from refresh.sources import mysql_fast
from refresh.sources.sql import SqlSource
from refstream.errors import TransientError
from tests.refresh.conftest import execute


def _read(url: str, *, fast: bool, monkeypatch: pytest.MonkeyPatch, **cfg: object) -> pa.Table:
    attached: list[bool] = []
    real = mysql_fast.ColumnReader.attach

    def attach(cur: object) -> object:
        fetch = real(cur) if fast else None
        attached.append(fetch is not None)
        return fetch

    with monkeypatch.context() as m:
        m.setattr(mysql_fast.ColumnReader, "attach", staticmethod(attach))
        table = SqlSource("ds", SqlSourceConfig(url=url, reader="pymysql", **cfg)).read()  # type: ignore[arg-type]
    assert attached == [fast]
    return table


def test_columns_equal_pymysql_rows(mysql_url: str, mysql_engine: sa.Engine, unique,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    t = unique("cols")
    execute(mysql_engine,
            f"CREATE TABLE {t} (id INT PRIMARY KEY, name VARCHAR(300), price DECIMAL(20,4), at DATETIME(6), "
            "d DATE, f DOUBLE, b VARBINARY(400), t TIME, n INT)",
            # 20,000 rows crossing many read buffers: lengths 0..299 (1- and 3-byte length prefixes),
            # NULLs in every column but the key, unicode, binary with every byte value.
            f"INSERT INTO {t} SELECT seq, IF(seq % 7 = 0, NULL, CONCAT(REPEAT('é', seq % 150), seq)), "
            "IF(seq % 5 = 0, NULL, seq / 7), IF(seq % 11 = 0, NULL, TIMESTAMP('2024-01-01') + INTERVAL seq SECOND), "
            "IF(seq % 13 = 0, NULL, DATE('2000-01-01') + INTERVAL seq DAY), IF(seq % 3 = 0, NULL, seq * 1.5), "
            "IF(seq % 17 = 0, NULL, UNHEX(REPEAT(LPAD(HEX(seq % 256), 2, '0'), seq % 300))), "
            "IF(seq % 19 = 0, NULL, SEC_TO_TIME(CAST(seq AS SIGNED) - 10000)), NULL FROM seq_1_to_20000")
    fast = _read(mysql_url, fast=True, monkeypatch=monkeypatch, table=t, chunk_rows=777)
    slow = _read(mysql_url, fast=False, monkeypatch=monkeypatch, table=t, chunk_rows=777)
    assert fast.num_rows == 20000
    assert fast.schema == slow.schema
    assert fast.equals(slow)
    row = fast.filter(pa.compute.equal(fast.column("id"), 300)).to_pylist()[0]
    assert row["name"] == "300" and row["b"] == b"" and row["n"] is None and row["t"] is not None
    row = fast.filter(pa.compute.equal(fast.column("id"), 299)).to_pylist()[0]
    assert row["name"] == "é" * 149 + "299" and row["b"] == bytes([299 % 256]) * 299


@pytest.fixture
def big_packets(mysql_engine: sa.Engine) -> object:
    """The server may send rows of up to 64 MB while the test runs (restored after)."""
    with mysql_engine.connect() as conn:
        before = conn.exec_driver_sql("SELECT @@GLOBAL.max_allowed_packet").scalar()
        conn.exec_driver_sql("SET GLOBAL max_allowed_packet = 67108864")
    try:
        yield
    finally:
        with mysql_engine.connect() as conn:
            conn.exec_driver_sql(f"SET GLOBAL max_allowed_packet = {int(before)}")


def test_rows_over_16_mb_span_several_packets(mysql_url: str, unique, big_packets: object,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # 17 MB: an 8-byte length prefix (0xFE, like an EOF packet but longer) in a row split into two
    # packets; rows of ordinary size before and after it in the same chunk.
    query = ("SELECT seq AS id, IF(seq = 2, REPEAT('a', 17000000), CONCAT('v', seq)) AS txt, seq * 2 AS n "
             "FROM seq_1_to_3")
    fast = _read(mysql_url, fast=True, monkeypatch=monkeypatch, query=query, chunk_rows=10)
    rows = {r["id"]: r for r in fast.to_pylist()}
    assert rows[1] == {"id": 1, "txt": "v1", "n": 2} and rows[3] == {"id": 3, "txt": "v3", "n": 6}
    assert len(rows[2]["txt"]) == 17_000_000 and set(rows[2]["txt"]) == {"a"} and rows[2]["n"] == 4


def test_query_killed_mid_stream_is_transient(mysql_url: str, mysql_engine: sa.Engine) -> None:
    marker = "refresh_kill_me"
    src = SqlSource("ds", SqlSourceConfig(
        url=mysql_url, query=f"SELECT seq, REPEAT('x', 60) AS pad, '{marker}' AS m FROM seq_1_to_3000000",
        chunk_rows=1000, reader="pymysql"))
    batches = src.batches()
    assert next(batches).num_rows == 1000  # the server is now blocked sending the rest

    def kill() -> None:
        with mysql_engine.connect() as conn:
            ids = conn.exec_driver_sql(
                "SELECT id FROM information_schema.processlist WHERE info LIKE %s AND info NOT LIKE %s",
                (f"%'{marker}'%", "%processlist%")).scalars().all()
            assert len(ids) == 1
            conn.exec_driver_sql(f"KILL QUERY {int(ids[0])}")

    killer = threading.Thread(target=kill)
    killer.start()
    killer.join()
    with pytest.raises(TransientError, match="dataset ds: read on .* failed: .*interrupted"):
        for _ in batches:
            pass


def test_mysql_row_parser_handles_every_length_encoding(mysql_url: str, mysql_engine: sa.Engine, unique) -> None:
    t = unique("lengths")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, txt MEDIUMTEXT, b MEDIUMBLOB)")
    sizes = [0, 1, 250, 251, 252, 300, 65535, 65536, 70000]
    execute(mysql_engine, f"INSERT INTO {t} VALUES (:id, :txt, :b)",
            params=[{"id": i, "txt": "é" * n, "b": bytes([i % 256]) * n} for i, n in enumerate(sizes)]
            + [{"id": 99, "txt": None, "b": None}])
    src = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=t, chunk_rows=4, reader="pymysql"))
    rows = {r["id"]: r for r in src.read().to_pylist()}
    for i, n in enumerate(sizes):
        assert rows[i]["txt"] == "é" * n and rows[i]["b"] == bytes([i % 256]) * n, n
    assert rows[99] == {"id": 99, "txt": None, "b": None}


@pytest.fixture
def mixed_table(mysql_engine: sa.Engine, unique) -> str:
    t = unique("compat")
    execute(mysql_engine,
            f"CREATE TABLE {t} (id INT PRIMARY KEY, name VARCHAR(40), price DECIMAL(12,4), at DATETIME(6), "
            "d DATE, f DOUBLE, b VARBINARY(40), t TIME, n INT)",
            f"INSERT INTO {t} SELECT seq, IF(seq % 7 = 0, NULL, CONCAT('é', seq)), seq / 7, "
            "TIMESTAMP('2024-01-01') + INTERVAL seq SECOND, IF(seq % 13 = 0, NULL, DATE('2000-01-01') + "
            "INTERVAL seq DAY), seq * 1.5, UNHEX(LPAD(HEX(seq % 256), 2, '0')), "
            "SEC_TO_TIME(CAST(seq AS SIGNED) - 100), NULL FROM seq_1_to_500")
    return t


def test_without_pymysql_internals_fetchmany_reads_the_same(mysql_url: str, mixed_table: str, caplog,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import pymysql.connections

    from refstream import compat

    fast = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=mixed_table, chunk_rows=64, reader="pymysql")).read()
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.delattr(pymysql.connections.Connection, "_force_close")  # used only on errors by PyMySQL
    attached: list[bool] = []
    real = mysql_fast.ColumnReader.attach
    monkeypatch.setattr(mysql_fast.ColumnReader, "attach",
                        staticmethod(lambda cur: attached.append(bool(r := real(cur))) or r))
    slow = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=mixed_table, chunk_rows=64, reader="pymysql")).read()
    assert attached == [False]
    assert slow.schema == fast.schema and slow.equals(fast)
    assert "PyMySQL" in caplog.text and "Connection._force_close" in caplog.text


def test_unchecked_pymysql_version_reads_the_same_values(mysql_url: str, mixed_table: str, caplog,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from refstream import compat

    fast = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=mixed_table, chunk_rows=64, reader="pymysql")).read()
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.setattr(compat, "PYMYSQL_SUPPORTED", ((0, 1), (0, 2)))
    plain = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=mixed_table, chunk_rows=64, reader="pymysql")).read()
    # PyMySQL's own conversions: types come from the values, the values are the same.
    assert plain.column_names == fast.column_names
    assert plain.sort_by("id").to_pylist() == fast.sort_by("id").to_pylist()
    assert "outside the versions >=0.1,<0.2" in caplog.text

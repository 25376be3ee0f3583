"""The vectorised MySQL row reader (``_PyMySQLColumns``) against the real MariaDB: same table as
PyMySQL's own row decoding, values that need multi-packet rows, a query killed mid-stream."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
import sqlalchemy as sa

from refresh.config import SqlSourceConfig
from refresh.sources import sql
from refresh.sources.sql import SqlSource
from refstream.errors import TransientError
from tests.refresh.conftest import execute


def _read(url: str, *, fast: bool, monkeypatch: pytest.MonkeyPatch, **cfg: object) -> pa.Table:
    attached: list[bool] = []
    real = sql._PyMySQLColumns.attach

    def attach(cur: object) -> object:
        fetch = real(cur) if fast else None
        attached.append(fetch is not None)
        return fetch

    with monkeypatch.context() as m:
        m.setattr(sql._PyMySQLColumns, "attach", staticmethod(attach))
        table = SqlSource("ds", SqlSourceConfig(url=url, **cfg)).read()  # type: ignore[arg-type]
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
        chunk_rows=1000))
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

"""SQL sources against the real MariaDB, PostgreSQL and SQLite: types, chunks, errors."""

from __future__ import annotations

import datetime as dt
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
import sqlalchemy as sa

from refresh.config import SqlSourceConfig
from refresh.diff import normalize
from refresh.sources.sql import SqlSource
from refstream.errors import DataError, TerminalError, TransientError
from tests.refresh.conftest import execute
from tests.timing import bound

PG_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"

MYSQL_TYPES = """(
    id INT NOT NULL, k2 VARCHAR(10) NOT NULL, price DECIMAL(30,10), small DECIMAL(5,2) UNSIGNED,
    day DATE, at DATETIME(6), stamp TIMESTAMP NULL, t TIME, bin VARBINARY(8), blobby BLOB,
    txt TEXT, name VARCHAR(50), flag TINYINT(1), big BIGINT UNSIGNED, f DOUBLE, js JSON, e ENUM('a','b'),
    PRIMARY KEY (id, k2))"""


@pytest.fixture
def typed_table(mysql_engine: sa.Engine, unique) -> Iterator[str]:
    t = unique("types")
    execute(mysql_engine, f"CREATE TABLE {t} {MYSQL_TYPES}")
    execute(mysql_engine,
            f"INSERT INTO {t} VALUES (1, 'a', 12345678901234567890.0123456789, 999.99, '2024-05-01', "
            "'2024-05-01 12:00:00.123456', '2024-05-01 12:00:00', '-838:59:59', x'00ff10', x'cafe', "
            "'日本語 ✓ \\\\ \"q\"', 'Zoë', 1, 9223372036854775807, 0.1, '{\"a\": [1, 2]}', 'b'), "
            "(2, 'b', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)")
    return t


@pytest.mark.parametrize("reader", ["connectorx", "pymysql"])
def test_mysql_types_map_to_exact_arrow_types(mysql_url: str, typed_table: str, reader: str) -> None:
    src = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=typed_table, reader=reader))  # type: ignore[arg-type]
    assert src.reader == reader
    table = normalize(src.read())
    types = {f.name: f.type for f in table.schema}
    assert types["price"] == pa.decimal128(30, 10)
    assert types["small"] == pa.decimal128(5, 2)
    assert types["day"] == pa.date32() and types["at"] == pa.timestamp("us") and types["stamp"] == pa.timestamp("us")
    assert types["bin"] == pa.binary() and types["blobby"] == pa.binary()
    assert types["txt"] == pa.string() and types["js"] == pa.string() and types["e"] == pa.string()
    assert types["t"] == pa.duration("us") and types["id"] == pa.int64() and types["f"] == pa.float64()
    rows = sorted(table.to_pylist(), key=lambda r: r["id"])
    r = rows[0]
    assert r["price"] == Decimal("12345678901234567890.0123456789")
    assert r["small"] == Decimal("999.99")
    assert r["day"] == dt.date(2024, 5, 1)
    assert r["at"] == dt.datetime(2024, 5, 1, 12, 0, 0, 123456)
    assert r["stamp"] == dt.datetime(2024, 5, 1, 12)
    assert r["t"] == -dt.timedelta(hours=838, minutes=59, seconds=59)
    assert r["bin"] == b"\x00\xff\x10" and r["blobby"] == b"\xca\xfe"
    assert r["txt"] == '日本語 ✓ \\ "q"' and r["name"] == "Zoë"
    assert r["big"] == 9223372036854775807 and r["f"] == 0.1 and r["e"] == "b"
    assert r["js"].replace(" ", "") == '{"a":[1,2]}'
    assert all(v is None for k, v in rows[1].items() if k not in ("id", "k2"))


def test_mysql_reads_in_chunks_and_queries_with_a_cursor(mysql_url: str, mysql_engine: sa.Engine, unique) -> None:
    t = unique("chunks")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, at DATETIME, note VARCHAR(10))")
    execute(mysql_engine, f"INSERT INTO {t} VALUES (:id, :at, :note)",
            params=[{"id": i, "at": dt.datetime(2024, 1, 1) + dt.timedelta(minutes=i), "note": "50%"}
                    for i in range(10)])
    src = SqlSource("ds", SqlSourceConfig(url=mysql_url, query=f"SELECT id, at, note FROM {t} WHERE note LIKE '50%'",
                                       chunk_rows=3))
    batches = list(src.batches())
    assert [b.num_rows for b in batches] == [3, 3, 3, 1]
    since = src.read_since("at", dt.datetime(2024, 1, 1, 0, 7))
    assert sorted(since.column("id").to_pylist()) == [7, 8, 9]
    now = src.now()
    assert isinstance(now, dt.datetime) and abs((now - dt.datetime.now()).total_seconds()) < 3600 * 24
    empty = SqlSource("ds", SqlSourceConfig(url=mysql_url, query=f"SELECT * FROM {t} WHERE id < 0")).read()
    assert empty.num_rows == 0 and empty.schema.field("at").type == pa.timestamp("us")


def test_mysql_zero_dates_read_as_null(mysql_url: str, mysql_engine: sa.Engine, unique) -> None:
    t = unique("zero")
    with mysql_engine.begin() as conn:
        conn.execute(sa.text("SET SESSION sql_mode=''"))
        conn.execute(sa.text(f"CREATE TABLE {t} (id INT PRIMARY KEY, d DATETIME)"))
        conn.execute(sa.text(f"INSERT INTO {t} VALUES (1, '0000-00-00 00:00:00'), (2, '2024-01-01 00:00:00')"))
    table = SqlSource("ds", SqlSourceConfig(url=mysql_url, table=t)).read()
    assert sorted(table.to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "d": None}, {"id": 2, "d": dt.datetime(2024, 1, 1)}]


def test_unreachable_database_is_transient_and_bad_sql_terminal(mysql_url: str) -> None:
    from demo.broker import free_port

    down = SqlSource("ds", SqlSourceConfig(url=f"mysql+pymysql://root@127.0.0.1:{free_port()}/x", table="t"))
    with pytest.raises(TransientError, match="dataset ds: query on .* failed"):
        down.read()
    with pytest.raises(TransientError):
        down.now()
    missing = SqlSource("ds", SqlSourceConfig(url=mysql_url, table="no_such_table"))
    with pytest.raises(TerminalError, match="no_such_table") as info:
        missing.read()
    assert not isinstance(info.value, TransientError)


def test_sqlite_source(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ref.db'}"
    engine = sa.create_engine(url)
    execute(engine, "CREATE TABLE devices (id INTEGER PRIMARY KEY, name TEXT, w REAL, note TEXT, b BLOB)",
            "INSERT INTO devices VALUES (1, 'ä', 1.5, NULL, x'01'), (2, 'b', 2, NULL, NULL), (3, 'c', NULL, 'n', NULL)")
    src = SqlSource("ds", SqlSourceConfig(url=url, table="devices", chunk_rows=2))
    table = normalize(src.read())
    assert table.schema.field("w").type == pa.float64()
    assert table.schema.field("note").type == pa.string()
    assert table.to_pylist()[0] == {"id": 1, "name": "ä", "w": 1.5, "note": None, "b": b"\x01"}
    assert isinstance(src.now(), dt.datetime)
    with pytest.raises(TerminalError, match="no such table") as info:
        SqlSource("ds", SqlSourceConfig(url=url, table="nope")).read()
    assert not isinstance(info.value, TransientError)


def test_a_sqlite_tables_columns_declared_times_are_read_as_times_and_a_cursor_on_them_compares_as_stored(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ref.db'}"
    engine = sa.create_engine(url)
    execute(engine, "CREATE TABLE m (id INTEGER PRIMARY KEY, at TIMESTAMP, d DATETIME(6), day DATE, "
                    "note TEXT)",
            "INSERT INTO m VALUES (1, '2024-05-01 12:00:00', '2024-05-01 12:00:00.250000', '2024-05-01', 'x'), "
            "(2, CURRENT_TIMESTAMP, '2024-05-02T08:00:00', NULL, NULL), (3, NULL, NULL, '2024-05-03', NULL)")
    src = SqlSource("ds", SqlSourceConfig(url=url, table="m", chunk_rows=2))
    table = normalize(src.read())
    assert [table.schema.field(c).type for c in ("at", "d", "day", "note")] == [
        pa.timestamp("us"), pa.timestamp("us"), pa.date32(), pa.string()]
    rows = {r["id"]: r for r in table.to_pylist()}
    assert rows[1]["at"] == dt.datetime(2024, 5, 1, 12) and rows[1]["d"] == dt.datetime(2024, 5, 1, 12, 0, 0, 250000)
    assert rows[2]["d"] == dt.datetime(2024, 5, 2, 8) and abs(rows[2]["at"] - src.now()) < dt.timedelta(minutes=1)
    assert rows[3]["day"] == dt.date(2024, 5, 3) and rows[3]["at"] is None
    # A zone offset (as Python's sqlite3 writes an aware datetime) is read as its UTC time.
    execute(engine, "INSERT INTO m VALUES (5, '2024-05-01 14:00:00+02:00', '2024-05-01T12:00:00Z', NULL, NULL)")
    five = next(r for r in normalize(src.read()).to_pylist() if r["id"] == 5)
    assert five["at"] == five["d"] == dt.datetime(2024, 5, 1, 12)
    # A window's low bound compares times, whatever their text: an offset, a 'T', fewer fraction digits.
    since = pa.Table.from_batches(list(src.batches_since("at", dt.datetime(2024, 5, 1, 12))))
    assert sorted(since.column("id").to_pylist()) == [1, 2, 5]
    since = pa.Table.from_batches(list(src.batches_since("at", dt.datetime(2024, 5, 1, 12, 0, 0, 1000))))
    assert since.column("id").to_pylist() == [2]
    execute(engine, "UPDATE m SET at = '2024-05-01 07:30:00-05:00' WHERE id = 5")  # 12:30 UTC
    since = pa.Table.from_batches(list(src.batches_since("at", dt.datetime(2024, 5, 1, 12, 15))))
    assert sorted(since.column("id").to_pylist()) == [2, 5]
    since = pa.Table.from_batches(list(src.batches_since("d", dt.datetime(2024, 5, 1, 12, 0, 0, 200000))))
    assert sorted(since.column("id").to_pylist()) == [1, 2]  # 1's '.250000' after .2, 5's 'T...Z' before
    execute(engine, "DELETE FROM m WHERE id = 5")
    # A query's columns have no declared types: typed from the values, as before.
    query = SqlSource("ds", SqlSourceConfig(url=url, query="SELECT id, at FROM m"))
    assert normalize(query.read()).schema.field("at").type == pa.string()
    # A number or text that is no time, in a column declared one: an error naming both.
    execute(engine, "INSERT INTO m VALUES (4, 1714564800, NULL, NULL, NULL)")
    with pytest.raises(DataError, match=r"dataset ds: column at: value 1714564800 is not ISO-8601 text.*through "
                                        r"query:"):
        src.read()
    execute(engine, "UPDATE m SET at = 'soon' WHERE id = 4")
    with pytest.raises(DataError, match=r"dataset ds: column at: value 'soon' does not fit timestamp\[us\].*"
                                        r"through query:"):
        src.read()


@pytest.mark.integration  # reaches the PostgreSQL at PG_URL without a fixture
def test_postgresql_source(unique) -> None:
    t = unique("pg")
    engine = sa.create_engine(PG_URL)
    execute(engine, f"CREATE TABLE {t} (id INT PRIMARY KEY, price NUMERIC(12,4), at TIMESTAMP, "
                    f"atz TIMESTAMPTZ, b BYTEA, j JSONB, name TEXT, ok BOOLEAN, free NUMERIC)",
            f"INSERT INTO {t} VALUES (1, 1.5, '2024-05-01 12:00', '2024-05-01 12:00+02', '\\x00ff', "
            f"'{{\"a\": 1}}', 'ü', true, 3.25), (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)")
    try:
        src = SqlSource("ds", SqlSourceConfig(url=PG_URL, table=t, chunk_rows=1))
        table = normalize(src.read())
        assert table.schema.field("price").type == pa.decimal128(12, 4)
        assert table.schema.field("atz").type == pa.timestamp("us", tz="UTC")
        r = sorted(table.to_pylist(), key=lambda r: r["id"])[0]
        assert r["price"] == Decimal("1.5000") and r["b"] == b"\x00\xff" and r["ok"] is True
        assert r["at"] == dt.datetime(2024, 5, 1, 12)
        assert r["atz"] == dt.datetime(2024, 5, 1, 10, tzinfo=dt.UTC)
        assert r["j"] == '{"a": 1}' and r["name"] == "ü" and r["free"] == Decimal("3.25")
        assert sorted(src.read_since("id", 2).column("id").to_pylist()) == [2]
        assert isinstance(src.now(), dt.datetime)
    finally:
        execute(engine, f"DROP TABLE {t}")
        engine.dispose()


@contextmanager
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word (a hung database server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.mark.timeout(60)  # without the timeouts these reads wait forever
@pytest.mark.parametrize(("url", "timeouts"), [
    ("mysql+pymysql://root@127.0.0.1:{port}/test", {"read_timeout": dt.timedelta(seconds=1)}),
    ("postgresql+psycopg2://postgres@127.0.0.1:{port}/test", {"connect_timeout": dt.timedelta(seconds=2)}),
])
def test_a_silent_server_fails_the_read_after_the_timeout(url: str, timeouts: dict) -> None:
    with silent_server() as port:
        src = SqlSource("hung", SqlSourceConfig(url=url.format(port=port), table="t", **timeouts))
        t0 = time.monotonic()
        with pytest.raises(TransientError, match="dataset hung: query on"):
            src.read()
        assert time.monotonic() - t0 < bound(8)


@pytest.mark.integration  # reaches the PostgreSQL at PG_URL without a fixture
@pytest.mark.timeout(60)
def test_postgresql_statement_timeout_names_the_dataset() -> None:
    src = SqlSource("slow", SqlSourceConfig(url=PG_URL, query="SELECT 1 AS id, pg_sleep(30) AS z",
                                            statement_timeout=dt.timedelta(seconds=1)))
    t0 = time.monotonic()
    with pytest.raises(TerminalError, match="dataset slow: query on .* timed out after statement_timeout 1s"):
        src.read()
    assert time.monotonic() - t0 < bound(8)


def test_mariadb_statement_timeout_bounds_the_whole_streamed_read(mysql_url: str) -> None:
    # The documented caveat: the limit covers streaming the rows too, so it must exceed the longest full read.
    # (PyMySQL streams chunk by chunk to a slow consumer; ConnectorX reads all rows before the first
    # chunk, so there it bounds that read: tests/refresh/sources/test_mysql_cx.py.)
    src = SqlSource("long", SqlSourceConfig(url=mysql_url, query="SELECT seq AS id FROM seq_1_to_3000000",
                                            chunk_rows=10_000, statement_timeout=dt.timedelta(seconds=1),
                                            reader="pymysql"))
    t0, rows = time.monotonic(), 0
    with pytest.raises(TerminalError, match="dataset long: read on .* timed out after statement_timeout 1s"):
        for batch in src.batches():
            rows += batch.num_rows
            time.sleep(0.05)  # a slow consumer
    assert 0 < rows < 3_000_000 and time.monotonic() - t0 < bound(10)


@pytest.mark.integration  # reaches the PostgreSQL at PG_URL without a fixture
@pytest.mark.timeout(60)
def test_postgresql_read_is_interrupted_from_another_thread() -> None:
    src = SqlSource("pgstop", SqlSourceConfig(url=PG_URL, query="SELECT 1 AS id, pg_sleep(30) AS z"))
    timer = threading.Timer(1.0, src.interrupt)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(TransientError, match="dataset pgstop: query on .*canceling statement due to user request"):
        src.read()
    assert time.monotonic() - t0 < bound(5)
    timer.join()

"""The ConnectorX reader (``reader: connectorx``) against the real MariaDB: the identical Arrow table
to the PyMySQL path's on every type, the fallbacks to PyMySQL, partitioned reads, and the timeout and
stop guarantees of a read that runs inside ConnectorX."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

from refresh.config import SqlSourceConfig
from refresh.sources import mysql_cx
from refresh.sources.sql import SqlSource
from refstream.errors import TerminalError, TransientError
from tests.refresh.conftest import execute
from tests.timing import bound

# Every MySQL/MariaDB column type the contract maps (refresh.sources.sqltypes), at its edges.
EVERY_TYPE = """(
    id INT NOT NULL PRIMARY KEY,
    ti TINYINT, tu TINYINT UNSIGNED, flag TINYINT(1), si SMALLINT, su SMALLINT UNSIGNED, mi MEDIUMINT,
    mu MEDIUMINT UNSIGNED, i INT, iu INT UNSIGNED, bi BIGINT, bu BIGINT UNSIGNED, yr YEAR,
    dec_wide DECIMAL(65,30), dec_38 DECIMAL(38,10), dec_small DECIMAL(5,2) UNSIGNED, dec_int DECIMAL(10,0),
    f FLOAT, d DOUBLE,
    day DATE, at DATETIME, at3 DATETIME(3), at6 DATETIME(6), stamp TIMESTAMP NULL, stamp6 TIMESTAMP(6) NULL,
    t TIME, t6 TIME(6),
    ch CHAR(5), vc VARCHAR(50), tt TINYTEXT, txt TEXT, lt LONGTEXT, lat VARCHAR(10) CHARACTER SET latin1,
    bn BINARY(4), vb VARBINARY(8), tb TINYBLOB, bl BLOB, bit1 BIT(1), bit10 BIT(10),
    js JSON, e ENUM('a','b','ü'), st SET('x','y','z'), u UUID, ip INET6)"""

ROWS = [
    "(1, -128, 255, 1, -32768, 65535, -8388608, 16777215, -2147483648, 4294967295, -9223372036854775808, "
    "9223372036854775807, 1901, 12345678901234567890123456789012345.123456789012345678901234567890, "
    "-1234567890123456789012345678.0123456789, 999.99, 9999999999, 0.1, 0.30000000000000004, "
    "'1000-01-01', '1000-01-01 00:00:00', '2024-01-02 03:04:05.678', '9999-12-31 23:59:59.999999', "
    "'1970-01-01 00:00:01', '2038-01-19 03:14:07.999999', '-838:59:59', '838:59:59.000000', "
    "'ab  ', '日本語 ✓ \\\\ \"q\"\\t\\n', 'tiny', 'Zoë 😀', REPEAT('long ', 1000), 'café', "
    "'ab', x'00ff10', x'00', x'cafe', b'1', b'1010101010', "
    "'{\"a\": [1, 2], \"ü\": null}', 'ü', 'x,z', '123e4567-e89b-12d3-a456-426614174000', '::1')",
    "(2, 127, 0, 0, 32767, 0, 8388607, 0, 2147483647, 0, 9223372036854775807, 0, 2155, "
    "-0.000000000000000000000000000001, 0, 0.00, -1, -3.4e38, 1.7976931348623157e308, "
    "'9999-12-31', '9999-12-31 23:59:59', '2024-02-29 23:59:59.999', '1000-01-01 00:00:00.000001', "
    "'2024-05-01 12:00:00', '2024-05-01 12:00:00.000001', '00:00:00', '-00:00:01.500000', "
    "'', '', '', '', '', '', x'', x'', x'', x'', b'0', b'0', '[]', 'a', '', "
    "'00000000-0000-0000-0000-000000000000', '::ffff:192.168.0.1')",
    "(3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, "
    "NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, "
    "NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
    "(4, 0, 1, 2, 0, 1, 0, 1, 0, 1, 0, 1, 2000, 0.5, 1.5, 1.50, 0, 1.17549435e-38, -2.2250738585072014e-308, "
    "'2024-02-29', '2024-02-29 00:00:00', '2024-02-29 00:00:00.100', '2024-02-29 00:00:00.000100', "
    "'2024-02-29 00:00:00', '2024-02-29 00:00:00.5', '12:34:56', '-12:34:56.789012', "
    "'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', b'1', b'1111111111', '\"s\"', 'b', 'x,y,z', "
    "'ffffffff-ffff-ffff-ffff-ffffffffffff', '2001:db8::ff00:42:8329')",
]


def both(url: str, key: tuple[str, ...] = (), **cfg: Any) -> tuple[pa.Table, pa.Table, SqlSource]:
    """The table read by PyMySQL and by ConnectorX (and the ConnectorX source; ``key``: the dataset's)."""
    by_pymysql = SqlSource("ds", SqlSourceConfig(url=url, reader="pymysql", **cfg)).read()
    src = SqlSource("ds", SqlSourceConfig(url=url, reader="connectorx", **cfg), key)
    assert src.reader == "connectorx"
    return by_pymysql, src.read(), src


@pytest.fixture
def every_type(mysql_engine: sa.Engine, unique) -> str:
    t = unique("every")
    execute(mysql_engine, f"CREATE TABLE {t} {EVERY_TYPE}", f"INSERT INTO {t} VALUES " + ", ".join(ROWS))
    # Doubles whose shortest text needs all 17 digits, random bit patterns, ranges of every kind.
    execute(mysql_engine, f"INSERT INTO {t} (id, d, f, dec_38, at6, t6, vc, bi) SELECT seq + 10, "
                          "RAND(seq) * POW(10, CAST(seq AS SIGNED) % 600 - 300) * IF(seq % 2, -1, 1), RAND(seq + 1) * 1000, "
                          "seq / 7, TIMESTAMP('2000-01-01') + INTERVAL seq * 7777 SECOND + INTERVAL seq MICROSECOND, "
                          "SEC_TO_TIME(CAST(seq AS SIGNED) * 13 - 100000), CONCAT(REPEAT('é', seq % 40), seq), seq * seq "
                          "FROM seq_1_to_5000")
    return t


def test_connectorx_reads_the_identical_table_on_every_type(mysql_url: str, every_type: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        by_pymysql, by_cx, _ = both(mysql_url, table=every_type, chunk_rows=777)
    assert not caplog.records  # no fallback: ConnectorX read every column itself
    assert by_pymysql.num_rows == 5004
    assert by_cx.schema == by_pymysql.schema
    assert by_cx.equals(by_pymysql), [n for n in by_cx.column_names
                                      if not by_cx.column(n).equals(by_pymysql.column(n))]
    row = by_cx.slice(0, 1).to_pylist()[0]
    assert row["dec_wide"] == Decimal("12345678901234567890123456789012345.123456789012345678901234567890")
    assert row["t"] == -dt.timedelta(hours=838, minutes=59, seconds=59) and row["bu"] == 2**63 - 1
    assert row["f"] == 0.1 and row["lt"] == "long " * 1000 and row["bit10"] == b"\x02\xaa"


def test_connectorx_query_source_and_reads_since_a_cursor(mysql_url: str, every_type: str) -> None:
    query = (f"SELECT id, NULL AS nothing, 1.5 AS lit, CAST(at6 AS DATE) AS day6, d / 2 AS d2, "
             f"CONCAT(vc, '!') AS vc2, t6 FROM {every_type} WHERE id <> 3")
    by_pymysql, by_cx, src = both(mysql_url, query=query)
    assert by_cx.equals(by_pymysql) and by_cx.schema.field("nothing").type == pa.string()
    pymysql_src = SqlSource("ds", SqlSourceConfig(url=mysql_url, reader="pymysql", query=query))
    for column, low in (("id", 4000), ("day6", dt.date(2000, 6, 1)), ("vc2", "éé"), ("lit", Decimal("1.5")),
                        ("id", 10**9)):
        want = pymysql_src.read_since(column, low)
        got = src.read_since(column, low)
        assert got.equals(want) and got.schema == want.schema, (column, low)
    table_src = SqlSource("ds", SqlSourceConfig(url=mysql_url, reader="connectorx", table=every_type))
    at = dt.datetime(2000, 6, 1, 12, 30, 0, 5)
    assert table_src.read_since("at6", at).equals(
        SqlSource("ds", SqlSourceConfig(url=mysql_url, reader="pymysql", table=every_type)).read_since("at6", at))


def test_connectorx_partitioned_read_keeps_the_key_order(mysql_url: str, mysql_engine: sa.Engine,
                                                          unique, monkeypatch: pytest.MonkeyPatch) -> None:
    t = unique("parts")
    execute(mysql_engine, f"CREATE TABLE {t} (id BIGINT PRIMARY KEY, v VARCHAR(20), p DECIMAL(12,2))",
            f"INSERT INTO {t} SELECT seq * 3, CONCAT('v', seq), seq / 100 FROM seq_1_to_30000")
    reads = spy_reads(monkeypatch)
    by_pymysql, by_cx, _ = both(mysql_url, ("id",), table=t, read_partitions=3, chunk_rows=1000)
    assert by_cx.equals(by_pymysql) and by_cx.num_rows == 30000
    assert [len(queries) for queries in reads] == [3]  # one ConnectorX read of 3 key ranges
    # A dataset key without the primary key: its keys are read once more, in one statement, to check
    # that no row changed range during the read (none did: nothing else is read).
    reads.clear()
    _, by_cx, _ = both(mysql_url, ("p", "v"), table=t, read_partitions=3, chunk_rows=1000)
    assert by_cx.equals(by_pymysql) and [len(queries) for queries in reads] == [3, 1]
    assert reads[1][0].startswith(f"SELECT id, v, CAST(p AS CHAR) AS p FROM {t} AS refresh_cx_")
    # Without the dataset's key (or a primary key of one integer column), one statement.
    reads.clear()
    assert both(mysql_url, table=t, read_partitions=3)[1].equals(by_pymysql) and reads == [[reads[0][0]]]


def test_key_ranges_cover_every_value() -> None:
    assert mysql_cx.ranges("`id`", 1, 10, 3) == ["`id` < 4", "`id` >= 4 AND `id` < 7", "`id` >= 7"]
    assert mysql_cx.ranges("k", -5, -4, 8) == ["k < -4", "k >= -4"]  # no more ranges than values
    assert mysql_cx.ranges("k", 7, 7, 4) == []  # one value: one statement, no condition
    for low, high, n in ((0, 100, 7), (3, 4, 2), (-(2**63), 2**63 - 1, 16)):
        conds = mysql_cx.ranges("k", low, high, n)
        assert len(conds) == min(n, high - low + 1)
        assert conds[0].startswith("k < ") and conds[-1].startswith("k >= ")


def test_keys_a_read_in_ranges_cannot_vouch_for() -> None:
    read = pa.table({"id": [1, 2, 3, 9], "code": ["a", "b", "a", "c"], "n": [1, 1, 2, 1]})
    now = pa.table({"code": ["a", "c", "d", "e", "b"], "n": [1, 1, 2, 2, 1]})
    doubt = mysql_cx.suspects(read, now, ["code"])
    assert sorted(doubt.column("code").to_pylist()) == ["a", "d", "e"]  # twice, not read, not read
    doubt2 = mysql_cx.suspects(read, now, ["code", "n"])  # ("a", 1) and ("a", 2) are two keys
    assert sorted(doubt2.to_pylist(), key=str) == [{"code": "d", "n": 2}, {"code": "e", "n": 2}]
    assert mysql_cx.rows_of(read, doubt, ["code"], keep=True).to_pylist() == [0, 2]
    assert mysql_cx.rows_of(read, doubt, ["code"], keep=False).to_pylist() == [1, 3]
    assert mysql_cx.suspects(now, now.slice(0, 0), ["code"]).num_rows == 0


def spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The statements of every ConnectorX read from now on, one list per read."""
    reads: list[list[str]] = []
    real = mysql_cx.read

    def spy(url: str, queries: list[str], settings: list[str]) -> pa.Table:
        reads.append(list(queries))
        return real(url, queries, settings)

    monkeypatch.setattr(mysql_cx, "read", spy)
    return reads


def test_zero_dates_and_geometry_fall_back_to_pymysql(mysql_url: str, mysql_engine: sa.Engine, unique,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    zero, geo = unique("zero"), unique("geo")
    with mysql_engine.begin() as conn:
        conn.execute(sa.text("SET SESSION sql_mode=''"))
        conn.execute(sa.text(f"CREATE TABLE {zero} (id INT PRIMARY KEY, d DATETIME)"))
        conn.execute(sa.text(f"INSERT INTO {zero} VALUES (1, '0000-00-00 00:00:00'), (2, '2024-01-01')"))
        conn.execute(sa.text(f"CREATE TABLE {geo} (id INT PRIMARY KEY, g POINT)"))
        conn.execute(sa.text(f"INSERT INTO {geo} VALUES (1, POINT(1, 2)), (2, NULL)"))
    for table, why in ((zero, "connectorx cannot read this table exactly"),
                       (geo, "connectorx cannot read column g (MySQL type code 255) exactly")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="refresh.sources.sql"):
            by_pymysql, by_cx, _ = both(mysql_url, table=table)
        assert by_cx.equals(by_pymysql) and by_cx.schema == by_pymysql.schema
        fallbacks = [r.getMessage() for r in caplog.records if r.name == "refresh.sources.sql"]
        assert len(fallbacks) == 1 and why in fallbacks[0] and "reading with PyMySQL" in fallbacks[0]
    assert by_cx.column("g").to_pylist()[1] is None


def test_reader_auto_prefers_connectorx_and_falls_back_for_urls_it_cannot_read(mysql_url: str) -> None:
    assert SqlSource("ds", SqlSourceConfig(url=mysql_url, table="t")).reader == "connectorx"
    assert SqlSource("ds", SqlSourceConfig(url=mysql_url, table="t", reader="pymysql")).reader == "pymysql"
    odd = mysql_url + "&init_command=SET%20%40x%3D1"
    assert SqlSource("ds", SqlSourceConfig(url=odd, table="t")).reader == "pymysql"
    with pytest.raises(TerminalError, match="dataset ds: reader connectorx cannot read .*init_command"):
        SqlSource("ds", SqlSourceConfig(url=odd, table="t", reader="connectorx"))


# 20 s inside the ConnectorX read (the query for the column types, LIMIT 0, runs no SLEEP).
SLOW = "SELECT seq AS id, SLEEP(0.5) AS z FROM seq_1_to_40"


@pytest.mark.timeout(60)
def test_connectorx_read_past_the_statement_timeout_fails_naming_the_dataset(mysql_url: str) -> None:
    src = SqlSource("slow", SqlSourceConfig(url=mysql_url, query=SLOW, reader="connectorx",
                                            statement_timeout=dt.timedelta(seconds=1)))
    t0 = time.monotonic()
    with pytest.raises(TerminalError, match="dataset slow: read on .* timed out after statement_timeout 1s") as info:
        src.read()
    assert time.monotonic() - t0 < bound(10) and not isinstance(info.value, TransientError)


def _statements(engine: sa.Engine, text: str) -> list[str]:
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(sa.text(
            "SELECT info FROM information_schema.processlist WHERE id <> CONNECTION_ID() AND INSTR(info, :t) > 0"),
            {"t": text})]


@pytest.mark.timeout(60)
def test_an_interrupt_ends_a_connectorx_read_and_its_statements(mysql_url: str, mysql_engine: sa.Engine,
                                                                unique) -> None:
    t = unique("sleepy")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)", f"INSERT INTO {t} SELECT seq FROM seq_1_to_40")
    # A table read whose rows each take 0.5 s on the server: stuck inside ConnectorX for 20 s.
    execute(mysql_engine, f"CREATE VIEW {t}_v AS SELECT id, SLEEP(0.5) AS z FROM {t}")
    src = SqlSource("stop", SqlSourceConfig(url=mysql_url, query=f"SELECT * FROM {t}_v", reader="connectorx"))
    timer = threading.Timer(1.5, src.interrupt)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(TransientError, match="dataset stop: read on .*"):
        src.read()
    assert time.monotonic() - t0 < bound(5)
    timer.join()
    deadline = time.monotonic() + bound(5)  # the server dropped the statements too (KILL)
    while _statements(mysql_engine, f"{t}_v") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _statements(mysql_engine, f"{t}_v") == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("change", "error", "message"), [
    ("port", TransientError, "Can't connect to MySQL server"),    # nothing listens there
    ("password", TerminalError, "Access denied for user 'root'"),  # the wrong password for root
], ids=["refused", "bad-password"])
def test_connectorx_fails_within_the_connect_timeout_when_it_cannot_connect(
        mysql_url: str, mysql_engine: sa.Engine, unique, monkeypatch: pytest.MonkeyPatch,
        change: str, error: type[Exception], message: str) -> None:
    """The PyMySQL step (column types) connects; ConnectorX's own connections then fail, as when the
    server goes away or the password changes in between: ConnectorX alone would retry for 30 s."""
    from demo.broker import free_port

    t = unique("down")
    execute(mysql_engine, f"CREATE TABLE {t} (id INT PRIMARY KEY)", f"INSERT INTO {t} VALUES (1)")
    real = mysql_cx.url_for

    def url_for(host: str | None, port: int | None, user: str | None, password: str | None, *rest: Any) -> Any:
        if change == "port":
            return real(host, free_port(), user, password, *rest)
        return real(host, port, user, "wrong", *rest)

    monkeypatch.setattr(mysql_cx, "url_for", url_for)
    src = SqlSource("cxdown", SqlSourceConfig(url=mysql_url, table=t, reader="connectorx",
                                              connect_timeout=dt.timedelta(seconds=2)))
    t0 = time.monotonic()
    with pytest.raises(error, match=f"dataset cxdown: connect on .* table {t} failed: .*{message}"):
        src.read()
    assert time.monotonic() - t0 < bound(6)  # about the 2 s connect_timeout, not ConnectorX's 30 s

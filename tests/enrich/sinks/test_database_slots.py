"""The database sink's slots at component level, on the local PostgreSQL and MariaDB: the fence row
and the rows commit in one transaction, a replay writes nothing, a concurrent attempt of the same
slot writes nothing once the first commits."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, TimestampType

from enrich.config import DatabaseOutput
from enrich.sinks.database.connect import connect
from enrich.sinks.database.slots import write_slot
from enrich.sinks.database.tables import TableSpec, ensure_tables, table_spec
from refstream.errors import ConfigError
from tests.timing import bound

pytestmark = pytest.mark.integration

FIELDS = [StructField("device_id", StringType()), StructField("events", LongType()),
          StructField("last_seen", TimestampType()), StructField("temp", DoubleType())]


@pytest.fixture(params=["postgresql", "mysql"])
def db(request: pytest.FixtureRequest, unique: Callable[[str], str]) -> tuple[TableSpec, Any]:
    url = request.getfixturevalue("pg_url" if request.param == "postgresql" else "mysql_url")
    out = DatabaseOutput(url=url, table=unique("state"), write="state", dialect=request.param)
    spec = table_spec(out, FIELDS, ("device_id",))
    conn = connect(url, out.dialect)
    ensure_tables(conn, spec)
    request.addfinalizer(conn.close)
    return spec, conn


def rows(*values: tuple[str, int, float | None]) -> pa.Table:
    return pa.table({"device_id": [v[0] for v in values], "events": [v[1] for v in values],
                     "last_seen": pa.array([datetime(2026, 1, 1, 0, v[1], tzinfo=UTC) for v in values],
                                           pa.timestamp("us", tz="UTC")),
                     "temp": [v[2] for v in values]})


def table_rows(spec: TableSpec, conn: Any) -> dict[str, tuple]:
    with conn.cursor() as cur:
        cur.execute(f"SELECT device_id, events, last_seen, temp FROM {spec.table}")
        got = {r[0]: (r[1], r[2].replace(tzinfo=UTC), r[3]) for r in cur.fetchall()}
    conn.commit()
    return got


def fence_rows(spec: TableSpec, conn: Any) -> list[tuple]:
    with conn.cursor() as cur:
        cur.execute(f"SELECT query_id, slot, batch_id FROM {spec.fence} ORDER BY batch_id, slot")
        got = [tuple(r) for r in cur.fetchall()]
    conn.commit()
    return got


def test_replay_writes_nothing(db: tuple[TableSpec, Any]) -> None:
    spec, conn = db
    assert write_slot(conn, spec, "q", 0, 5, rows(("a", 1, 1.5), ("b", 2, None))) == 2
    # The same batch again (a replay) with other rows: nothing of it is written.
    assert write_slot(conn, spec, "q", 0, 5, rows(("a", 9, 9.0), ("c", 9, 9.0))) is None
    # The next batch upserts.
    assert write_slot(conn, spec, "q", 0, 6, rows(("a", 3, 2.5))) == 1
    got = table_rows(spec, conn)
    assert {k: (v[0], v[2]) for k, v in got.items()} == {"a": (3, 2.5), "b": (2, None)}
    assert got["a"][1] == datetime(2026, 1, 1, 0, 3, tzinfo=UTC)
    assert fence_rows(spec, conn) == [("q", 0, 5), ("q", 0, 6)]
    # Another query (a new checkpoint: batch ids from 0 again) is not fenced by this one's rows.
    assert write_slot(conn, spec, "other", 0, 5, rows(("d", 1, 0.0))) == 1


def test_rows_and_fence_row_commit_together(db: tuple[TableSpec, Any]) -> None:
    spec, conn = db

    def crash() -> None:
        raise RuntimeError("killed before the commit")

    with pytest.raises(Exception, match="killed before the commit"):
        write_slot(conn, spec, "q", 1, 7, rows(("a", 1, 1.0)), written=crash)
    assert table_rows(spec, conn) == {} and fence_rows(spec, conn) == []
    # The attempt after it writes the slot.
    assert write_slot(conn, spec, "q", 1, 7, rows(("a", 1, 1.0))) == 1
    assert list(table_rows(spec, conn)) == ["a"] and fence_rows(spec, conn) == [("q", 1, 7)]


def test_concurrent_attempt_waits_and_writes_nothing(db: tuple[TableSpec, Any]) -> None:
    spec, conn = db
    second = connect(spec.url, spec.dialect)
    inside, release = threading.Event(), threading.Event()
    results: dict[str, int | None] = {}

    def hold() -> None:
        inside.set()
        assert release.wait(bound(30))

    first = threading.Thread(target=lambda: results.update(
        first=write_slot(conn, spec, "q", 2, 3, rows(("a", 1, 1.0)), written=hold)))
    first.start()
    assert inside.wait(bound(30))
    other = threading.Thread(target=lambda: results.update(
        other=write_slot(second, spec, "q", 2, 3, rows(("z", 1, 1.0)))))
    other.start()
    other.join(1.0)
    assert other.is_alive(), "the second attempt did not wait for the first one's fence row"
    release.set()
    first.join(30)
    other.join(30)
    second.close()
    assert results == {"first": 1, "other": None}
    assert list(table_rows(spec, conn)) == ["a"]


def test_an_existing_table_without_a_column_is_refused(db: tuple[TableSpec, Any], unique: Callable[[str], str]) -> None:
    spec, conn = db
    wider = TableSpec(spec.url, spec.dialect, spec.table, spec.fence, (*spec.columns, ("owner", "TEXT")), spec.key)
    with pytest.raises(ConfigError, match=r"output\.database\.table: .* exists without the column\(s\) \['owner'\]"):
        ensure_tables(conn, wider)


def test_a_join_column_named_like_a_state_field_is_refused() -> None:
    out = DatabaseOutput(url="postgresql://h/d", table="t", write="state", dialect="postgresql")
    with pytest.raises(ConfigError, match=r"the column\(s\) \['events'\] twice .* prefix:"):
        table_spec(out, [*FIELDS, StructField("events", StringType())], ("device_id",))


def test_a_postgresql_column_name_over_63_bytes_is_refused_before_the_table_is_created() -> None:
    """A column a published schema adds (unknown at load) is checked where the table's columns are decided."""
    out = DatabaseOutput(url="postgresql://h/d", table="t", write="state", dialect="postgresql")
    long = "c" * 64
    with pytest.raises(ConfigError, match=rf"PostgreSQL names are at most 63 bytes; the job would create '{long}'"):
        table_spec(out, [*FIELDS, StructField(long, StringType())], ("device_id",))
    mysql = DatabaseOutput(url="mysql+pymysql://h/d", table="t", write="state", dialect="mysql")
    assert table_spec(mysql, [*FIELDS, StructField(long, StringType())], ("device_id",)).names[-1] == long


def corrected_state_table(request: pytest.FixtureRequest, unique: Callable[[str], str],
                          db_url: str) -> tuple[TableSpec, Any]:
    """A write: state table with corrections (the event's position and tail) at the database of
    fixture ``db_url``, created, and a connection to it."""
    url = request.getfixturevalue(db_url)
    out = DatabaseOutput(url=url, table=unique("state"), write="state",
                         dialect="postgresql" if db_url == "pg_url" else "mysql")
    fields = [*FIELDS, StructField("site", StringType()), StructField("_topic", StringType()),
              StructField("_partition", LongType()), StructField("_offset", LongType()),
              StructField("_kind", StringType()), StructField("_revision", LongType())]
    spec = table_spec(out, fields, ("device_id",), ("_topic", "_partition", "_offset"))
    conn = connect(url, out.dialect)
    request.addfinalizer(conn.close)
    ensure_tables(conn, spec)
    return spec, conn


def corrected_rows(*values: tuple[str, int, str, str, int, str, int]) -> pa.Table:
    """Rows of :func:`corrected_state_table`: (device, events, site, topic, offset, kind, revision)."""
    base = rows(*((d, n, 1.0) for d, n, *_ in values))
    return (base.append_column("site", pa.array([v[2] for v in values]))
            .append_column("_topic", pa.array([v[3] for v in values]))
            .append_column("_partition", pa.array([0] * len(values), pa.int64()))
            .append_column("_offset", pa.array([v[4] for v in values], pa.int64()))
            .append_column("_kind", pa.array([v[5] for v in values]))
            .append_column("_revision", pa.array([v[6] for v in values], pa.int64())))


@pytest.mark.parametrize("dialect", ["postgresql", "mysql"])
def test_a_correction_replaces_only_the_row_that_holds_its_event(
        request: pytest.FixtureRequest, unique: Callable[[str], str], dialect: str) -> None:
    """write: state with corrections: a correction of the event a device's row holds replaces the
    row; one of an earlier event (the row moved on), or of a device without a row, writes nothing;
    the batch's events go in first, so a correction of an event the same batch replaced leaves it."""
    spec, conn = corrected_state_table(request, unique, "pg_url" if dialect == "postgresql" else "mysql_url")

    def batch(*values: tuple[str, int, str, int, str, int]) -> pa.Table:
        """(device, events, site, offset, kind, revision), of topic ev."""
        return corrected_rows(*((d, n, site, "ev", off, kind, rev) for d, n, site, off, kind, rev in values))

    assert write_slot(conn, spec, "q", 0, 1, batch(("a", 2, "s-2", 11, "event", 0), ("b", 5, "s-2", 12, "event", 0),
                                                  ("c", 1, "s-2", 13, "event", 0))) == 3
    assert write_slot(conn, spec, "q", 0, 2, batch(
        ("a", 2, "s-6", 11, "correction", 1),   # a's row holds offset 11: replaced
        ("a", 9, "s-9", 5, "correction", 1),    # an event of a's earlier life (it expired, counts again): left
        ("b", 4, "s-6", 10, "correction", 1),   # b's row holds offset 12, not 10: left
        ("z", 1, "s-6", 9, "correction", 1),    # no row for z: none made
        ("c", 2, "s-2", 14, "event", 0),        # c's row moves on to offset 14 in this batch...
        ("c", 1, "s-6", 13, "correction", 1),   # ...so the correction of offset 13 leaves it
    )) == 2  # c's event and a's correction: what the table took
    with conn.cursor() as cur:
        cur.execute(f"SELECT device_id, events, site, _offset, _kind, _revision FROM {spec.table} ORDER BY device_id")
        got = [tuple(r) for r in cur.fetchall()]
    conn.commit()
    assert got == [("a", 2, "s-6", 11, "correction", 1), ("b", 5, "s-2", 12, "event", 0),
                   ("c", 2, "s-2", 14, "event", 0)]


#: Device ids a CSV load table, an UPDATE's parameters or a collation could get wrong.
HOSTILE = ['a"b', "c'd", "e\\f", "g\nh", "i,j", "k\tl", "\u00e9", "e", "E", "e ", '{"k": 1}', "\\N", "x" * 255]


@pytest.mark.parametrize("db_url", ["pg_url", "mysql_url", "mysql_default_url"])
def test_a_correction_replaces_the_row_of_exactly_its_device_whatever_the_key_holds(
        request: pytest.FixtureRequest, unique: Callable[[str], str], db_url: str) -> None:
    """write: state with corrections, devices whose ids hold quotes, a backslash, a newline, a comma,
    a tab, PostgreSQL's NULL marker, JSON, 255 characters (the key column's limit), or differ only
    in case, accent or a trailing space: each correction replaces its own device's row and none of
    the others', and an event of a topic whose name differs only in case is another event. On
    MariaDB also in a database whose default collation ignores case (``mysql_default_url``)."""
    spec, conn = corrected_state_table(request, unique, db_url)

    def batch(values: list[tuple[str, str, int, str, int, str]]) -> pa.Table:
        """(device, site, offset, kind, revision, topic), each device's first event."""
        return corrected_rows(*((d, 1, site, topic, off, kind, rev) for d, site, off, kind, rev, topic in values))

    assert write_slot(conn, spec, "q", 0, 1, batch([(d, "old", i, "event", 0, "ev") for i, d in enumerate(HOSTILE)])) \
        == len(HOSTILE)
    # Every even device's own event corrected; every odd device named with its neighbour's offset,
    # or its own offset of a topic whose name differs only in case (a correction of an event its row
    # does not hold): left.
    fixes = [(d, "new", i, "correction", 1, "ev") if i % 2 == 0 else
             (d, "new", (i + 1) % len(HOSTILE), "correction", 1, "ev") if i % 4 == 1 else
             (d, "new", i, "correction", 1, "EV") for i, d in enumerate(HOSTILE)]
    assert write_slot(conn, spec, "q", 0, 2, batch(fixes)) == (len(HOSTILE) + 1) // 2  # the rows replaced
    with conn.cursor() as cur:
        cur.execute(f"SELECT device_id, site, _offset, _kind, _revision FROM {spec.table}")
        got = {r[0]: tuple(r[1:]) for r in cur.fetchall()}
    conn.commit()
    assert got == {d: ("new", i, "correction", 1) if i % 2 == 0 else ("old", i, "event", 0)
                   for i, d in enumerate(HOSTILE)}


def test_an_existing_table_whose_event_identity_ignores_case_is_refused(
        mysql_default_url: str, unique: Callable[[str], str]) -> None:
    """write: state with corrections matches a correction to the row by the event's topic: an
    existing table whose ``_topic`` compares ``Events`` and ``events`` as equal is refused at the
    job's start (:func:`check_existing`), naming the table and the column; without corrections the
    same table is not refused."""
    from enrich.sinks.database.sink import POSITION, check_existing

    out = DatabaseOutput(url=mysql_default_url, table=unique("state"), write="state", dialect="mysql")
    conn = connect(mysql_default_url, "mysql")
    try:
        with conn.cursor() as cur:
            cur.execute(f"CREATE TABLE {out.table} (device_id VARBINARY(255) NOT NULL PRIMARY KEY, _topic LONGTEXT, "
                        "_topic_id LONGTEXT, _partition BIGINT, _offset BIGINT)")
        conn.commit()
    finally:
        conn.close()
    with pytest.raises(ConfigError, match=rf"table {out.table} has the key or event identity column\(s\) "
                                          r"\['_topic', '_topic_id'\] whose values compare equal"):
        check_existing(out, ("device_id",), POSITION)
    check_existing(out, ("device_id",))

"""The output table and its fence table: their columns, typed from the pipeline's output schema,
and their creation when missing (the key as primary key)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    TimestampNTZType,
    TimestampType,
)

from enrich.config import PG_NAME_BYTES, DatabaseDialect, DatabaseOutput, database_names_too_long
from enrich.sinks.database.connect import quote
from refstream.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["TableSpec", "ensure_tables", "sql_type", "table_spec"]


@dataclass(frozen=True)
class TableSpec:
    """What the tasks write: table ``table`` with ``columns`` (name, SQL type) and primary key ``key``,
    fenced by ``fence``. Picklable."""

    url: str
    dialect: DatabaseDialect
    table: str
    fence: str
    columns: tuple[tuple[str, str], ...]
    key: tuple[str, ...]
    timeout: float = 30.0          # output.database.statement_timeout, in seconds
    #: write: state with corrections: the columns naming the event a row holds. A row with ``_kind``
    #: correction then replaces only the row of its key that holds its event (slots.write_slot).
    identity: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.columns)


#: The length of a MySQL/MariaDB key column of text or bytes (characters or bytes): a longer value
#: is a dead letter (:mod:`enrich.sinks.database.refuse`).
KEY_LENGTH = 255
#: The collations that compare text byte for byte, trailing spaces included (NO PAD): MariaDB's,
#: then MySQL 8's. The server's default (``utf8mb4_general_ci``) and the PAD SPACE ``utf8mb4_bin``
#: would make ``Dev-1`` and ``dev-1``, or ``d2`` and ``d2 ``, one row.
EXACT_COLLATIONS = ("utf8mb4_nopad_bin", "utf8mb4_0900_bin")
#: The placeholder of the key columns' collation in :func:`sql_type`'s MySQL types, replaced by the
#: server's own once connected (:func:`ensure_tables`).
EXACT = "{exact}"


def sql_type(dt: DataType, dialect: DatabaseDialect, key: bool = False) -> str:
    """The column type for a Spark type: exact where the database has one; nested values as JSON.
    Text keys compare byte for byte (PostgreSQL ``COLLATE "C"``, MySQL a NO PAD binary collation)."""
    pg = dialect == "postgresql"
    if isinstance(dt, StringType):
        if key:
            return 'TEXT COLLATE "C"' if pg else f"VARCHAR({KEY_LENGTH}) CHARACTER SET utf8mb4 COLLATE {EXACT}"
        return "TEXT" if pg else "LONGTEXT"
    if isinstance(dt, BinaryType):
        return "BYTEA" if pg else (f"VARBINARY({KEY_LENGTH})" if key else "LONGBLOB")
    if isinstance(dt, BooleanType):
        return "BOOLEAN"
    if isinstance(dt, ByteType | ShortType):
        return "SMALLINT"
    if isinstance(dt, IntegerType):
        return "INTEGER"
    if isinstance(dt, LongType):
        return "BIGINT"
    if isinstance(dt, FloatType):
        return "REAL" if pg else "FLOAT"
    if isinstance(dt, DoubleType):
        return "DOUBLE PRECISION" if pg else "DOUBLE"
    if isinstance(dt, DecimalType):
        return f"NUMERIC({dt.precision}, {dt.scale})" if pg else f"DECIMAL({dt.precision}, {dt.scale})"
    if isinstance(dt, TimestampType):
        return "TIMESTAMPTZ" if pg else "DATETIME(6)"
    if isinstance(dt, TimestampNTZType):
        return "TIMESTAMP" if pg else "DATETIME(6)"
    if isinstance(dt, DateType):
        return "DATE"
    return "JSONB" if pg else "LONGTEXT"


def table_spec(db: DatabaseOutput, fields: Sequence[StructField], key: Sequence[str],
               identity: Sequence[str] = ()) -> TableSpec:
    """The table of rows with ``fields`` (in order), keyed by ``key`` (``identity``: see
    :attr:`TableSpec.identity`); a :class:`ConfigError` when two fields share a name."""
    names = [f.name for f in fields]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"output.database: the rows of write: {db.write} would have the column(s) {twice} twice "
                          "(a join column named like a state field?); rename them with a join's prefix:")
    long = database_names_too_long(db, names)
    if long:
        raise ConfigError(f"output.database: PostgreSQL names are at most {PG_NAME_BYTES} bytes; the job would "
                          f"create {', '.join(repr(n) for n in long)}: shorten them (a join's prefix:, the table)")
    # The identity's text (a topic's name or id) is matched by the corrections' UPDATE: it compares
    # byte for byte as a key does (``Events`` and ``events`` are two topics).
    cols = tuple((f.name, sql_type(f.dataType, db.dialect, f.name in key or f.name in identity)) for f in fields)
    return TableSpec(db.url, db.dialect, db.table, db.fence, cols, tuple(key), db.statement_timeout.total_seconds(),
                     tuple(identity))


def exact_collation(cur: Any) -> str:
    """The server's NO PAD binary utf8mb4 collation (MySQL/MariaDB); a :class:`ConfigError` when it
    has none."""
    cur.execute("SELECT COLLATION_NAME FROM information_schema.COLLATIONS WHERE COLLATION_NAME IN "
                f"({', '.join(['%s'] * len(EXACT_COLLATIONS))})", EXACT_COLLATIONS)
    have = {str(r[0]) for r in cur.fetchall()}
    for name in EXACT_COLLATIONS:
        if name in have:
            return name
    raise ConfigError(f"output.database.url: the server has none of the collations {list(EXACT_COLLATIONS)} "
                      "that compare keys byte for byte (MariaDB 10.4+, MySQL 8.0+)")


def fence_ddl(dialect: DatabaseDialect, fence: str, collation: str = "") -> str:
    """The fence table's ``CREATE TABLE IF NOT EXISTS`` (``collation``: MySQL's, from :func:`exact_collation`)."""
    qid = 'TEXT COLLATE "C"' if dialect == "postgresql" else f"VARCHAR(64) CHARACTER SET utf8mb4 COLLATE {collation}"
    # Keyed by batch before slot: the last batch of a query (enrich lookup --state) and the rows a
    # prune deletes (enrich.sinks.database.sink.prune_fence) are ranges of the key.
    return (f"CREATE TABLE IF NOT EXISTS {quote(dialect, fence)} (query_id {qid} NOT NULL, slot INTEGER NOT NULL, "
            "batch_id BIGINT NOT NULL, PRIMARY KEY (query_id, batch_id, slot))")


def merging_keys(cur: Any, dialect: DatabaseDialect, table: str, key: Sequence[str]) -> list[str]:
    """The columns of ``key`` of an existing ``table`` that compare two different values as equal:
    a collation that ignores case, accents or trailing spaces (MySQL's ``_ci``, PAD SPACE ``_bin``;
    PostgreSQL's nondeterministic ones), or a type that pads (``CHAR``, ``BINARY``, ``citext``).
    Empty when the table is missing."""
    if dialect == "postgresql":
        cur.execute("SELECT a.attname, format_type(a.atttypid, a.atttypmod), co.collisdeterministic "
                    "FROM pg_attribute a LEFT JOIN pg_collation co ON co.oid = a.attcollation "
                    "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped",
                    (quote(dialect, table),))
        return [str(n) for n, typ, exact in cur.fetchall() if n in key and
                (str(typ).startswith(("character(", "citext")) or str(typ) == "character" or exact is False)]
    cur.execute("SELECT COLUMN_NAME, DATA_TYPE, COLLATION_NAME FROM information_schema.COLUMNS "
                "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s", (table,))
    bad = []
    for name, typ, collation in cur.fetchall():
        if name not in key:
            continue
        typ, collation = str(typ).lower(), str(collation or "")
        if typ in ("char", "binary") or (collation and not (collation.endswith("_nopad_bin")
                                                           or collation in ("utf8mb4_0900_bin", "binary"))):
            bad.append(str(name))
    return bad


def check_keys(cur: Any, dialect: DatabaseDialect, table: str, fence: str, key: Sequence[str],
               identity: Sequence[str] = ()) -> None:
    """A :class:`ConfigError` naming the table and column when an existing table's key column would
    make two keys one row (:func:`merging_keys`), or an ``identity`` column two events one."""
    for name, cols in ((table, (*key, *identity)), (fence, ("query_id",))):
        bad = merging_keys(cur, dialect, name, cols)
        if bad:
            what = "key column(s)" if set(bad) <= {*key, "query_id"} else "key or event identity column(s)"
            fix = ('give it a deterministic collation such as "C" (ALTER TABLE ... ALTER COLUMN ... TYPE text '
                   'COLLATE "C")' if dialect == "postgresql" else
                   "give it a NO PAD binary collation (ALTER TABLE ... MODIFY ... CHARACTER SET utf8mb4 COLLATE "
                   "utf8mb4_nopad_bin on MariaDB, utf8mb4_0900_bin on MySQL) or make it VARBINARY")
            raise ConfigError(f"output.database.table: table {name} has the {what} {bad} whose values "
                              f"compare equal when they differ (case, accents or trailing spaces): two keys would "
                              f"share one row; {fix}, or point table: at a new table")


def ensure_tables(conn: Any, spec: TableSpec) -> None:
    """Create the table and its fence table if missing; a :class:`ConfigError` when the table exists
    without a column the rows have, or with a key column that merges keys (:func:`check_keys`)."""
    def q(n: str) -> str:
        return quote(spec.dialect, n)

    with conn.cursor() as cur:
        collation = exact_collation(cur) if spec.dialect == "mysql" else ""
        cols = ", ".join(f"{q(n)} {t.replace(EXACT, collation)}" + (" NOT NULL" if n in spec.key else "")
                         for n, t in spec.columns)
        cur.execute(f"CREATE TABLE IF NOT EXISTS {q(spec.table)} ({cols}, "
                    f"PRIMARY KEY ({', '.join(q(k) for k in spec.key)}))")
        cur.execute(fence_ddl(spec.dialect, spec.fence, collation))
        check_keys(cur, spec.dialect, spec.table, spec.fence, spec.key, spec.identity)
        schema = "current_schema()" if spec.dialect == "postgresql" else "DATABASE()"
        cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = "
                    f"{schema} AND table_name = %s", (spec.table,))
        have = {str(r[0]) for r in cur.fetchall()}
    conn.commit()
    missing = [n for n in spec.names if n not in have]
    if missing:
        raise ConfigError(f"output.database.table: {spec.table} exists without the column(s) {missing} the job "
                          "writes; point table: at a new table, or add them")

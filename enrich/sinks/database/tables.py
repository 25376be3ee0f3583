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

from enrich.config import DatabaseDialect, DatabaseOutput
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

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.columns)


def sql_type(dt: DataType, dialect: DatabaseDialect, key: bool = False) -> str:
    """The column type for a Spark type: exact where the database has one; nested values as JSON."""
    pg = dialect == "postgresql"
    if isinstance(dt, StringType):
        return "TEXT" if pg else ("VARCHAR(255)" if key else "LONGTEXT")
    if isinstance(dt, BinaryType):
        return "BYTEA" if pg else ("VARBINARY(255)" if key else "LONGBLOB")
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


def table_spec(db: DatabaseOutput, fields: Sequence[StructField], key: Sequence[str]) -> TableSpec:
    """The table of rows with ``fields`` (in order), keyed by ``key``; a :class:`ConfigError` when
    two fields share a name."""
    names = [f.name for f in fields]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"output.database: the rows of write: {db.write} would have the column(s) {twice} twice "
                          "(a join column named like a state field?); rename them with a join's prefix:")
    cols = tuple((f.name, sql_type(f.dataType, db.dialect, f.name in key)) for f in fields)
    return TableSpec(db.url, db.dialect, db.table, db.fence, cols, tuple(key))


def ensure_tables(conn: Any, spec: TableSpec) -> None:
    """Create the table and its fence table if missing; a :class:`ConfigError` when the table exists
    without a column the rows have."""
    def q(n: str) -> str:
        return quote(spec.dialect, n)

    cols = ", ".join(f"{q(n)} {t}" + (" NOT NULL" if n in spec.key else "") for n, t in spec.columns)
    qid = "TEXT" if spec.dialect == "postgresql" else "VARCHAR(64)"
    with conn.cursor() as cur:
        cur.execute(f"CREATE TABLE IF NOT EXISTS {q(spec.table)} ({cols}, "
                    f"PRIMARY KEY ({', '.join(q(k) for k in spec.key)}))")
        cur.execute(f"CREATE TABLE IF NOT EXISTS {q(spec.fence)} (query_id {qid} NOT NULL, slot INTEGER NOT NULL, "
                    "batch_id BIGINT NOT NULL, PRIMARY KEY (query_id, slot, batch_id))")
        schema = "current_schema()" if spec.dialect == "postgresql" else "DATABASE()"
        cur.execute("SELECT column_name FROM information_schema.columns WHERE table_schema = "
                    f"{schema} AND table_name = %s", (spec.table,))
        have = {str(r[0]) for r in cur.fetchall()}
    conn.commit()
    missing = [n for n in spec.names if n not in have]
    if missing:
        raise ConfigError(f"output.database.table: {spec.table} exists without the column(s) {missing} the job "
                          "writes; point table: at a new table, or add them")

"""Device events: Kafka records parsed with Spark's ``from_json`` against the configured DDL.

A record that is not valid JSON, does not fit the schema (PERMISSIVE mode with a corrupt-record
column), has no value or a null in a required field keeps flowing with ``_error`` set, so the sink
sends it to the dead-letter topic instead of dropping it or stopping the job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from enrich.columns import CORRUPT, ERROR, INTERNAL, SLOW, SOURCE
from enrich.events.fastparse import FastParser
from refstream.compat import CompatError, spark_ddl_type
from refstream.errors import ConfigError

#: The types of the Kafka columns :data:`SOURCE` carries (both Kafka sources give these).
SOURCE_TYPES: dict[str, DataType] = {"_key": BinaryType(), "_value": BinaryType(), "_topic": StringType(),
                                     "_partition": IntegerType(), "_offset": LongType()}


def event_schema(ddl: str, required: Sequence[str] = (), source: str = "config") -> StructType:
    try:
        schema = spark_ddl_type(ddl)
    except CompatError:
        raise
    except Exception as exc:  # Spark raises its ParseException family; report the key at fault
        raise ConfigError(f"{source}: events.schema: {ddl!r} is not a Spark DDL schema: "
                          f"{str(exc).splitlines()[0]}") from None
    if not isinstance(schema, StructType):
        raise ConfigError(f"{source}: events.schema: {ddl!r} must list fields (name TYPE, ...)")
    clash = [f.name for f in schema.fields if f.name in INTERNAL or f.name == CORRUPT]
    if clash:
        raise ConfigError(f"{source}: events.schema: field name(s) {clash} are reserved")
    missing = [r for r in required if r not in schema.fieldNames()]
    if missing:
        raise ConfigError(f"{source}: events.required: {missing} not in events.schema")
    return schema


def parsed_schema(schema: StructType) -> StructType:
    """The columns :func:`parse` gives for events of ``schema``, known without a query."""
    return StructType([*(StructField(f.name, f.dataType, True) for f in schema.fields),
                       StructField(ERROR, StringType(), True),
                       *(StructField(name, typ, True) for name, typ in SOURCE_TYPES.items())])


def parse(raw: DataFrame, schema: StructType, required: Sequence[str] = (), *,
          keep_source: bool = False, carry: Sequence[str] = ()) -> DataFrame:
    """Event fields, then ``_error`` (null for a good event), then the Kafka ``_key``, ``_value``, ...

    ``_key`` (the output key), ``_topic``, ``_partition`` and ``_offset`` (where a dead letter made
    by the sink comes from) are kept in every row; ``_value`` only in rows with ``_error`` set (the
    dead letters), null otherwise, unless ``keep_source`` (a later step may still make a row a dead
    letter: the state step). ``carry``: columns of ``raw`` passed through, last."""
    parsed = raw.select(*[F.col(src).alias(dst) for dst, src in SOURCE.items()], _from_json(schema).alias("_e"),
                        *carry)
    checked = parsed.select(*[F.col(f"_e.`{n}`").alias(n) for n in schema.fieldNames()],
                            _error(schema, required).alias(ERROR), *SOURCE, *carry)
    if keep_source:
        return checked
    assert not carry
    return _dead_letter_bytes_only(checked, schema)


def _from_json(schema: StructType) -> Column:
    with_corrupt = StructType([*schema.fields, StructField(CORRUPT, StringType(), True)])
    return F.from_json(F.col("_value").cast("string"), with_corrupt,
                       {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT})


def _error(schema: StructType, required: Sequence[str]) -> Column:
    """Why the event in ``_e`` (``from_json`` of ``_value``) is a dead letter, null when it is not."""
    error: Column = (
        F.when(F.col("_value").isNull(), F.lit("event has no value"))
        .when(F.col("_e").isNull(), F.lit("event value is empty"))
        .when(F.col(f"_e.{CORRUPT}").isNotNull(),
              F.lit(f"event is not valid JSON or does not fit the schema: {schema.simpleString()}")))
    for name in required:
        error = error.when(F.col(f"_e.`{name}`").isNull(), F.lit(f"required field {name} is null"))
    return error


def _dead_letter_bytes_only(checked: DataFrame, schema: StructType) -> DataFrame:
    # Only dead letters need the original bytes: null them in good rows so that they do not travel
    # through the join's Arrow round trip (about half of every row's bytes).
    bad = F.col(ERROR).isNotNull()
    return checked.select(*[F.col(f"`{n}`") for n in schema.fieldNames()], ERROR,
                          *[F.when(bad, F.col(c)).alias(c) if c == "_value" else F.col(c) for c in SOURCE])


def source_columns(raw: DataFrame) -> DataFrame:
    """The Kafka columns under their internal names: the input of the fast path's ``mapInArrow``."""
    return raw.select(*[F.col(src).alias(dst) for dst, src in SOURCE.items()])


def fast_schema(parsed: StructType) -> StructType:
    """The schema the fast path's parse step gives: :func:`parse`'s, plus the ``_slow`` flag."""
    return StructType([*parsed.fields, StructField(SLOW, BooleanType(), False)])


@dataclass(frozen=True)
class FastEvents:
    """The parse step of the fast path (``enrich.events.fastparse``), run in the join's ``mapInArrow``:
    Kafka columns in, :func:`fast_schema` rows out (``schema``, as Arrow): the event fields, a null
    ``_error``, the Kafka columns (``_value`` of the slow rows only) and ``_slow``. A slow row's
    fields are null: it must be parsed by :func:`parse` (``from_json``) instead."""

    parser: FastParser
    schema: pa.Schema

    def __call__(self, b: pa.RecordBatch) -> pa.Table:
        fields, slow = self.parser.parse(b.column("_value"))
        n = b.num_rows
        mask = pa.array(slow)
        cols = [*fields.columns, pa.nulls(n, pa.string()), b.column("_key")]
        for name in [c for c in SOURCE if c != "_key"]:
            col = b.column(name)
            if name != "_value":  # positions are small: kept, a too-large event's dead letter names them
                cols.append(col)
            else:  # the raw event is kept for the slow rows only
                cols.append(pc.if_else(mask, col, pa.nulls(n, col.type)) if slow.any() else pa.nulls(n, col.type))
        cols.append(mask)
        return pa.Table.from_arrays(cols, schema=pa.schema(
            [pa.field(f.name, c.type) for f, c in zip(self.schema, cols, strict=True)])).cast(self.schema)

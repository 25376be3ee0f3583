"""Device events: Kafka records parsed with Spark's ``from_json`` against the configured DDL.

A record that is not valid JSON, does not fit the schema (PERMISSIVE mode with a corrupt-record
column), has no value or a null in a required field keeps flowing with ``_error`` set, so the sink
sends it to the dead-letter topic instead of dropping it or stopping the job.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, StringType, StructField, StructType

from refstream.compat import CompatError, spark_ddl_type
from refstream.errors import ConfigError

ERROR = "_error"
CORRUPT = "_corrupt_record"
#: Set by the fast parser (``enrich.fastparse``) on events it leaves to Spark's ``from_json``.
SLOW = "_slow"
#: Kafka columns carried along for the dead-letter topic and the output key.
SOURCE = {"_key": "key", "_value": "value", "_topic": "topic", "_partition": "partition", "_offset": "offset"}
INTERNAL = (ERROR, *SOURCE, SLOW)


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


def parse(raw: DataFrame, schema: StructType, required: Sequence[str] = (), *,
          keep_source: bool = False) -> DataFrame:
    """Event fields, then ``_error`` (null for a good event), then the Kafka ``_key``, ``_value``, ...

    ``_key`` (the output key), ``_topic``, ``_partition`` and ``_offset`` (where a dead letter made
    by the sink comes from) are kept in every row; ``_value`` only in rows with ``_error`` set (the
    dead letters), null otherwise, unless ``keep_source``."""
    with_corrupt = StructType([*schema.fields, StructField(CORRUPT, StringType(), True)])
    parsed = raw.select(
        *[F.col(src).alias(dst) for dst, src in SOURCE.items()],
        F.from_json(F.col("value").cast("string"), with_corrupt,
                    {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT}).alias("_e"))
    error: Column = (
        F.when(F.col("_value").isNull(), F.lit("event has no value"))
        .when(F.col("_e").isNull(), F.lit("event value is empty"))
        .when(F.col(f"_e.{CORRUPT}").isNotNull(),
              F.lit(f"event is not valid JSON or does not fit the schema: {schema.simpleString()}")))
    for name in required:
        error = error.when(F.col(f"_e.`{name}`").isNull(), F.lit(f"required field {name} is null"))
    checked = parsed.select(*[F.col(f"_e.`{n}`").alias(n) for n in schema.fieldNames()],
                            error.alias(ERROR), *SOURCE)
    # Only dead letters need the original bytes: null them in good rows so that they do not travel
    # through the join's Arrow round trip (about half of every row's bytes).
    if keep_source:
        return checked.select(*[F.col(f"`{n}`") for n in schema.fieldNames()], ERROR, *SOURCE)
    bad = F.col(ERROR).isNotNull()
    return checked.select(*[F.col(f"`{n}`") for n in schema.fieldNames()], ERROR,
                          *[F.when(bad, F.col(c)).alias(c) if c == "_value" else F.col(c) for c in SOURCE])


def source_columns(raw: DataFrame) -> DataFrame:
    """The Kafka columns under their internal names: the input of the fast path's ``mapInArrow``."""
    return raw.select(*[F.col(src).alias(dst) for dst, src in SOURCE.items()])


def fast_schema(parsed: StructType) -> StructType:
    """The schema the fast path's parse step gives: :func:`parse`'s, plus the ``_slow`` flag."""
    return StructType([*parsed.fields, StructField(SLOW, BooleanType(), False)])

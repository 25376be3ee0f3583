"""The keyed state step in the streaming plan, and the checkpoint's record of its settings.

:func:`attach` turns the parsed event stream (``enrich.events.parse``) into the same columns plus
``state`` and ``_late``, through ``transformWithStateInPandas`` keyed by ``hash(key) % buckets``
(:mod:`enrich.state.processor`), the events packed on their way through it
(:mod:`enrich.state.packed`). Events with a null key or time get ``_error`` set (the sink sends
them to the dead-letter topic). Spark's watermark is taken on a column that is dropped before the
step (each packed chunk's greatest event time): Spark would otherwise drop late rows silently in
front of the processor; the processor flags late events instead, against the same watermark.
"""

from __future__ import annotations

import functools

from pyspark.accumulators import Accumulator
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import BinaryType, BooleanType, IntegerType, StructField, StructType, TimestampType

from enrich import events
from enrich.config import EnrichConfig, StateConfig
from enrich.events import ERROR
from enrich.state import packed
from enrich.state.checkpoint import check_checkpoint
from enrich.state.engine import StateSpec
from enrich.state.packed import MAX_TS, ROWS
from enrich.state.plan import LATE, STATE, resolve
from enrich.state.processor import BUCKET, FLAT, TS_US, DeviceStateProcessor, stored_spec
from refstream.errors import ConfigError

#: Spark's state store provider for the step (set by the job; ``transformWithStateInPandas`` needs it).
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
PROVIDER_CONF = "spark.sql.streaming.stateStore.providerClass"


def state_step(spark: SparkSession, cfg: EnrichConfig, raw: DataFrame, event_schema: StructType,
               enriched: StructType, timezone: str,
               devices: Accumulator[dict[int, int]] | None = None) -> DataFrame:
    """The job's hook: check ``state:`` against the events and the joins' columns (``enriched``) and
    the checkpoint, set the RocksDB state store, and return the ``raw`` Kafka stream parsed and
    through :func:`attach` (``devices``: see there)."""
    assert cfg.state is not None
    parsed = events.parse(raw, event_schema, cfg.events.required, keep_source=True)
    spec = resolve(cfg.state, enriched, timezone=timezone, source=cfg.source)
    for name in cfg.state.columns:
        if name not in parsed.columns:
            where = "key" if name == cfg.state.key else f"aggregates.{name}"
            raise ConfigError(f"{cfg.source}: state.{where}: {name!r} is added by a join; the state step runs "
                              "before the joins, so it can use event fields only for now (docs/state.md)")
    check_checkpoint(cfg.checkpoint, cfg.state, spec, cfg.source)
    spark.conf.set(PROVIDER_CONF, ROCKSDB)
    return attach(parsed, cfg.state, spec, devices, timezone=timezone)


def bucket_of(key: Column, buckets: int) -> Column:
    """The hash bucket a device key falls in: the grouping key of the state step."""
    return F.pmod(F.hash(key), F.lit(buckets)).cast("int")


def attach(parsed: DataFrame, cfg: StateConfig, spec: StateSpec,
           devices: Accumulator[dict[int, int]] | None = None, *, timezone: str = "UTC") -> DataFrame:
    """``parsed`` (``events.parse(..., keep_source=True)``) with the keyed state step applied: its
    columns, then ``state`` and ``_late``; ``_value`` is kept in dead-letter rows only, as
    ``events.parse`` does. Rows travel through the step packed (:mod:`enrich.state.packed`).
    ``devices``: an accumulator of ``processor.BucketCounts`` the step reports each bucket's device
    count to."""
    columns = tuple(parsed.columns)
    key, ts = F.col(f"`{cfg.key}`"), F.col(f"`{cfg.timestamp}`")
    error = (F.when(F.col(ERROR).isNotNull(), F.col(ERROR))
             .when(key.isNull(), F.lit(f"state.key {cfg.key} is null"))
             .when(ts.isNull(), F.lit(f"state.timestamp {cfg.timestamp} is null")))
    prepared = (parsed.withColumn(ERROR, error)
                .withColumn("_value", F.when(F.col(ERROR).isNotNull(), F.col("_value")))
                .withColumn(TS_US, F.unix_micros(ts))
                .withColumn(BUCKET, bucket_of(key, cfg.buckets)))
    packed_spark = StructType([StructField(BUCKET, IntegerType(), False), StructField(MAX_TS, TimestampType(), True),
                               StructField(ROWS, BinaryType(), False)])
    packed_arrow = to_arrow_schema(packed_spark, timezone=timezone)
    # Spark's watermark is taken on each chunk's greatest event time and the column dropped before
    # the step, so that Spark drops no row in front of the processor (see the module doc).
    rows = (prepared.mapInArrow(functools.partial(packed.pack, bucket=BUCKET, timestamp=TS_US,
                                                  packed_schema=packed_arrow), packed_spark)
            .withWatermark(MAX_TS, f"{int(cfg.watermark.total_seconds() * 1000)} milliseconds")
            .drop(MAX_TS))
    inner = stored_spec(spec)
    processor = DeviceStateProcessor(inner, columns, devices)
    flat_type = inner.output_type()
    in_schema = {f.name: f.dataType for f in prepared.schema.fields}
    out_schema = StructType([StructField(c, in_schema[c], True) for c in columns]
                            + [StructField(FLAT + f.name, from_arrow_type(f.type), True) for f in flat_type]
                            + [StructField(LATE, BooleanType(), True)])
    stepped = rows.groupBy(BUCKET).transformWithStateInPandas(
        processor, outputStructType=StructType([StructField(ROWS, BinaryType(), False)]), outputMode="Append",
        timeMode="EventTime")
    unpacked = stepped.mapInArrow(functools.partial(packed.unpack, schema=to_arrow_schema(out_schema, timezone=timezone)),
                                  out_schema)
    fields = []
    for f in flat_type:
        col = F.col(f"`{FLAT}{f.name}`")
        fields.append((F.timestamp_micros(col) if f.name in ("first_seen", "last_seen") else col).alias(f.name))
    state = F.when(F.col(f"`{FLAT}events`").isNotNull(), F.struct(*fields))
    return unpacked.select(*[F.col(f"`{c}`") for c in columns], state.alias(STATE),
                           F.coalesce(F.col(LATE), F.lit(False)).alias(LATE))

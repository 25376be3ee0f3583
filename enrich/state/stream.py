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

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import pyarrow as pa
from pyspark.accumulators import Accumulator
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    IntegerType,
    StructField,
    StructType,
    TimestampType,
)

from enrich import events, join
from enrich.config import EnrichConfig, JoinConfig, StateConfig
from enrich.events import ERROR, FastEvents
from enrich.fastparse import FastParser
from enrich.kafka import read_stream
from enrich.state import ingest, packed
from enrich.state.checkpoint import check_checkpoint
from enrich.state.dimension import PartitionedDim, partitioned_dim
from enrich.state.engine import StateSpec
from enrich.state.ingest import EventPacker
from enrich.state.packed import MAX_TS, ROWS
from enrich.state.plan import LATE, STATE, resolve
from enrich.state.processor import BUCKET, FLAT, DeviceStateProcessor, stored_spec
from refstream import contract
from refstream.contract import DatasetSchema
from refstream.errors import ConfigError

#: Spark's state store provider for the step (set by the job; ``transformWithStateInPandas`` needs it).
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
PROVIDER_CONF = "spark.sql.streaming.stateStore.providerClass"
#: RocksDB's changelog checkpointing (off in Spark by default): a batch's commit writes the changed
#: values to a changelog file instead of flushing RocksDB and copying its new SST files to the
#: checkpoint; snapshots are made in the background every ``minDeltasForSnapshot`` batches. Every
#: batch at 1M devices rewrites every bucket (docs/benchmarks.md), so this is most of a commit. Spark
#: reads existing checkpoints either way; a user's own setting is kept.
CHANGELOG_CONF = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"

CHANGELOG_DEFAULT = "true"  # the job's setting when the user has none


def state_step(spark: SparkSession, cfg: EnrichConfig, raw: DataFrame, event_schema: StructType,
               enriched: StructType, timezone: str,
               devices: Accumulator[dict[int, int]] | None = None,
               schemas: Mapping[str, DatasetSchema] | None = None,
               before: Sequence[JoinConfig] = (), parser: FastParser | None = None) -> DataFrame:
    """The job's hook: check ``state:`` against the events and the joins' columns (``enriched``) and
    the checkpoint, set the RocksDB state store, and return the ``raw`` Kafka stream parsed (by
    ``parser`` where it can, see :mod:`enrich.state.ingest`), joined with the broadcast joins in
    ``before`` (whose tasks read their versions as ``enrich.join.PlanEnricher`` does) and through
    :func:`attach` (``devices``: see there), with the partitioned joins inside the step
    (``schemas``: the published schemas of both kinds' datasets)."""
    assert cfg.state is not None
    schemas = schemas or {}
    joined = events.parse(raw, event_schema, cfg.events.required, keep_source=True).schema
    spec = resolve(cfg.state, enriched, timezone=timezone, source=cfg.source)
    inner: list[str] = []
    specs: list[join.JoinSpec] = []
    if before:
        # Each of these needs its on: columns from the events: a column of a partitioned join (added
        # inside the step) or of a join left in foreachBatch is named by the plan's error.
        specs, joined = join.plan(before, schemas, joined, timezone=timezone, source=cfg.source)
        inner = [s.matched for s in specs if s.inner]
        # An inner join drops its unmatched events after the state counted them, as it does after the step.
        specs = [dataclasses.replace(s, inner=False) for s in specs]
    dims = partitioned_dims(cfg, joined, schemas, timezone)
    inside = set(joined.fieldNames()) | {out for d in dims for _, out in d.join.columns}
    for name in cfg.state.columns:
        if name not in inside:
            where = "key" if name == cfg.state.key else f"aggregates.{name}"
            raise ConfigError(f"{cfg.source}: state.{where}: {name!r} comes from a join that cannot run before "
                              "the state step (docs/state.md)")
    check_checkpoint(cfg.checkpoint, cfg.state, spec, cfg.source, dims)
    spark.conf.set(PROVIDER_CONF, ROCKSDB)
    if spark.conf.get(CHANGELOG_CONF, None) is None:
        spark.conf.set(CHANGELOG_CONF, CHANGELOG_DEFAULT)
    changelogs = [read_stream(spark, cfg.kafka, [d.topic], starting_offsets="earliest") for d in dims]
    out = attach(raw, event_schema, cfg.state, spec, devices, required=cfg.events.required, timezone=timezone,
                 dims=tuple(zip(dims, changelogs, strict=True)), joins=tuple(specs), joined=joined, parser=parser)
    for matched in inner:
        out = out.where(F.col(f"`{matched}`") | F.col(ERROR).isNotNull())
    return out


def partitioned_dims(cfg: EnrichConfig, parsed: StructType, schemas: Mapping[str, DatasetSchema],
                     timezone: str) -> list[PartitionedDim]:
    """The partitioned joins planned against the parsed events, in configured order."""
    joins = cfg.partitioned_joins
    if not joins:
        return []
    specs, _ = join.plan(joins, schemas, parsed, timezone=timezone, source=cfg.source)
    return [partitioned_dim(i, j.dataset, j.topic, schemas[j.dataset], dataclasses.replace(s, inner=False), s.inner)
            for i, (j, s) in enumerate(zip(joins, specs, strict=True))]


def bucket_of(key: Column, buckets: int) -> Column:
    """The hash bucket a device key falls in: the grouping key of the state step."""
    return F.pmod(F.hash(key), F.lit(buckets)).cast("int")


def attach(raw: DataFrame, event_schema: StructType, cfg: StateConfig, spec: StateSpec,
           devices: Accumulator[dict[int, int]] | None = None, *, required: Sequence[str] = (),
           timezone: str = "UTC", dims: tuple[tuple[PartitionedDim, DataFrame], ...] = (),
           joins: tuple[join.JoinSpec, ...] = (), joined: StructType | None = None,
           parser: FastParser | None = None) -> DataFrame:
    """The Kafka stream ``raw`` parsed against ``event_schema`` (``enrich.events.parse``'s columns,
    ``_value`` in dead letters only), joined in the plan by ``joins`` (their output: ``joined``),
    with the keyed state step applied: those columns, the partitioned joins' columns, then ``state``
    and ``_late``. Rows travel to the step parsed and packed (:mod:`enrich.state.ingest`, with the
    fast ``parser`` if given) and through it packed (:mod:`enrich.state.packed`). ``devices``: an
    accumulator of ``processor.BucketCounts`` the step reports each bucket's device count to.
    ``dims``: each partitioned dimension with its changelog stream (``enrich.kafka.read_stream``),
    unioned with the events by bucket."""
    if joined is None:
        joined = events.parse(raw, event_schema, required, keep_source=True).schema
    columns = tuple(joined.fieldNames())
    packed_spark = StructType([StructField(BUCKET, IntegerType(), False), StructField(MAX_TS, TimestampType(), True),
                               StructField(ROWS, BinaryType(), False)])
    packed_arrow = to_arrow_schema(packed_spark, timezone=timezone)
    # Spark's watermark is taken on each chunk's greatest event time and the column dropped before
    # the step, so that Spark drops no row in front of the processor (see the module doc).
    rows = (_packed_events(raw, event_schema, required, cfg, joins, joined, parser, timezone, packed_spark)
            .withWatermark(MAX_TS, f"{int(cfg.watermark.total_seconds() * 1000)} milliseconds")
            .drop(MAX_TS))
    key_type = joined[cfg.key].dataType
    for dim, changelog in dims:
        rows = rows.union(_changelog_rows(changelog, dim, key_type, cfg.buckets, packed_spark, packed_arrow))
    inner = stored_spec(spec)
    processor = DeviceStateProcessor(inner, columns, devices, tuple(d for d, _ in dims))
    flat_type = inner.output_type()
    in_schema = {f.name: f.dataType for f in joined.fields}
    dim_fields: list[StructField] = []
    for dim, _ in dims:
        dim_fields += [StructField(out, from_arrow_type(t), True)
                   for (_, out), t in zip(dim.join.columns, dim.join.out_types, strict=True)]
        dim_fields.append(StructField(dim.join.matched, BooleanType(), True))
    out_schema = StructType([StructField(c, in_schema[c], True) for c in columns] + dim_fields
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
    return unpacked.select(*[F.col(f"`{c}`") for c in columns], *[F.col(f"`{f.name}`") for f in dim_fields],
                           state.alias(STATE), F.coalesce(F.col(LATE), F.lit(False)).alias(LATE))


def _packed_events(raw: DataFrame, event_schema: StructType, required: Sequence[str], cfg: StateConfig,
                   joins: tuple[join.JoinSpec, ...], joined: StructType, parser: FastParser | None, timezone: str,
                   packed_spark: StructType) -> DataFrame:
    """The events of ``raw`` packed for the step by :class:`enrich.state.ingest.EventPacker`: the fast
    pass (with a ``parser``), ``from_json`` in the plan for what it leaves, then the rest pass."""
    def packer(out: StructType, parse: FastEvents | None) -> EventPacker:
        return EventPacker(cfg.key, cfg.timestamp, cfg.buckets,
                           ingest.events_schema(to_arrow_schema(joined, timezone=timezone)),
                           to_arrow_schema(out, timezone=timezone), joins, parse)

    rest_input, carry = raw, ()
    if parser is not None:
        first = StructType([StructField(BUCKET, IntegerType(), True), StructField(MAX_TS, TimestampType(), True),
                            StructField(ROWS, BinaryType(), True),
                            *[StructField(c, raw.schema[c].dataType, True) for c in ingest.RAW]])
        parsed = events.parse(raw, event_schema, required, keep_source=True).schema
        fast = FastEvents(parser, to_arrow_schema(events.fast_schema(parsed), timezone=timezone))
        rest_input = events.source_columns(raw).mapInArrow(packer(first, fast), first)
        carry = (BUCKET, MAX_TS, ROWS)  # type: ignore[assignment]
    parsed_rest = events.parse(rest_input, event_schema, required, keep_source=True, carry=carry)
    return parsed_rest.mapInArrow(packer(packed_spark, None), packed_spark)


def _changelog_rows(changelog: DataFrame, dim: PartitionedDim, key_type: DataType, buckets: int,
                    packed_spark: StructType, packed_arrow: pa.Schema) -> DataFrame:
    """A partitioned dimension's changelog stream packed like the events: each record in the bucket
    of its key (read from the key's JSON and cast to the event key's type, so it hashes as the
    events do), a schema record in every bucket, no heartbeat."""
    name = [k for _, k in dim.join.pairs][0].replace("'", "\\'")
    key = F.get_json_object(F.col("key").cast("string"), f"$['{name}']").cast(key_type)
    schema_record = F.col("key") == F.lit(contract.SCHEMA_KEY)
    targets = F.when(schema_record, F.sequence(F.lit(0), F.lit(buckets - 1))).otherwise(
        F.array(bucket_of(key, buckets)))
    records = (changelog.where(F.col("key") != F.lit(contract.HEARTBEAT_KEY))
               .select(F.explode(targets).alias(BUCKET), "partition", "offset", "key", "value"))
    return (records.mapInArrow(functools.partial(packed.pack, bucket=BUCKET, timestamp=None,
                                                 packed_schema=packed_arrow, kind=dim.kind), packed_spark)
            .drop(MAX_TS))

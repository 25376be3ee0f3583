"""The keyed state step in the streaming plan, and the checkpoint's record of its settings.

:func:`attach` turns the Kafka event stream into the parsed events' columns plus ``state`` and
``_late``, through ``transformWithStateInPandas`` keyed by the bucket of ``pmod(hash(key), buckets)``
(its grouping key spread evenly over the state partitions: :mod:`enrich.state.layout`;
:mod:`enrich.state.processor`). The events are parsed, checked and packed on their way in
(:mod:`enrich.state.ingest`) and stay packed through the step (:mod:`enrich.state.packed`): the
stream :func:`attach` returns is the step's packed rows, and :class:`Unpack` turns them into
events in the job's join pass. Events with a null key or time get ``_error`` set (the sink sends
them to the dead-letter topic). Spark's watermark is taken on a column that is dropped before the
step (each packed chunk's greatest event time): Spark would otherwise drop late rows silently in
front of the processor; the processor flags late events instead, against the same watermark.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.accumulators import Accumulator
from pyspark.sql import DataFrame, SparkSession
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
from enrich.session import SHUFFLE_PARTITIONS
from enrich.state import ingest, packed
from enrich.state.cache import TableCache
from enrich.state.checkpoint import check_checkpoint
from enrich.state.dimension import PartitionedDim, partitioned_dim
from enrich.state.engine import StateSpec
from enrich.state.ingest import EventPacker
from enrich.state.layout import BucketLayout
from enrich.state.packed import MAX_TS, ROWS
from enrich.state.plan import LATE, STATE, output_fields, resolve
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
               before: Sequence[JoinConfig] = (), parser: FastParser | None = None) -> StateStream:
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
    # A new checkpoint's state partitions: Spark keeps this number in the offset log at its first batch.
    layout = check_checkpoint(cfg.checkpoint, cfg.state, spec, cfg.source, dims,
                              partitions=int(spark.conf.get(SHUFFLE_PARTITIONS) or "200"))
    assert layout is not None
    spark.conf.set(PROVIDER_CONF, ROCKSDB)
    if spark.conf.get(CHANGELOG_CONF, None) is None:
        spark.conf.set(CHANGELOG_CONF, CHANGELOG_DEFAULT)
    changelogs = [read_stream(spark, cfg.kafka, [d.topic], starting_offsets="earliest") for d in dims]
    return attach(raw, event_schema, cfg.state, spec, devices, required=cfg.events.required, timezone=timezone,
                  dims=tuple(zip(dims, changelogs, strict=True)), joins=tuple(specs), joined=joined, parser=parser,
                  inner_joins=tuple(inner), cache=TableCache(uuid.uuid4().hex), layout=layout)


def partitioned_dims(cfg: EnrichConfig, parsed: StructType, schemas: Mapping[str, DatasetSchema],
                     timezone: str) -> list[PartitionedDim]:
    """The partitioned joins planned against the parsed events, in configured order."""
    joins = cfg.partitioned_joins
    if not joins:
        return []
    specs, _ = join.plan(joins, schemas, parsed, timezone=timezone, source=cfg.source)
    return [partitioned_dim(i, j.dataset, j.topic, schemas[j.dataset], dataclasses.replace(s, inner=False), s.inner)
            for i, (j, s) in enumerate(zip(joins, specs, strict=True))]


def attach(raw: DataFrame, event_schema: StructType, cfg: StateConfig, spec: StateSpec,
           devices: Accumulator[dict[int, int]] | None = None, *, required: Sequence[str] = (),
           timezone: str = "UTC", dims: tuple[tuple[PartitionedDim, DataFrame], ...] = (),
           joins: tuple[join.JoinSpec, ...] = (), joined: StructType | None = None,
           parser: FastParser | None = None, inner_joins: tuple[str, ...] = (),
           cache: TableCache | None = None, layout: BucketLayout | None = None) -> StateStream:
    """The Kafka stream ``raw`` parsed against ``event_schema`` (``enrich.events.parse``'s columns,
    ``_value`` in dead letters only), joined in the plan by ``joins`` (their output: ``joined``),
    with the keyed state step applied: those columns, the partitioned joins' columns, then ``state``
    and ``_late`` (:class:`StateStream`); ``inner_joins``: the ``matched`` columns of the in-plan
    joins that are inner (their unmatched events are dropped after the step counted them). Rows
    travel to the step parsed and packed (:mod:`enrich.state.ingest`, with the fast ``parser`` if
    given) and through it packed (:mod:`enrich.state.packed`). ``devices``: an
    accumulator of ``processor.BucketCounts`` the step reports each bucket's device count to.
    ``dims``: each partitioned dimension with its changelog stream (``enrich.kafka.read_stream``),
    unioned with the events by bucket. ``cache``: where the executors keep a copy of the bucket
    tables they store (:mod:`enrich.state.cache`; None: none). ``layout``: the buckets' grouping keys
    (default: the plain layout of ``cfg.buckets``)."""
    layout = layout or BucketLayout.plain(cfg.buckets)
    if joined is None:
        joined = events.parse(raw, event_schema, required, keep_source=True).schema
    columns = tuple(joined.fieldNames())
    packed_spark = StructType([StructField(BUCKET, IntegerType(), False), StructField(MAX_TS, TimestampType(), True),
                               StructField(ROWS, BinaryType(), False)])
    packed_arrow = to_arrow_schema(packed_spark, timezone=timezone)
    # Spark's watermark is taken on each chunk's greatest event time and the column dropped before
    # the step, so that Spark drops no row in front of the processor (see the module doc).
    rows = (_packed_events(raw, event_schema, required, cfg, joins, joined, parser, timezone, packed_spark, layout)
            .withWatermark(MAX_TS, f"{int(cfg.watermark.total_seconds() * 1000)} milliseconds")
            .drop(MAX_TS))
    key_type = joined[cfg.key].dataType
    for dim, changelog in dims:
        rows = rows.union(_changelog_rows(changelog, dim, key_type, layout, packed_spark, packed_arrow))
    inner = stored_spec(spec)
    processor = DeviceStateProcessor(inner, columns, devices, tuple(d for d, _ in dims), cache)
    in_schema = {f.name: f.dataType for f in joined.fields}
    dim_fields: list[StructField] = []
    for dim, _ in dims:
        dim_fields += [StructField(out, from_arrow_type(t), True)
                       for (_, out), t in zip(dim.join.columns, dim.join.out_types, strict=True)]
        dim_fields.append(StructField(dim.join.matched, BooleanType(), True))
    passed = [StructField(c, in_schema[c], True) for c in columns] + dim_fields
    flat_type = inner.output_type()
    # What the processor's packed tables hold: the passed columns, the flat state fields, the late flag.
    flat_schema = StructType(passed + [StructField(FLAT + f.name, from_arrow_type(f.type), True) for f in flat_type]
                             + [StructField(LATE, BooleanType(), True)])
    schema = StructType(passed + output_fields(spec))
    stepped = rows.groupBy(BUCKET).transformWithStateInPandas(
        processor, outputStructType=StructType([StructField(ROWS, BinaryType(), False)]), outputMode="Append",
        timeMode="EventTime")
    unpack = Unpack(to_arrow_schema(flat_schema, timezone=timezone), to_arrow_schema(schema, timezone=timezone),
                    tuple(f.name for f in passed), inner_joins)
    return StateStream(stepped, unpack, schema, cache)


@dataclass(frozen=True)
class StateStream:
    """The state step's output: ``packed`` is the streaming DataFrame of the step's packed rows;
    ``unpack`` turns one Arrow batch of them into events of ``schema`` (the events' and the
    partitioned joins' columns, ``state``, ``_late``). The job unpacks them in its join pass
    (``enrich.join.enrich``'s ``first`` step), so the events cross from Python to the JVM once.
    ``cache``: the executors' copies of the bucket tables; the job removes its directory at stop."""

    packed: DataFrame
    unpack: Unpack
    schema: StructType
    cache: TableCache | None = None

    def frame(self, df: DataFrame | None = None) -> DataFrame:
        """``df`` (default: the stream), packed rows of the step, unpacked in a ``mapInArrow`` pass."""
        return (self.packed if df is None else df).mapInArrow(self.unpack.batches, self.schema)


@dataclass(frozen=True)
class Unpack:
    """Packed rows of the step (``rows``) to events: the processor's tables read as ``flat`` (the
    passed columns, ``_state_<field>`` with times in microseconds, ``_late``), the state fields
    folded into the ``state`` struct (null where the event has no state: late, or a dead letter),
    ``_late`` false where null, as ``out``; without the events an in-plan inner join did not match
    (its ``matched`` columns in ``inner``; dead letters always go on). Picklable."""

    flat: pa.Schema
    out: pa.Schema
    passed: tuple[str, ...]
    inner: tuple[str, ...] = ()

    def __call__(self, batch: pa.RecordBatch) -> pa.Table:
        rows = list(packed.unpack([batch], self.flat))
        if not rows:
            return self.out.empty_table()
        t = pa.Table.from_batches(rows, schema=self.flat)
        state_type = self.out.field(STATE).type
        children = []
        for f in state_type:
            col = t.column(FLAT + f.name).combine_chunks()
            children.append(col if col.type == f.type else col.cast(f.type))
        state = pa.StructArray.from_arrays(children, fields=list(state_type),
                                           mask=pc.is_null(t.column(FLAT + "events")).combine_chunks())
        late = pc.fill_null(t.column(LATE), False)
        out = pa.Table.from_arrays([*(t.column(c) for c in self.passed), state, late], schema=self.out)
        if self.inner:
            keep = pc.is_valid(out.column(ERROR))
            matched = [pc.fill_null(out.column(m), False) for m in self.inner]
            keep = pc.or_(keep, functools.reduce(pc.and_, matched))
            out = out.filter(keep)
        return out

    def batches(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The ``mapInArrow`` function of :meth:`StateStream.frame`."""
        for b in batches:
            yield from self(b).to_batches()


def _packed_events(raw: DataFrame, event_schema: StructType, required: Sequence[str], cfg: StateConfig,
                   joins: tuple[join.JoinSpec, ...], joined: StructType, parser: FastParser | None, timezone: str,
                   packed_spark: StructType, layout: BucketLayout) -> DataFrame:
    """The events of ``raw`` packed for the step by :class:`enrich.state.ingest.EventPacker`: the fast
    pass (with a ``parser``), ``from_json`` in the plan for what it leaves, then the rest pass."""
    def packer(out: StructType, parse: FastEvents | None) -> EventPacker:
        return EventPacker(cfg.key, cfg.timestamp, layout,
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


def _changelog_rows(changelog: DataFrame, dim: PartitionedDim, key_type: DataType, layout: BucketLayout,
                    packed_spark: StructType, packed_arrow: pa.Schema) -> DataFrame:
    """A partitioned dimension's changelog stream packed like the events: each record in the bucket
    of its key (read from the key's JSON and cast to the event key's type, so it hashes as the
    events do), a schema record in every bucket, no heartbeat."""
    name = [k for _, k in dim.join.pairs][0].replace("'", "\\'")
    key = F.get_json_object(F.col("key").cast("string"), f"$['{name}']").cast(key_type)
    schema_record = F.col("key") == F.lit(contract.SCHEMA_KEY)
    targets = F.when(schema_record, layout.all()).otherwise(F.array(layout.column(key)))
    records = (changelog.where(F.col("key") != F.lit(contract.HEARTBEAT_KEY))
               .select(F.explode(targets).alias(BUCKET), "partition", "offset", "key", "value"))
    return (records.mapInArrow(functools.partial(packed.pack, bucket=BUCKET, timestamp=None,
                                                 packed_schema=packed_arrow, kind=dim.kind), packed_spark)
            .drop(MAX_TS))

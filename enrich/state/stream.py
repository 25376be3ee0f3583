"""The keyed state step in the streaming plan, and the checkpoint's record of its settings.

:func:`attach` turns the Kafka event stream into the parsed events' columns plus ``state`` and
``_late``, through ``transformWithStateInPandas`` keyed by the bucket of ``pmod(hash(key), buckets)``
(its grouping key spread evenly over the state partitions: :mod:`enrich.state.layout`;
:mod:`enrich.state.processor`). The events are parsed, checked and packed on their way in
(:mod:`enrich.state.ingest`) and stay packed through the step (:mod:`enrich.state.packed`): the
stream :func:`attach` returns is the step's packed rows, and :class:`Unpack` turns them into
events in the job's join pass. Events with a null key or time, or more than
``state.max_future_skew`` ahead of the batch's time, get ``_error`` set (the sink sends them to the
dead-letter topic). Spark's watermark is taken on a column that is dropped before the step (each
packed chunk's greatest event time, dead letters left out): Spark would otherwise drop late rows
silently in front of the processor; the processor flags late events instead, against the same
watermark.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.accumulators import Accumulator
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DataType,
    IntegerType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from enrich import events
from enrich.columns import BATCH_TIME, BUCKET, ERROR, FLAT, LATE, MAX_TS, ROWS, STATE
from enrich.events import FastEvents
from enrich.events.fastparse import FastParser
from enrich.ipc import to_ipc
from enrich.pipeline import Pipeline
from enrich.session import SHUFFLE_PARTITIONS
from enrich.source import read_stream
from enrich.source.tick import tick_stream
from enrich.state import engine, ingest, packed
from enrich.state.cache import TableCache
from enrich.state.checkpoint import check_checkpoint
from enrich.state.dimension import PUBLISHED, VALID_FROM_TEXT, PartitionedDim
from enrich.state.ingest import EventPacker
from enrich.state.layout import BucketLayout
from enrich.state.processor import DeviceStateProcessor
from enrich.state.stored import STATE_NAME, stored_spec
from enrich.state.wait import WaitSpec
from refstream import contract
from refstream.errors import ConfigError

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Fork:
    """A new checkpoint's start from a savepoint (:mod:`enrich.ops.savepoint`): ``devices`` the
    devices as rows of the stored layout (:func:`enrich.state.stored.stored_spec`), ``dims`` each
    partitioned dimension's rows and published schema (JSON) by state name, all read by Spark;
    ``changelogs`` the Spark starting offsets of their changelog topics (a topic missing: from the
    earliest), and ``floor_us`` the savepoint job's watermark (event time, microseconds; None: it had none)."""

    devices: DataFrame
    dims: Mapping[str, tuple[DataFrame, bytes]]
    changelogs: Mapping[str, str]
    floor_us: int | None


def state_step(spark: SparkSession, pipeline: Pipeline, raw: DataFrame,
               devices: Accumulator[dict[int, int]] | None = None, parser: FastParser | None = None,
               fork: Fork | None = None,
               call_counts: Accumulator[dict[int, dict[str, Any]]] | None = None, *,
               floor_us: int | None = None) -> StateStream:
    """The job's hook: check the pipeline's state step against the checkpoint (a start on a rescale
    that did not finish is refused; a warning when the config's ``spark.sql.shuffle.partitions`` is
    not the number the checkpoint runs with, or the buckets spread unevenly over it), set the
    RocksDB state store, and return the ``raw`` Kafka stream through :func:`attach` (``devices``,
    ``parser``: see there), the partitioned dimensions' changelogs read as streams beside it; with
    a ``fork``, the step starts from its state, changelog offsets and watermark; ``floor_us``: the
    watermark floor of a checkpoint that began as a fork (:mod:`enrich.origin`), at every start."""
    cfg, st = pipeline.cfg, pipeline.state
    assert cfg.state is not None and st is not None
    ck = pipeline.checkpoint
    pending = ck.unfinished_rescale()
    if pending is not None:
        raise ConfigError(f"{cfg.source}: the checkpoint {ck.root}: a rescale to {pending} state partitions did not "
                          f"finish; run enrich rescale --partitions {pending} again before the job")
    # A new checkpoint's state partitions: Spark keeps this number in the offset log at its first batch.
    session = int(spark.conf.get(SHUFFLE_PARTITIONS) or "200")
    layout = check_checkpoint(ck, cfg.state, st.spec, cfg.source, st.dims, partitions=session,
                              waits=bool(cfg.waits))
    assert layout is not None
    planned = ck.planned()
    recorded = ck.recorded_partitions(planned[-1]) if planned else None
    configured = cfg.spark_conf.get(SHUFFLE_PARTITIONS)
    if recorded is not None and configured is not None and configured.strip() != str(recorded):
        log.warning("%s: spark: %s is %s, ignored: the checkpoint %s keeps its state in %d state partitions, and "
                    "Spark runs with the number its offset log holds (enrich rescale --partitions N changes it)",
                    cfg.source, SHUFFLE_PARTITIONS, configured, ck.root, recorded)
    partitions = recorded or session
    spread = layout.spread(partitions)
    if max(spread) - min(spread) > 1:
        log.warning("%s: state.buckets %d are spread %d to %d over the %d state partitions (even over a number "
                    "that divides %d)", cfg.source, layout.buckets, min(spread), max(spread), partitions,
                    layout.buckets)
    spark.conf.set(PROVIDER_CONF, ROCKSDB)
    if spark.conf.get(CHANGELOG_CONF, None) is None:
        spark.conf.set(CHANGELOG_CONF, CHANGELOG_DEFAULT)
    starts = fork.changelogs if fork is not None else {}
    changelogs = [read_stream(spark, cfg.kafka, [d.topic], starting_offsets=starts.get(d.topic, "earliest"))
                  for d in st.dims]
    initial = initial_state(spark, pipeline, layout, fork) if fork is not None else None
    ticks = tick_stream(spark, layout.ids) if cfg.waits else None
    return attach(raw, pipeline, layout, changelogs, devices, parser=parser, cache=TableCache(uuid.uuid4().hex),
                  initial=initial, floor_us=fork.floor_us if fork is not None else floor_us, ticks=ticks,
                  call_counts=call_counts)


#: The initial state's rows: a bucket's grouping key, what they hold (``devices`` or a partitioned
#: dimension's state name), the rows as Arrow IPC bytes, a dimension's published schema (JSON).
INITIAL = StructType([StructField(BUCKET, IntegerType(), False), StructField("kind", StringType(), False),
                      StructField("table", BinaryType(), False), StructField("schema", BinaryType(), True)])


def initial_state(spark: SparkSession, pipeline: Pipeline, layout: BucketLayout, fork: Fork) -> DataFrame:
    """The fork's state as ``transformWithStateInPandas``'s initial state: one row per bucket and
    kind, each device (and dimension row) in the bucket of its key in the new checkpoint's
    ``layout``, hashed as the events are (:meth:`BucketLayout.column`). Grouped by bucket and
    packed on the executors: nothing per device passes through the driver."""
    st = pipeline.state
    assert st is not None and pipeline.cfg.state is not None
    key_type = st.joined[pipeline.cfg.state.key].dataType
    out = _packed(fork.devices, engine.KEY, key_type, layout, STATE_NAME, None)
    for dim in st.dims:
        if dim.state_name in fork.dims:
            table, schema = fork.dims[dim.state_name]
            out = out.unionByName(_packed(table, [k for _, k in dim.join.pairs][0], key_type, layout,
                                          dim.state_name, schema))
    return out


def _packed(rows: DataFrame, key: str, key_type: DataType, layout: BucketLayout, kind: str,
            schema: bytes | None) -> DataFrame:
    """``rows`` as :data:`INITIAL` rows: a bucket's rows (by ``key``, cast to the events' ``key_type``)
    as one Arrow IPC value of ``kind``."""
    arrow = to_arrow_schema(INITIAL)

    def pack(bucket: tuple[pa.Scalar, ...], table: pa.Table) -> pa.Table:
        data = to_ipc(table.drop_columns([BUCKET]))
        return pa.table([[bucket[0].as_py()], [kind], [data], [schema]], schema=arrow)

    return rows.withColumn(BUCKET, layout.column(F.col(key).cast(key_type))).groupBy(BUCKET).applyInArrow(
        pack, INITIAL)


def attach(raw: DataFrame, pipeline: Pipeline, layout: BucketLayout, changelogs: Sequence[DataFrame] = (),
           devices: Accumulator[dict[int, int]] | None = None, *, parser: FastParser | None = None,
           cache: TableCache | None = None, initial: DataFrame | None = None,
           floor_us: int | None = None, ticks: DataFrame | None = None,
           call_counts: Accumulator[dict[int, dict[str, Any]]] | None = None) -> StateStream:
    """The Kafka stream ``raw`` through the pipeline's state step (:class:`StateStream`): parsed,
    joined in the plan by the joins before the step, then keyed by bucket (``layout``) into the
    step with the partitioned dimensions' ``changelogs`` (one stream each, in the plan's order,
    unioned with the events by bucket). Rows travel to the step parsed and packed
    (:mod:`enrich.state.ingest`, with the fast ``parser`` if given) and through it packed
    (:mod:`enrich.state.packed`). ``devices``: an accumulator of ``enrich.accumulators.KeyedCounts`` the step
    reports each bucket's device count to. ``cache``: where the executors keep a copy of the bucket
    tables they store (:mod:`enrich.state.cache`; None: none). ``initial``: the step's initial state
    (:func:`initial_state`), read on a new checkpoint's first batch; ``floor_us``: its watermark floor
    (:class:`enrich.state.processor.DeviceStateProcessor`). ``ticks``: the tick stream
    (:mod:`enrich.source.tick`) when a join waits for completeness: it calls every bucket each trigger.
    ``call_counts``: an accumulator of ``enrich.accumulators.KeyedTallies`` the step reports each
    bucket's call counts to."""
    cfg, st = pipeline.cfg, pipeline.state
    assert cfg.state is not None and st is not None
    timezone = pipeline.timezone
    columns = tuple(st.joined.fieldNames())
    packed_spark = StructType([StructField(BUCKET, IntegerType(), False), StructField(MAX_TS, TimestampType(), True),
                               StructField(ROWS, BinaryType(), False)])
    packed_arrow = to_arrow_schema(packed_spark, timezone=timezone)
    # Spark's watermark is taken on each chunk's greatest event time and the column dropped before
    # the step, so that Spark drops no row in front of the processor (see the module doc).
    rows = (_packed_events(raw, pipeline, parser, packed_spark, layout)
            .withWatermark(MAX_TS, f"{int(cfg.state.watermark.total_seconds() * 1000)} milliseconds")
            .drop(MAX_TS))
    key_type = st.joined[cfg.state.key].dataType
    for dim, changelog in zip(st.dims, changelogs, strict=True):
        rows = rows.union(_changelog_rows(changelog, dim, key_type, layout, packed_spark, packed_arrow))
    if ticks is not None:
        rows = rows.union(ticks.select(F.col(BUCKET), F.col(ROWS)))
    inner = stored_spec(st.spec)
    waits = WaitSpec.of(cfg.waits) if cfg.waits else None
    processor = DeviceStateProcessor(inner, columns, devices, st.dims, cache, waits, floor_us, st.calls, call_counts)
    flat_type = [*inner.output_type(), *[pa.field(n, t) for n, t in (st.calls.result_columns() if st.calls else ())]]
    # What the processor's packed tables hold: the passed columns, the flat state fields (the calls'
    # results last), the late flag.
    flat_schema = StructType([*st.passed, *[StructField(FLAT + f.name, from_arrow_type(f.type), True)
                                            for f in flat_type], StructField(LATE, BooleanType(), True)])
    stepped = rows.groupBy(BUCKET).transformWithStateInPandas(
        processor, outputStructType=StructType([StructField(ROWS, BinaryType(), False)]), outputMode="Append",
        timeMode="EventTime", initialState=initial.groupBy(BUCKET) if initial is not None else None)
    unpack = Unpack(to_arrow_schema(flat_schema, timezone=timezone), to_arrow_schema(st.schema, timezone=timezone),
                    tuple(f.name for f in st.passed), st.inner,
                    tuple(n for n, _ in st.calls.result_columns()) if st.calls else ())
    return StateStream(stepped, unpack, st.schema, cache)


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
    calls: tuple[str, ...] = ()     # the calls' result columns: flat in the state and top-level

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
        results = [t.column(FLAT + c) for c in self.calls]
        out = pa.Table.from_arrays([*(t.column(c) for c in self.passed), *results, state, late], schema=self.out)
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


def _packed_events(raw: DataFrame, pipeline: Pipeline, parser: FastParser | None, packed_spark: StructType,
                   layout: BucketLayout) -> DataFrame:
    """The events of ``raw`` packed for the step by :class:`enrich.state.ingest.EventPacker`: the fast
    pass (with a ``parser``), ``from_json`` in the plan for what it leaves, then the rest pass."""
    cfg, st, timezone = pipeline.cfg, pipeline.state, pipeline.timezone
    assert cfg.state is not None and st is not None
    state_cfg = cfg.state

    def packer(out: StructType, parse: FastEvents | None) -> EventPacker:
        return EventPacker(state_cfg.key, state_cfg.timestamp, layout,
                           ingest.events_schema(to_arrow_schema(st.joined, timezone=timezone)),
                           to_arrow_schema(out, timezone=timezone), st.before_specs, parse,
                           state_cfg.max_future_skew, max_key_bytes=state_cfg.max_key_bytes,
                           keep_values=any(c.on_error != "null" for c in cfg.calls))  # fail: data errors too

    def clocked(df: DataFrame) -> DataFrame:
        # The batch's time, not each executor's clock: Spark records it in the offset log and a
        # replayed batch gets the same value, so a replay judges every event as the first attempt did.
        if state_cfg.max_future_skew is None:
            return df
        return df.withColumn(BATCH_TIME, F.current_timestamp())

    rest_input, carry = raw, ()
    if parser is not None:
        first = StructType([StructField(BUCKET, IntegerType(), True), StructField(MAX_TS, TimestampType(), True),
                            StructField(ROWS, BinaryType(), True),
                            *[StructField(c, raw.schema[c].dataType, True) for c in ingest.RAW]])
        fast = FastEvents(parser, to_arrow_schema(events.fast_schema(pipeline.parsed), timezone=timezone))
        rest_input = clocked(events.source_columns(raw)).mapInArrow(packer(first, fast), first)
        carry = (BUCKET, MAX_TS, ROWS)  # type: ignore[assignment]
    parsed_rest = events.parse(rest_input, pipeline.events, cfg.events.required, keep_source=True, carry=carry)
    return clocked(parsed_rest).mapInArrow(packer(packed_spark, None), packed_spark)


def changelog_key(dim: PartitionedDim, key_type: DataType) -> Column:
    """The key of a changelog record of ``dim`` as the events' key column (of ``key_type``) would
    hold it: read from the key's JSON as the contract writes the published key type, then cast.
    Binary is base64 text there (the events' BINARY holds the decoded bytes); a TIMESTAMP without
    zone is read as UTC, as the join matches it (``enrich.join``: Arrow's cast keeps UTC values),
    whatever the session's time zone. A key that does not fit ``key_type`` (1000 for a TINYINT)
    is null: no event can have it, and ANSI casts would fail the query."""
    name = [k for _, k in dim.join.pairs][0]
    quoted = name.replace("'", "\\'")
    text = F.get_json_object(F.col("key").cast("string"), f"$['{quoted}']")
    published = dim.schema.type_of(name)
    value = text
    if published == "binary":
        value = F.unbase64(text)
    elif published == "timestamp" and isinstance(key_type, TimestampType):
        value = F.concat(text, F.lit("Z"))
    return value.try_cast(key_type)


def _changelog_rows(changelog: DataFrame, dim: PartitionedDim, key_type: DataType, layout: BucketLayout,
                    packed_spark: StructType, packed_arrow: pa.Schema) -> DataFrame:
    """A partitioned dimension's changelog stream packed like the events: each record in the bucket
    of its key (:func:`changelog_key`, so it hashes as the events do), a schema record in every
    bucket, no heartbeat."""
    key = changelog_key(dim, key_type)
    schema_record = F.col("key") == F.lit(contract.SCHEMA_KEY)
    targets = F.when(schema_record, layout.all()).otherwise(F.array(layout.column(key)))
    columns: list[Column | str] = ["partition", "offset", "key", "value"]
    if dim.history is not None:  # versions: when each record holds from (enrich.state.dimension)
        header = F.try_element_at(F.filter("headers", lambda h: h["key"] == F.lit(contract.H_VALID_FROM)),
                                  F.lit(-1))
        columns += [header["value"].cast("string").alias(VALID_FROM_TEXT), F.col("timestamp").alias(PUBLISHED)]
    records = (changelog.where(F.col("key") != F.lit(contract.HEARTBEAT_KEY))
               .select(F.explode(targets).alias(BUCKET), *columns))
    return (records.mapInArrow(functools.partial(packed.pack, bucket=BUCKET, timestamp=None,
                                                 packed_schema=packed_arrow, kind=dim.kind), packed_spark)
            .drop(MAX_TS))

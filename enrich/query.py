"""The running query, wired from the plan (:mod:`enrich.pipeline`) top to bottom in the order the
data flows; the only module that calls Spark's streaming APIs for it (``readStream``,
``mapInArrow``, ``transformWithStateInPandas``, ``writeStream``, ``foreachBatch``). Each stage
hands it its functions and keeps its own logic:

::

    source   read_stream, read_events         the events topic (enrich.source); the partitioned
                                              dimensions' changelogs and the ticks (enrich.source.tick)
    parse    _packed_events                   pyarrow where exact, from_json for the rest, and the
                                              broadcast joins the state needs, packed for the step
                                              (enrich.events, enrich.state.ingest, enrich.joins)
    state    state_step, attach               the keyed step with the partitioned joins and the calls
                                              inside it (enrich.state, enrich.calls)
    joins    apply_joins                      the join pass, in each batch (enrich.joins)
    outputs  writer                           foreachBatch: the job's batch writes the sink (enrich.sinks)

:func:`build` wires the first three; the job (:mod:`enrich.job`) starts the query with
:func:`writer` and runs the join pass and the sink in each batch. A feature that adds a stage adds
it here. A sink's own writer and the operator tools over a stopped checkpoint (:mod:`enrich.ops`)
call Spark themselves (tests/test_layers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.accumulators import Accumulator
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, from_arrow_type, to_arrow_schema
from pyspark.sql.streaming import DataStreamWriter
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

from enrich import events, joins, packed
from enrich.columns import (
    BATCH_TIME,
    BUCKET,
    FLAT,
    LATE,
    MAX_TS,
    PACK_KIND,
    RBUCKET,
    ROLLUP_TIME,
    ROWS,
    SOURCE,
    TAIL,
)
from enrich.dimension.ship import Shipped
from enrich.events import FastEvents
from enrich.events.fastparse import FastParser
from enrich.gaps import engine as gap_engine
from enrich.joins.partitioned import PUBLISHED, VALID_FROM_TEXT, PartitionedDim
from enrich.pipeline import Pipeline
from enrich.rollups import packs
from enrich.rollups.spec import RollupSpec
from enrich.sinks.abc import EnrichedBatch
from enrich.sinks.rollups import rows_of
from enrich.source import range_reader, stream_format, tick
from enrich.source.fetch import SCHEMA_DDL, RangeReader
from enrich.state import corrections, engine, ingest, rollups
from enrich.state.cache import TableCache
from enrich.state.ingest import EventPacker
from enrich.state.layout import BucketLayout
from enrich.state.processor import DeviceStateProcessor
from enrich.state.record import check_checkpoint, dropped_rollups
from enrich.state.rollups import RollupProcessor
from enrich.state.stored import STATE_NAME, stored_spec
from enrich.state.stream import INITIAL, Fork, Unpack, changelog_key, initial_packer, prepare
from enrich.state.wait import WaitSpec
from refstream import contract

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stream:
    """The query up to its output (:func:`build`): ``frame`` is what ``foreachBatch`` receives (the
    Kafka records without state, else the state step's packed rows); ``fast``: the fast parser the
    join pass parses the events with (no state, and a sink that can write a task's slot again);
    ``state``: the state step."""

    frame: DataFrame
    fast: FastParser | None
    state: StateStream | None
    #: With the fast parser: the step that reads the records of the offset ranges ``frame`` holds
    #: (the source's ``ranges`` option), run in the join pass's task (or the writer's).
    ranges: RangeReader | None = None


def build(spark: SparkSession, pipeline: Pipeline, *, starting: str, reparses: bool,
          devices: Accumulator[dict[int, int]] | None = None, fork: Fork | None = None,
          call_counts: Accumulator[dict[int, dict[str, Any]]] | None = None,
          floor_us: int | None = None, gap_records: Accumulator[dict[int, dict[str, Any]]] | None = None,
          correction_counts: Accumulator[dict[int, dict[str, Any]]] | None = None) -> Stream:
    """The query of ``pipeline`` from its source to what ``foreachBatch`` receives: the events topic
    read from ``starting`` (Spark's starting offsets), then parsed and through the state step when
    the plan has one (:func:`state_step`: ``devices``, ``fork``, ``call_counts``, ``floor_us``,
    ``gap_records``, ``correction_counts``).
    Without state, the fast parser's leftovers are parsed again by a sink that ``reparses`` (can
    write a task's slot twice); with state, by from_json in the plan before the step
    (enrich.state.ingest)."""
    cfg = pipeline.cfg
    parser = (FastParser.for_schema(pipeline.events, cfg.events.required, pipeline.timezone)
              if cfg.events.parser == "auto" else None)
    if pipeline.state is None:
        fast = parser if reparses else None
        log.info("events parsed by %s", "pyarrow, with from_json for what it leaves" if fast else "from_json")
        check_checkpoint(pipeline.checkpoint, None, None, cfg.source)
        # The join pass (and the Kafka output's tasks) read the records themselves: they never
        # cross into the JVM and back (docs/benchmarks.md).
        reader = _events_reader(pipeline, fast)
        return Stream(read_events(spark, pipeline, starting, ranges=reader is not None), fast, None, reader)
    log.info("events parsed by %s", "pyarrow, with from_json for what it leaves" if parser else "from_json")
    # The fast pass reads the records of its range itself; the events it leaves to from_json cross
    # into the JVM alone, from it.
    reader = _events_reader(pipeline, parser)
    raw = read_events(spark, pipeline, starting, ranges=reader is not None)
    state = state_step(spark, pipeline, raw, devices, parser, fork, call_counts, floor_us=floor_us,
                       gap_records=gap_records, ranges=reader, correction_counts=correction_counts)
    return Stream(state.packed, None, state)


# ------------------------------------------------------------------------------------------ source

def read_stream(spark: SparkSession, settings: Mapping[str, str], topics: Sequence[str], *,
                starting_offsets: str = "latest", max_offsets_per_trigger: int | None = None,
                fail_on_data_loss: bool = True, on_offset_reset: str = "fail", builtin: bool = False,
                ranges: bool = False) -> DataFrame:
    """The streaming DataFrame of ``topics`` with the columns of Spark's Kafka source: ``key``,
    ``value`` (binary), ``topic``, ``partition``, ``offset``, ``timestamp``, ``timestampType``,
    ``headers``. ``settings`` are librdkafka settings (``bootstrap.servers``...), ``starting_offsets``
    is ``earliest``, ``latest`` or Spark's per-partition JSON. ``builtin=True`` uses Spark's own
    ``kafka`` format (needs the spark-sql-kafka connector on the classpath) with the same options,
    read_committed isolation and headers. ``on_offset_reset`` (``fail``, ``earliest``, ``latest``):
    what ``refstream-kafka`` does with a partition whose topic was recreated or whose offsets went
    backwards (Spark's format has no such option)."""
    fmt, opts = stream_format(spark, settings, topics, starting_offsets=starting_offsets,
                              max_offsets_per_trigger=max_offsets_per_trigger, fail_on_data_loss=fail_on_data_loss,
                              on_offset_reset=on_offset_reset, builtin=builtin, ranges=ranges)
    return spark.readStream.format(fmt).options(**opts).load()


def read_events(spark: SparkSession, pipeline: Pipeline, starting: str, *, ranges: bool = False) -> DataFrame:
    """The events topic from ``starting`` (the checkpoint's origin, :mod:`enrich.origin`); with
    ``ranges``, each task's offset range instead of its records (``enrich.source.fetch.RANGE_DDL``)."""
    cfg = pipeline.cfg
    ev = cfg.events
    return read_stream(spark, cfg.kafka, [ev.topic], starting_offsets=starting,
                       max_offsets_per_trigger=cfg.max_events_per_batch, fail_on_data_loss=ev.fail_on_data_loss,
                       on_offset_reset=ev.on_offset_reset, builtin=ev.source == "builtin", ranges=ranges)


def _events_reader(pipeline: Pipeline, parser: FastParser | None) -> RangeReader | None:
    """The step that reads the events of the offset ranges the events source gives (its ``ranges``
    option), as the internal source columns (``enrich.columns.SOURCE``), when the events are read
    that way: the ``parser`` (the fast path) parses them where they are read, and the source is
    refstream's own (Spark's ``builtin`` one has no ranges)."""
    cfg = pipeline.cfg
    if parser is None or cfg.events.source == "builtin":
        return None
    log.info("events read from Kafka by the tasks that parse them (the source gives each its offset range)")
    return range_reader(cfg.kafka, [cfg.events.topic], fail_on_data_loss=cfg.events.fail_on_data_loss,
                        columns=SOURCE)


def read_ranges(df: DataFrame, reader: RangeReader) -> DataFrame:
    """The Kafka records (:func:`read_stream`'s columns) of ``df``, a batch of offset ranges
    (:attr:`Stream.ranges`), read by a ``mapInArrow`` step: each task its own range, so the
    partition indexes (the Kafka output's slots) are the ranges'."""
    return df.mapInArrow(dataclasses.replace(reader, columns=None), SCHEMA_DDL)


def read_ticks(spark: SparkSession, layout: BucketLayout) -> DataFrame:
    """The tick stream (:mod:`enrich.source.tick`): a row for every bucket of ``layout`` each trigger."""
    return spark.readStream.format(tick.FORMAT).options(**tick.tick_options(spark, layout.ids)).load()


# ------------------------------------------------------------------------------------------- parse

def _packed_events(raw: DataFrame, pipeline: Pipeline, parser: FastParser | None, packed_spark: StructType,
                   layout: BucketLayout, ranges: RangeReader | None = None) -> DataFrame:
    """The events of ``raw`` packed for the step by :class:`enrich.state.ingest.EventPacker`: the fast
    pass (with a ``parser``; reading the records of ``raw``'s offset ranges first with ``ranges``),
    ``from_json`` in the plan for what it leaves, then the rest pass."""
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
        internal = {src: name for name, src in SOURCE.items()}
        first = StructType([StructField(BUCKET, IntegerType(), True), StructField(MAX_TS, TimestampType(), True),
                            StructField(ROWS, BinaryType(), True),
                            *[StructField(c, events.SOURCE_TYPES[internal[c]], True) for c in ingest.RAW]])
        fast = FastEvents(parser, to_arrow_schema(events.fast_schema(pipeline.parsed), timezone=timezone))
        if ranges is not None:
            rest_input = clocked(raw).mapInArrow(Chain(ranges, packer(first, fast)), first)
        else:
            rest_input = clocked(events.source_columns(raw)).mapInArrow(packer(first, fast), first)
        carry = (BUCKET, MAX_TS, ROWS)  # type: ignore[assignment]
    parsed_rest = events.parse(rest_input, pipeline.events, cfg.events.required, keep_source=True, carry=carry)
    return clocked(parsed_rest).mapInArrow(packer(packed_spark, None), packed_spark)


# ------------------------------------------------------------------------------------------- state

def state_step(spark: SparkSession, pipeline: Pipeline, raw: DataFrame,
               devices: Accumulator[dict[int, int]] | None = None, parser: FastParser | None = None,
               fork: Fork | None = None,
               call_counts: Accumulator[dict[int, dict[str, Any]]] | None = None, *,
               floor_us: int | None = None,
               gap_records: Accumulator[dict[int, dict[str, Any]]] | None = None,
               ranges: RangeReader | None = None,
               correction_counts: Accumulator[dict[int, dict[str, Any]]] | None = None) -> StateStream:
    """The ``raw`` Kafka stream through the pipeline's state step, checked against the checkpoint
    first (:func:`enrich.state.stream.prepare`), through :func:`attach` (``devices``, ``parser``: see
    there), the partitioned dimensions' changelogs read as streams beside it; with a ``fork``, the
    step starts from its state, changelog offsets and watermark; ``floor_us``: the watermark floor
    of a checkpoint that began as a fork (:mod:`enrich.origin`), at every start; ``gap_records``:
    an accumulator of ``enrich.accumulators.KeyedTallies`` each bucket reports its gaps to;
    ``ranges``: ``raw`` holds offset ranges, which this reads (with a ``parser`` only);
    ``correction_counts``: an accumulator of ``enrich.accumulators.KeyedTallies`` each bucket reports
    its corrected partitioned joins' late versions to."""
    cfg, st = pipeline.cfg, pipeline.state
    assert cfg.state is not None and st is not None
    layout = prepare(spark, cfg, pipeline.checkpoint, st.spec, st.dims, st.rollups)
    starts = fork.changelogs if fork is not None else {}
    changelogs = [read_stream(spark, cfg.kafka, [d.topic], starting_offsets=starts.get(d.topic, "earliest"))
                  for d in st.dims]
    initial = initial_state(spark, pipeline, layout, fork) if fork is not None else None
    # Every bucket called each trigger: to decide what waits, whether the rollups are idle, which
    # silent devices' partitions passed their thresholds.
    ticks = read_ticks(spark, layout) if needs_ticks(pipeline) else None
    windows = None
    if fork is not None and fork.rollups is not None and st.rollups:  # the fork's rollup windows, re-routed
        # A part names its state bucket by grouping key: the fork's key of the same bucket, when the
        # bucket count is the savepoint's (a device keeps its bucket), else none known.
        same = fork.rollup_ids is not None and len(fork.rollup_ids) == len(layout.ids)
        sources = dict(zip(fork.rollup_ids, layout.ids, strict=True)) if same and fork.rollup_ids else None
        windows = fork.rollups.mapInArrow(functools.partial(rollups.initial_windows, specs=st.rollups,
                                                            ids=layout.ids, sources=sources), rollups.INITIAL)
    return attach(raw, pipeline, layout, changelogs, devices, parser=parser, cache=TableCache(uuid.uuid4().hex),
                  initial=initial, floor_us=fork.floor_us if fork is not None else floor_us, ticks=ticks,
                  call_counts=call_counts, windows=windows, gap_records=gap_records, ranges=ranges,
                  correction_counts=correction_counts)


def needs_ticks(pipeline: Pipeline) -> bool:
    """Whether the state step has the tick source: a join waits, a rollup needs it, gaps, or
    corrections (a late version corrects events of buckets that got none in its batch)."""
    st = pipeline.state
    return st is not None and bool(pipeline.cfg.waits or pipeline.corrected or any(r.needs_ticks for r in st.rollups)
                                   or st.gaps is not None)


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
    for name, rows in fork.gaps.items():  # the gap tables' rows, by device
        out = out.unionByName(_packed(rows, gap_engine.KEY, key_type, layout, name, None))
    if fork.written is not None and pipeline.corrected:  # the kept chunks, split by the device's bucket
        out = out.unionByName(fork.written.mapInArrow(
            functools.partial(corrections.initial_written, ids=layout.ids, key=pipeline.cfg.state.key), INITIAL))
    return out


def _packed(rows: DataFrame, key: str, key_type: DataType, layout: BucketLayout, kind: str,
            schema: bytes | None) -> DataFrame:
    """``rows`` as :data:`~enrich.state.stream.INITIAL` rows: a bucket's rows (by ``key``, cast to the
    events' ``key_type``) as one Arrow IPC value of ``kind``."""
    return rows.withColumn(BUCKET, layout.column(F.col(key).cast(key_type))).groupBy(BUCKET).applyInArrow(
        initial_packer(kind, schema), INITIAL)


def attach(raw: DataFrame, pipeline: Pipeline, layout: BucketLayout, changelogs: Sequence[DataFrame] = (),
           devices: Accumulator[dict[int, int]] | None = None, *, parser: FastParser | None = None,
           cache: TableCache | None = None, initial: DataFrame | None = None,
           floor_us: int | None = None, ticks: DataFrame | None = None,
           call_counts: Accumulator[dict[int, dict[str, Any]]] | None = None,
           windows: DataFrame | None = None,
           gap_records: Accumulator[dict[int, dict[str, Any]]] | None = None,
           ranges: RangeReader | None = None,
           correction_counts: Accumulator[dict[int, dict[str, Any]]] | None = None) -> StateStream:
    """The Kafka stream ``raw`` through the pipeline's state step (:class:`StateStream`): parsed,
    joined in the plan by the joins before the step, then keyed by bucket (``layout``) into the
    step with the partitioned dimensions' ``changelogs`` (one stream each, in the plan's order,
    unioned with the events by bucket). Rows travel to the step parsed and packed
    (:mod:`enrich.state.ingest`, with the fast ``parser`` if given) and through it packed
    (:mod:`enrich.packed`). ``devices``: an accumulator of ``enrich.accumulators.KeyedCounts`` the step
    reports each bucket's device count to. ``cache``: where the executors keep a copy of the bucket
    tables they store (:mod:`enrich.state.cache`; None: none). ``initial``: the step's initial state
    (:func:`initial_state`), read on a new checkpoint's first batch; ``floor_us``: its watermark floor
    (:class:`enrich.state.processor.DeviceStateProcessor`). ``ticks``: the tick stream
    (:mod:`enrich.source.tick`) when a join waits for completeness: it calls every bucket each trigger.
    ``call_counts``: an accumulator of ``enrich.accumulators.KeyedTallies`` the step reports each
    bucket's call counts to. ``windows``: the rollup step's initial state
    (:data:`enrich.state.rollups.INITIAL`), a fork's rollup windows. ``gap_records``: an accumulator
    of ``enrich.accumulators.KeyedTallies`` the step reports each bucket's gaps to (:mod:`enrich.gaps`);
    ``correction_counts``: one each bucket reports its corrected partitioned joins' late versions to."""
    cfg, st = pipeline.cfg, pipeline.state
    assert cfg.state is not None and st is not None
    timezone = pipeline.timezone
    columns = tuple(st.joined.fieldNames())
    packed_spark = StructType([StructField(BUCKET, IntegerType(), False), StructField(MAX_TS, TimestampType(), True),
                               StructField(ROWS, BinaryType(), False)])
    packed_arrow = to_arrow_schema(packed_spark, timezone=timezone)
    # Spark's watermark is taken on each chunk's greatest event time and the column dropped before
    # the step, so that Spark drops no row in front of the processor (see the module doc).
    rows = (_packed_events(raw, pipeline, parser, packed_spark, layout, ranges)
            .withWatermark(MAX_TS, f"{int(cfg.state.watermark.total_seconds() * 1000)} milliseconds")
            .drop(MAX_TS))
    key_type = st.joined[cfg.state.key].dataType
    for dim, changelog in zip(st.dims, changelogs, strict=True):
        rows = rows.union(_changelog_rows(changelog, dim, key_type, layout, packed_spark, packed_arrow))
    if ticks is not None:
        rows = rows.union(ticks.select(F.col(BUCKET), F.col(ROWS)))
    inner = stored_spec(st.spec)
    waits = WaitSpec.of(cfg.waits) if cfg.waits else None
    flat_type = [*inner.output_type(), *[pa.field(n, t) for n, t in (st.calls.result_columns() if st.calls else ())]]
    # What the processor's packed tables hold: the passed columns, the flat state fields (the calls'
    # results last), the late flag.
    tail = [f for f in st.schema.fields if f.name in TAIL]  # with corrections: what each row is
    flat_schema = StructType([*st.passed, *[StructField(FLAT + f.name, from_arrow_type(f.type), True)
                                            for f in flat_type], StructField(LATE, BooleanType(), True), *tail])
    processor = DeviceStateProcessor(inner, columns, devices, st.dims, cache, waits, floor_us, st.calls, call_counts,
                                     server_timeout_s=cfg.state.server_timeout.total_seconds(),
                                     rollups=st.rollups, rollup_ids=layout.ids, inner=st.inner, gaps=st.gaps,
                                     gap_records=gap_records, corrected=pipeline.corrected,
                                     out_schema=to_arrow_schema(flat_schema, timezone=timezone) if tail else None,
                                     correction_counts=correction_counts,
                                     before=st.before_specs)
    init = initial.groupBy(BUCKET) if initial is not None else None
    if not st.rollups:
        stepped = rows.groupBy(BUCKET).transformWithStateInPandas(
            processor, outputStructType=StructType([StructField(ROWS, BinaryType(), False)]), outputMode="Append",
            timeMode="EventTime", initialState=init)
    else:
        stepped = rollup_step(rows.groupBy(BUCKET).transformWithStateInPandas(
            processor, outputStructType=ROLLUP_INPUT, outputMode="Append", timeMode="EventTime", initialState=init,
            eventTimeColumnName=ROLLUP_TIME), st.rollups, cfg.state.server_timeout.total_seconds(),
            dropped_rollups(pipeline.checkpoint), windows,
            {s.dataset: s for s in st.before_specs if any(r.fill_keys == s.dataset for r in st.rollups)}, layout.ids,
            floor_us=floor_us)
    unpack = Unpack(to_arrow_schema(flat_schema, timezone=timezone), to_arrow_schema(st.schema, timezone=timezone),
                    tuple(f.name for f in st.passed), st.inner,
                    tuple(n for n, _ in st.calls.result_columns()) if st.calls else (), tuple(f.name for f in tail))
    return StateStream(stepped, unpack, st.schema, cache, rollups=bool(st.rollups))


#: The state step's rows when the job has rollups: the rollup step's input (enrich.state.rollups).
ROLLUP_INPUT = StructType([StructField(RBUCKET, IntegerType(), False), StructField(ROLLUP_TIME, TimestampType(), False),
                           StructField(PACK_KIND, StringType(), False), StructField(ROWS, BinaryType(), False)])


def rollup_step(stepped: DataFrame, specs: tuple[RollupSpec, ...], server_timeout_s: float,
                dropped: tuple[str, ...] = (), windows: DataFrame | None = None,
                fills: Mapping[str, joins.JoinSpec] | None = None, ids: tuple[int, ...] = (),
                floor_us: int | None = None) -> DataFrame:
    """The rollup step after the state step (:class:`enrich.state.rollups.RollupProcessor`), keyed by
    rollup bucket: the events pass through it; its rows are ``PACK_KIND``, ``ROWS``. ``dropped``: the
    rollups removed from the checkpoint, whose windows it deletes; ``windows``: its initial state
    (:data:`enrich.state.rollups.INITIAL`, a fork's first batch); ``fills``: the in-plan joins whose
    dimension's keys rollups fill by, by dataset; ``ids``: the rollup buckets' grouping keys;
    ``floor_us``: a fork's watermark floor."""
    return stepped.groupBy(RBUCKET).transformWithStateInPandas(
        RollupProcessor(specs, server_timeout_s=server_timeout_s, dropped=dropped, joins=fills, ids=ids,
                        floor_us=floor_us),
        outputStructType=rollups.OUTPUT,
        outputMode="Append", timeMode="EventTime",
        initialState=windows.groupBy(RBUCKET) if windows is not None else None)


def _changelog_rows(changelog: DataFrame, dim: PartitionedDim, key_type: DataType, layout: BucketLayout,
                    packed_spark: StructType, packed_arrow: pa.Schema) -> DataFrame:
    """A partitioned dimension's changelog stream packed like the events: each record in the bucket
    of its key (:func:`changelog_key`, so it hashes as the events do), a schema record in every
    bucket, no heartbeat."""
    key = changelog_key(dim, key_type)
    schema_record = F.col("key") == F.lit(contract.SCHEMA_KEY)
    targets = F.when(schema_record, layout.all()).otherwise(F.array(layout.column(key)))
    columns: list[Column | str] = ["partition", "offset", "key", "value"]
    if dim.history is not None:  # versions: when each record holds from (enrich.joins.partitioned)
        header = F.try_element_at(F.filter("headers", lambda h: h["key"] == F.lit(contract.H_VALID_FROM)),
                                  F.lit(-1))
        columns += [header["value"].cast("string").alias(VALID_FROM_TEXT), F.col("timestamp").alias(PUBLISHED)]
    records = (changelog.where(F.col("key") != F.lit(contract.HEARTBEAT_KEY))
               .select(F.explode(targets).alias(BUCKET), *columns))
    return (records.mapInArrow(functools.partial(packed.pack, bucket=BUCKET, timestamp=None,
                                                 packed_schema=packed_arrow, kind=dim.kind), packed_spark)
            .drop(MAX_TS))


@dataclass(frozen=True)
class StateStream:
    """The state step's output: ``packed`` is the streaming DataFrame of the step's packed rows;
    ``unpack`` turns one Arrow batch of them into events of ``schema`` (the events' and the
    partitioned joins' columns, ``state``, ``_late``). The job unpacks them in its join pass
    (:func:`apply_joins`'s ``first`` step), so the events cross from Python to the JVM once.
    ``cache``: the executors' copies of the bucket tables; the job removes its directory at stop."""

    packed: DataFrame
    unpack: Unpack
    schema: StructType
    cache: TableCache | None = None
    rollups: bool = False           # ``packed`` is the rollup step's output: see :meth:`events`

    def events(self, df: DataFrame) -> DataFrame:
        """The packed events of ``df``, a batch of :attr:`packed`: with rollups, the rollup step's
        values holding events (``PACK_KIND``), as the state step's rows without them."""
        return df.where(F.col(PACK_KIND) == F.lit(packs.EVENTS)).select(ROWS) if self.rollups else df

    def frame(self, df: DataFrame | None = None) -> DataFrame:
        """``df`` (default: the stream), packed rows of the step, unpacked in a ``mapInArrow`` pass."""
        return self.events(self.packed if df is None else df).mapInArrow(self.unpack.batches, self.schema)


def rollup_rows(df: DataFrame, specs: Sequence[RollupSpec]) -> list[DataFrame]:
    """Each rollup's rows in ``df``, a batch of the rollup step's output, as its output schema."""
    out = []
    for i, spec in enumerate(specs):
        schema = spec.output_schema()
        out.append(df.where(F.col(PACK_KIND) == F.lit(packs.rows_kind(i))).select(ROWS)
                   .mapInArrow(functools.partial(rows_of, schema=schema), from_arrow_schema(schema)))
    return out


# ------------------------------------------------------------------------------------------- joins

def apply_joins(df: DataFrame, specs: Sequence[joins.JoinSpec], out_schema: StructType,
                shipped: Mapping[str, Shipped], error_column: str | None = None, parser: FastParser | None = None,
                parsed_schema: StructType | None = None, first: Callable[[pa.RecordBatch], pa.Table] | None = None,
                unmatched: Accumulator[dict[int, int]] | None = None) -> DataFrame:
    """``df`` with every join applied, in one ``mapInArrow`` pass of :func:`enrich.joins.enricher`
    (which says what ``parser``, ``parsed_schema``, ``first`` and ``unmatched`` do)."""
    return enriched(df, specs, out_schema, shipped, (), (), error_column, parser, parsed_schema, first, unmatched).df


def enriched(df: DataFrame, specs: Sequence[joins.JoinSpec], out_schema: StructType,
             shipped: Mapping[str, Shipped], columns: Sequence[str], matched: Sequence[str],
             error_column: str | None = None, parser: FastParser | None = None,
             parsed_schema: StructType | None = None, first: Callable[[pa.RecordBatch], pa.Table] | None = None,
             unmatched: Accumulator[dict[int, int]] | None = None, read: RangeReader | None = None
             ) -> EnrichedBatch:
    """The batch of output ``columns`` that :func:`apply_joins` makes of ``df``, with the pass
    itself (``before``, ``step``, ``schema``) for a sink that runs it in its own tasks. With
    ``read``, ``df`` holds offset ranges (:attr:`Stream.ranges`) and the pass reads their records first."""
    tz = (df.sparkSession.conf.get("spark.sql.session.timeZone") or "UTC") if parser is not None else "UTC"
    fn = joins.enricher(specs, shipped, error_column, parser, parsed_schema, first, unmatched, timezone=tz)
    step: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = fn
    if read is not None:
        step = read if fn is None else Chain(read, fn)
    out = df if step is None else df.mapInArrow(step, out_schema)
    return EnrichedBatch(out, tuple(columns), tuple(matched), before=df, step=step,
                         schema=out.schema if step is None else out_schema)


@dataclass(frozen=True)
class Chain:
    """Two ``mapInArrow`` functions as one: ``second`` over what ``first`` yields."""

    first: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
    second: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return self.second(self.first(batches))


# ----------------------------------------------------------------------------------------- outputs

def writer(frame: DataFrame, process: Callable[[DataFrame, int], None], *, checkpoint: Path, name: str,
           available_now: bool, trigger: timedelta) -> DataStreamWriter:
    """The query's writer: each micro-batch of ``frame`` to ``process`` (``foreachBatch``), Spark's
    checkpoint in ``checkpoint``, available-now or every ``trigger``. ``start()`` starts the query
    (again, after a failure: from its checkpoint)."""
    out = frame.writeStream.foreachBatch(process).option("checkpointLocation", str(checkpoint)).queryName(name)
    if available_now:
        return out.trigger(availableNow=True)
    return out.trigger(processingTime=f"{int(trigger.total_seconds() * 1000)} milliseconds")

"""The keyed state step's parts that the running query (:mod:`enrich.query`) wires together.

The query keys the events by the bucket of ``pmod(hash(key), buckets)`` (spread evenly over the
state partitions: :mod:`enrich.state.layout`) into ``transformWithStateInPandas``
(:mod:`enrich.state.processor`). The events are parsed, checked and packed on their way in
(:mod:`enrich.state.ingest`) and stay packed through the step (:mod:`enrich.packed`);
:class:`Unpack` turns the step's rows into events in the job's join pass. Here: :func:`prepare`
checks the step against the checkpoint before the query starts, :class:`Fork` is a start from a
savepoint, :func:`changelog_key` the key of a partitioned dimension's changelog record.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    DataType,
    IntegerType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from enrich import packed
from enrich.checkpoint import CheckpointLayout
from enrich.columns import BUCKET, ERROR, FLAT, KIND, KIND_CORRECTION, LATE, STATE
from enrich.config import EnrichConfig
from enrich.ipc import to_ipc
from enrich.joins.partitioned import PartitionedDim
from enrich.rollups.spec import RollupSpec
from enrich.session import SHUFFLE_PARTITIONS
from enrich.state.engine import StateSpec
from enrich.state.layout import BucketLayout
from enrich.state.record import check_checkpoint
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
    earliest), ``floor_us`` the savepoint job's watermark (event time, microseconds; None: it had
    none), ``rollups`` the rollups' windows (:data:`enrich.state.rollups.SAVED`; None: none),
    ``gaps`` the gap tables' rows by state variable (``gaps``, ``gaps_closed``; empty: none), and
    ``written`` the events written within the corrections' horizon, one kept chunk per row
    (:func:`enrich.state.corrections.saved_chunks`; None: none); ``rollup_ids`` the savepoint job's
    bucket grouping keys (None: not known), which its moving rollups' parts name
    (:func:`enrich.rollups.engine.move`)."""

    devices: DataFrame
    dims: Mapping[str, tuple[DataFrame, bytes]]
    changelogs: Mapping[str, str]
    floor_us: int | None
    rollups: DataFrame | None = None
    gaps: Mapping[str, DataFrame] = dataclasses.field(default_factory=dict)
    written: DataFrame | None = None
    rollup_ids: tuple[int, ...] | None = None


def prepare(spark: SparkSession, cfg: EnrichConfig, ck: CheckpointLayout, spec: StateSpec,
            dims: Sequence[PartitionedDim], rollups: Sequence[RollupSpec] = ()) -> BucketLayout:
    """The state step checked against the checkpoint ``ck`` before the query starts, and its bucket
    layout: a start on a rescale that did not finish is refused; a warning when the config's
    ``spark.sql.shuffle.partitions`` is not the number the checkpoint runs with, or the buckets
    spread unevenly over it. Sets the RocksDB state store (and its changelog checkpointing unless
    the user set it) on ``spark``."""
    assert cfg.state is not None
    pending = ck.unfinished_rescale()
    if pending is not None:
        raise ConfigError(f"{cfg.source}: the checkpoint {ck.root}: a rescale to {pending} state partitions did not "
                          f"finish; run enrich rescale --partitions {pending} again before the job")
    # A new checkpoint's state partitions: Spark keeps this number in the offset log at its first batch.
    session = int(spark.conf.get(SHUFFLE_PARTITIONS) or "200")
    layout = check_checkpoint(ck, cfg.state, spec, cfg.source, dims, partitions=session, waits=bool(cfg.waits),
                              rollups=rollups, gaps=cfg.gaps is not None,
                              corrections=any(j.corrections is not None for j in cfg.joins))
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
    return layout


#: The initial state's rows: a bucket's grouping key, what they hold (``devices`` or a partitioned
#: dimension's state name), the rows as Arrow IPC bytes, a dimension's published schema (JSON).
INITIAL = StructType([StructField(BUCKET, IntegerType(), False), StructField("kind", StringType(), False),
                      StructField("table", BinaryType(), False), StructField("schema", BinaryType(), True)])


def initial_packer(kind: str, schema: bytes | None) -> Callable[[tuple[pa.Scalar, ...], pa.Table], pa.Table]:
    """The ``applyInArrow`` function that packs one bucket's rows of ``kind`` as one :data:`INITIAL`
    row (``schema``: a dimension's published schema)."""
    arrow = to_arrow_schema(INITIAL)

    def pack(bucket: tuple[pa.Scalar, ...], table: pa.Table) -> pa.Table:
        data = to_ipc(table.drop_columns([BUCKET]))
        return pa.table([[bucket[0].as_py()], [kind], [data], [schema]], schema=arrow)

    return pack


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
    tail: tuple[str, ...] = ()      # with corrections: _kind, _revision, _cause (enrich.state.corrections)

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
        tail = [t.column(c) for c in self.tail]
        out = pa.Table.from_arrays([*(t.column(c) for c in self.passed), *results, state, late, *tail], schema=self.out)
        if self.inner:
            keep = pc.is_valid(out.column(ERROR))
            matched = [pc.fill_null(out.column(m), False) for m in self.inner]
            keep = pc.or_(keep, functools.reduce(pc.and_, matched))
            if KIND in out.column_names:  # a correction goes on: one the join no longer matches retracts its event
                keep = pc.or_(keep, pc.fill_null(pc.equal(out.column(KIND), KIND_CORRECTION), False))
            out = out.filter(keep)
        return out

    def batches(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The ``mapInArrow`` function of :meth:`enrich.query.StateStream.frame`."""
        for b in batches:
            yield from self(b).to_batches()


def changelog_key(dim: PartitionedDim, key_type: DataType) -> Column:
    """The key of a changelog record of ``dim`` as the events' key column (of ``key_type``) would
    hold it: read from the key's JSON as the contract writes the published key type, then cast.
    Binary is base64 text there (the events' BINARY holds the decoded bytes); a TIMESTAMP without
    zone is read as UTC, as the join matches it (``enrich.joins``: Arrow's cast keeps UTC values),
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

"""Reading a checkpoint's device state in batch: one owner for the offline operations that read it
(``enrich lookup --state``, :mod:`enrich.ops.device`; ``enrich savepoint``, :mod:`enrich.ops.savepoint`)
and for the Spark session they and ``enrich rescale`` (:mod:`enrich.ops.rescale`) run in.

The state is read with Spark's state data source (``spark.read.format("statestore")``) as of a
committed batch, so it works while the job runs and after it stopped. The state step keeps a table
per hash bucket of devices (:mod:`enrich.state.stored`): a base value and the changes stored since,
rebuilt here by the processor's own :func:`enrich.state.stored.bucket_table`; a partitioned
dimension keeps its rows of a bucket as one value, with the published schema last applied to them.

:func:`device_frame` and :func:`dimension_frame` unpack every bucket on the executors (one row per
device or dimension row, for a Spark writer); :func:`device_tables` collects buckets to the driver,
for ``lookup --state``'s one bucket.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping

import pyarrow as pa
from pyspark.errors import SparkRuntimeException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema
from pyspark.sql.types import StructField, StructType

from enrich.checkpoint import CheckpointLayout
from enrich.columns import BUCKET
from enrich.config import EnrichConfig
from enrich.ipc import from_ipc
from enrich.joins.partitioned import PartitionedDim, conform
from enrich.state.engine import StateSpec
from enrich.state.record import ROLLUPS, read_record
from enrich.state.rollups import ROLLUP_PREFIX
from enrich.state.stored import CALLS_NAME, DELTAS, STATE_NAME, bucket_table
from enrich.state.stream import CHANGELOG_CONF, CHANGELOG_DEFAULT, PROVIDER_CONF, ROCKSDB
from refstream.contract import DatasetSchema

__all__ = ["call_table", "device_frame", "device_tables", "dimension_frame", "list_column", "operator_id", "scan", "session",
           "spark_schema"]

#: The state data source's error for a state variable the operator did not define as of the batch.
_NO_VARIABLE = "STDS_INVALID_OPTION_VALUE.WITH_MESSAGE"


def session(cfg: EnrichConfig, master: str | None, app: str, conf: Mapping[str, str] | None = None) -> SparkSession:
    """A Spark session that reads and writes the job's state store as the job does: the config's
    ``spark:`` settings (``conf`` in their place when given), the RocksDB provider, the changelog
    checkpointing the job wrote with."""
    from enrich.session import build_session

    base = dict(cfg.spark_conf if conf is None else conf)
    settings = {**base, PROVIDER_CONF: ROCKSDB, "spark.ui.showConsoleProgress": "false",
                CHANGELOG_CONF: cfg.spark_conf.get(CHANGELOG_CONF, CHANGELOG_DEFAULT)}
    return build_session(master, app, settings)


def scan(spark: SparkSession, ck: CheckpointLayout, batch_id: int, name: str, bucket: int | None = None) -> DataFrame:
    """The state variable ``name`` of every bucket (or of the one grouping key ``bucket``) as the
    committed batch ``batch_id`` left it."""
    df = (spark.read.format("statestore").option("path", str(ck.spark.resolve()))
          .option("batchId", batch_id).option("operatorId", operator_id(ck, name)).option("stateVarName", name).load())
    return df if bucket is None else df.filter(F.col(f"key.{BUCKET}") == bucket)


def list_column(df: DataFrame) -> str:
    """The column of a list state variable's scan (:func:`scan`) that holds its elements: one row
    each (Spark's ``flattenCollectionTypes``, on by default) or the whole list."""
    return "list_element" if "list_element" in df.columns else "value"


def operator_id(ck: CheckpointLayout, name: str) -> int:
    """Spark's id of the stateful step that keeps the state variable ``name``: Spark numbers a query's
    stateful steps from its last, so with rollups the rollup step is 0 and the state step 1."""
    if name.startswith(ROLLUP_PREFIX):
        return 0
    return 1 if ck.state_record.exists() and read_record(ck.state_record).get(ROLLUPS) else 0


def device_tables(spark: SparkSession, ck: CheckpointLayout, batch_id: int, stored: StateSpec,
                  bucket: int | None = None) -> pa.Table:
    """Every device's row of the stored state table (``stored``: :func:`enrich.state.stored.stored_spec`)
    after ``batch_id``, of every bucket or of the one grouping key ``bucket``. The buckets' values are
    collected to the driver: one row per bucket, its devices as Arrow IPC bytes."""
    values = scan(spark, ck, batch_id, STATE_NAME, bucket).select(F.col(f"key.{BUCKET}").alias("b"),
                                                                  "value.table").collect()
    if not values:
        return stored.empty()
    deltas = scan(spark, ck, batch_id, DELTAS, bucket)
    element = list_column(deltas)
    changes: dict[int, list[tuple[int, bytes, bytes]]] = {}
    for r in deltas.select(F.col(f"key.{BUCKET}").alias("b"),
                           *(F.col(f"{element}.{c}") for c in ("seq", "rows", "removed"))).collect():
        changes.setdefault(int(r[0]), []).append((r[1], r[2], r[3]))
    tables = [bucket_table(stored, bytes(v[1]), changes.get(int(v[0]), ())) for v in values]
    return pa.concat_tables(tables).combine_chunks()


def call_table(spark: SparkSession, ck: CheckpointLayout, batch_id: int, bucket: int) -> pa.Table | None:
    """The call results of the one grouping key ``bucket`` after ``batch_id`` (one row per device
    with results, :class:`enrich.calls.step.CallStep`'s schema); None when it holds none. Only that
    bucket's value is collected; None too when the batch's query ran without ``calls:`` (added since)."""
    try:
        values = scan(spark, ck, batch_id, CALLS_NAME, bucket).select("value.table").collect()
    except SparkRuntimeException as exc:
        if exc.getCondition() == _NO_VARIABLE and f"State variable {CALLS_NAME} is not defined" in str(exc):
            return None
        raise
    return from_ipc(bytes(values[0][0])) if values else None


def spark_schema(schema: pa.Schema) -> StructType:
    """``schema`` as a Spark schema of nullable columns (what ``mapInArrow`` is told it returns)."""
    return StructType([StructField(f.name, from_arrow_type(f.type), True) for f in schema])


def device_frame(spark: SparkSession, ck: CheckpointLayout, batch_id: int, stored: StateSpec,
                 rows: Callable[[pa.Table], pa.Table], schema: pa.Schema) -> DataFrame:
    """Every device after ``batch_id`` as ``rows`` makes each bucket's stored table (``stored``:
    :func:`enrich.state.stored.stored_spec`) into rows of ``schema``. Each bucket's base and changes
    are brought together by a join, and its table rebuilt in a ``mapInArrow``: on the executors, a
    bucket at a time; nothing per device reaches the driver."""
    deltas = scan(spark, ck, batch_id, DELTAS)
    element = list_column(deltas)
    changes = (deltas.groupBy(F.col(f"key.{BUCKET}").alias("b"))
               .agg(F.collect_list(F.struct(*(F.col(f"{element}.{c}").alias(c) for c in ("seq", "rows", "removed"))))
                    .alias("deltas")))
    bases = scan(spark, ck, batch_id, STATE_NAME).select(F.col(f"key.{BUCKET}").alias("b"),
                                                        F.col("value.table").alias("base"))
    out = spark_schema(schema)
    return bases.join(changes, "b", "left").mapInArrow(
        functools.partial(_bucket_rows, stored=stored, rows=rows, schema=to_arrow_schema(out, timezone="UTC")), out)


def _bucket_rows(batches: Iterator[pa.RecordBatch], *, stored: StateSpec, rows: Callable[[pa.Table], pa.Table],
                 schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        bases, deltas = batch.column("base"), batch.column("deltas")
        for i in range(batch.num_rows):
            changes = [(d["seq"], d["rows"], d["removed"]) for d in (deltas[i].as_py() or ())]
            yield from rows(bucket_table(stored, bases[i].as_py(), changes)).cast(schema).to_batches()


def dimension_frame(spark: SparkSession, ck: CheckpointLayout, batch_id: int,
                    dim: PartitionedDim) -> tuple[DataFrame, DatasetSchema | None]:
    """A partitioned dimension's rows over every bucket after ``batch_id``, unpacked on the executors
    in the types the job was planned with (``dim.stored``), and the published schema last applied to
    them (None: no bucket holds any; collected, one value per version)."""
    values = scan(spark, ck, batch_id, dim.state_name)
    schema = None
    for (text,) in values.select("value.schema").distinct().collect():
        found = DatasetSchema.from_json(bytes(text).decode("utf-8") if isinstance(text, bytes | bytearray) else text)
        if schema is None or (found.version or 0) > (schema.version or 0):
            schema = found
    out = spark_schema(dim.stored)
    return (values.select("value.table").mapInArrow(
        functools.partial(_dimension_rows, dim=dim, schema=to_arrow_schema(out, timezone="UTC")), out), schema)


def _dimension_rows(batches: Iterator[pa.RecordBatch], *, dim: PartitionedDim,
                    schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        for data in batch.column("table").to_pylist():
            got = from_ipc(data)
            yield from (got if got.schema == dim.stored else conform(dim, got)).cast(schema).to_batches()

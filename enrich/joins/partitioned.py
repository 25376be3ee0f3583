"""Partitioned dimensions: a join's reference rows kept in the state step's buckets, never on the driver.

A ``strategy: partitioned`` join is on ``state.key`` alone, so its rows hash into the same buckets
as the devices that look them up. The changelog topic is read as a second stream by the executors
(:func:`enrich.query.attach`): each record goes to its key's bucket, a schema record to
every bucket (a heartbeat to none). Within a micro-batch the processor applies a bucket's changelog
records first, in changelog order (:func:`apply_changes`), then looks its events up in the result
(:func:`lookup`, the broadcast join's own code): an event sees the dimension as of the end of the
changelog range its batch read, the version a broadcast join pins for a batch.

A bucket's rows are one value of the state store: the key and the selected columns, in the types
the join was planned with, as Arrow IPC bytes, with the last schema record applied beside them.

Driver side, :func:`published_schema` finds the dataset's schema when the job plans its query (the
output columns depend on it) by a batch read of the changelog on the executors that keeps only
schema records: the driver receives those, never the rows.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from enrich.columns import DELETED, KEY_BYTES, VALID_FROM
from enrich.dimension.history import prune, version_table
from enrich.dimension.store import decode_rows
from enrich.joins import JoinSpec, Lookup, join_table, make_lookup
from refstream import contract
from refstream.contract import DatasetSchema
from refstream.errors import ContractError, TransientError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionedDim:
    """One partitioned join, resolved on the driver against the published schema; picklable.

    ``join`` is the lookup as planned (always ``left``: an ``inner`` join drops its unmatched events
    after the state is applied, as it does with broadcast); ``stored`` the schema of a bucket's rows."""

    index: int
    dataset: str
    topic: str
    schema: DatasetSchema
    columns: tuple[str, ...]
    join: JoinSpec
    inner: bool
    stored: pa.Schema
    #: An as-of join's: how far back each key keeps its versions (None: the latest row only).
    history: timedelta | None = None

    @property
    def kind(self) -> str:
        """The packed rows' kind of this dimension's changelog records (:mod:`enrich.packed`)."""
        return f"dim{self.index}"

    @property
    def state_name(self) -> str:
        return f"dim{self.index}"

    def empty(self) -> pa.Table:
        return self.stored.empty_table()


def partitioned_dim(index: int, dataset: str, topic: str, schema: DatasetSchema, join: JoinSpec,
                    inner: bool, history: timedelta | None = None) -> PartitionedDim:
    """The dimension of a join planned by :func:`enrich.joins.resolve` (``join``) with ``inner`` off;
    an as-of join's (``history`` set) keeps versions: ``__valid_from`` and ``__deleted`` besides."""
    key = [k for _, k in join.pairs]
    columns = tuple(c for c, _ in join.columns)
    arrow = schema.arrow_schema()
    fields = [pa.field(k, arrow.field(k).type) for k in key]
    fields += [pa.field(c, t) for (c, _), t in zip(join.columns, join.out_types, strict=True)]
    fields.append(pa.field(KEY_BYTES, pa.binary()))
    if history is not None:
        fields += [pa.field(VALID_FROM, pa.int64()), pa.field(DELETED, pa.bool_())]
    return PartitionedDim(index, dataset, topic, schema, columns, join, inner, pa.schema(fields), history)


def check_schema(dim: PartitionedDim, schema: DatasetSchema) -> DatasetSchema:
    """A schema record applied to a partitioned dimension: the key must stay the planned one and
    every selected column must still be published (the output columns are fixed at start)."""
    if tuple(schema.key) != tuple(dim.schema.key):
        raise ContractError(f"dataset {dim.dataset}: its key changed from {list(dim.schema.key)} to "
                            f"{list(schema.key)}; a partitioned dimension is kept by its key: point checkpoint: "
                            "at a new directory to start over with the new key")
    missing = [c for c in dim.columns if c not in schema.names]
    if missing:
        raise ContractError(f"dataset {dim.dataset}: column(s) {', '.join(missing)} selected by a join are no "
                            f"longer in the published schema ({', '.join(schema.names)}); remove them from the "
                            "join's columns: and restart the job")
    return schema


def conform(dim: PartitionedDim, table: pa.Table, keys: list[bytes] | None = None) -> pa.Table:
    """Rows as stored: the key and selected columns in the planned types, then the key bytes
    (``keys``, else the table's own)."""
    cols = []
    for f in dim.stored:
        if f.name == KEY_BYTES:
            cols.append(pa.array(keys, pa.binary()) if keys is not None else table.column(KEY_BYTES))
            continue
        col = table.column(f.name)
        if col.type != f.type:
            try:
                col = pc.cast(col, f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                log.warning("dataset %s: column %s (%s) cannot be cast to %s, as the job planned it; nulls "
                            "until the job restarts", dim.dataset, f.name, col.type, f.type)
                col = pa.nulls(table.num_rows, f.type)
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=dim.stored)


def _apply_rows(dim: PartitionedDim, stored: pa.Table, schema: DatasetSchema, keys: list[bytes],
                values: list[bytes | None]) -> pa.Table:
    """Upserts and tombstones (in changelog order) applied to ``stored``: the last change of a key wins."""
    last = ~pd.Series(keys, dtype=object).duplicated(keep="last").to_numpy()
    changed = [keys[i] for i in np.flatnonzero(last)]
    upserts = [(keys[i], values[i]) for i in np.flatnonzero(last) if values[i] is not None]
    fresh = conform(dim, decode_rows(schema, upserts), [k for k, _ in upserts])  # type: ignore[arg-type]
    if stored.num_rows:
        keep = pc.invert(pc.is_in(stored.column(KEY_BYTES), value_set=pa.array(changed, pa.binary())))
        stored = pa.concat_tables([stored.filter(keep), fresh])
    else:
        stored = fresh
    return stored.combine_chunks()


def _apply_versions(dim: PartitionedDim, stored: pa.Table, schema: DatasetSchema, keys: list[bytes],
                    values: list[bytes | None], valid_from: np.ndarray) -> pa.Table:
    """Upserts and tombstones (in changelog order) added to an as-of dimension's versions ``stored``,
    pruned to its history (:func:`enrich.dimension.history.prune`)."""
    assert dim.history is not None
    fresh = conform(dim, version_table(schema, keys, values, valid_from))
    return prune(pa.concat_tables([stored, fresh]) if stored.num_rows else fresh, dim.history).combine_chunks()


#: The changelog columns an as-of dimension's records carry besides ``partition``, ``offset``,
#: ``key`` and ``value``: the ``valid_from`` header's text and the record's publish time.
VALID_FROM_TEXT, PUBLISHED = "valid_from", "timestamp"


def valid_from_micros(records: pa.Table) -> np.ndarray:
    """Each record's ``valid_from`` in UTC microseconds: its header, else (written before valid-from
    times existed) its publish time, else 0."""
    text = records.column(VALID_FROM_TEXT)
    at = pc.cast(pc.cast(text, pa.string()), pa.timestamp("us", tz="UTC"))
    published = pc.cast(records.column(PUBLISHED), pa.timestamp("us", tz="UTC"))
    return pc.cast(pc.coalesce(at, published), pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)


def apply_changes(dim: PartitionedDim, stored: pa.Table, schema: DatasetSchema,
                  records: pa.Table) -> tuple[pa.Table, DatasetSchema]:
    """One micro-batch of a bucket's changelog ``records`` (``partition``, ``offset``, ``key``,
    ``value``; an as-of dimension's also ``valid_from``, ``timestamp``) applied to its rows
    ``stored`` under the last applied ``schema``; returns both, new."""
    if records.num_rows == 0:
        return stored, schema
    records = records.take(pc.sort_indices(records, [("partition", "ascending"), ("offset", "ascending")]))
    keys: list[bytes] = records.column("key").to_pylist()
    values: list[bytes | None] = records.column("value").to_pylist()
    times = valid_from_micros(records) if dim.history is not None else None
    start = 0
    for i, k in enumerate([*keys, None]):
        if i < len(keys) and k not in (contract.SCHEMA_KEY, contract.HEARTBEAT_KEY):
            continue
        run = [j for j in range(start, i) if keys[j] is not None]
        if run and times is not None:
            stored = _apply_versions(dim, stored, schema, [keys[j] for j in run], [values[j] for j in run],
                                     times[run])
        elif run:
            stored = _apply_rows(dim, stored, schema, [keys[j] for j in run], [values[j] for j in run])
        if i < len(keys) and k == contract.SCHEMA_KEY:
            value = values[i]
            if value is None:
                raise ContractError(f"dataset {dim.dataset}: schema record without a value at partition "
                                    f"{records.column('partition')[i]} offset {records.column('offset')[i]}")
            schema = check_schema(dim, DatasetSchema.from_json(value))
        start = i + 1
    return stored, schema


class Version:
    """A bucket's rows of one dimension as the processor uses them; the hash index over their key
    is built at the first lookup and kept with them."""

    def __init__(self, dim: PartitionedDim, rows: pa.Table, schema: DatasetSchema) -> None:
        self.dim, self.rows, self.schema = dim, rows, schema
        self._index: Lookup | None = None

    @property
    def index(self) -> Lookup:
        if self._index is None:
            self._index = make_lookup(self.rows.drop_columns([KEY_BYTES]), [k for _, k in self.dim.join.pairs])
        return self._index

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes) * (3 if self._index is not None else 1)  # the index: about twice the rows


class VersionCache:
    """Versions of buckets' rows a Python worker keeps across micro-batches, by token, least
    recently used first out once they hold more than ``limit`` bytes. Spark reuses Python workers,
    and a bucket's dimension rows change only when its changelog does, so most calls find their
    version here. Tokens are random and new at every change: a hit is always the stored version."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[str, Version] = OrderedDict()

    def get(self, token: str) -> Version | None:
        hit = self._items.get(token)
        if hit is not None:
            self._items.move_to_end(token)
        return hit

    def put(self, token: str, version: Version) -> None:
        self._items[token] = version
        self._items.move_to_end(token)
        self._evict()

    def resize(self, limit: int) -> None:
        """Hold at most ``limit`` bytes from now on (the least recently used out at once)."""
        if limit != self.limit:
            self.limit = limit
            self._evict()

    def _evict(self) -> None:
        total = sum(v.nbytes for v in self._items.values())
        while total > self.limit and len(self._items) > 1:
            _, dropped = self._items.popitem(last=False)
            total -= dropped.nbytes

    def __len__(self) -> int:
        return len(self._items)


#: Where Spark puts a Python worker's memory budget, in MB: ``spark.executor.pyspark.memory`` divided
#: by the executor's cores (``spark.executor.cores``; Spark takes 1 when it is not set), as each worker
#: is one of that many running at once. Spark also makes it the worker's address-space limit
#: (``RLIMIT_AS``): a cache that outgrew it would fail the worker with a MemoryError. Not set without
#: ``spark.executor.pyspark.memory``.
WORKER_MEMORY_ENV = "PYSPARK_EXECUTOR_MEMORY_MB"
#: The cache's share of that budget: the same worker holds a call's events, its bucket's device
#: table and their Arrow buffers besides.
CACHE_SHARE = 0.5
#: The cache's limit when Spark gives Python workers no budget (their memory then comes out of
#: ``spark.executor.memoryOverhead``, unchecked): the size the benchmarks were measured with.
DEFAULT_CACHE_BYTES = 512 << 20


def cache_limit(environ: Mapping[str, str] | None = None) -> int:
    """The version cache's limit in bytes for the Python worker whose environment is ``environ``
    (default: this process's): :data:`CACHE_SHARE` of Spark's budget for it, else the default.

    Read in the worker rather than computed on the driver: Spark derives the budget from the
    executor's own resource profile (a stage's profile may differ from the session's settings), and
    it is the limit the worker actually runs under."""
    value = (os.environ if environ is None else environ).get(WORKER_MEMORY_ENV)
    try:
        mb = int(value) if value is not None else 0
    except ValueError:
        mb = 0
    return int((mb << 20) * CACHE_SHARE) if mb > 0 else DEFAULT_CACHE_BYTES


#: This Python worker's cache: its share of the partitioned dimensions (rows and index), sized by
#: :func:`cache_limit` (the processor sizes it again when a task starts).
CACHE = VersionCache(cache_limit())


def lookup(dim: PartitionedDim, events: pa.Table, version: Version, error_column: str | None) -> pa.Table:
    """``events`` with the join's columns and matched flag, looked up in a bucket's rows."""
    return join_table(events, dim.join, version.index, None, error_column)


# ------------------------------------------------------------------------------------------ driver

def published_schema(spark: SparkSession, settings: Mapping[str, str], dataset: str, topic: str,
                     timeout: float) -> DatasetSchema:
    """The last schema record of ``topic``, read by the executors (the driver gets schema records
    only); waits up to ``timeout`` seconds for one, as a broadcast dimension's bootstrap does."""
    from enrich.source import register, source_options
    from enrich.source.kafka import FORMAT

    register(spark)
    opts = source_options(settings, [topic], starting_offsets="earliest")
    deadline = time.monotonic() + timeout
    while True:
        rows = (spark.read.format(FORMAT).options(**opts).load()
                .where(F.col("key") == F.lit(contract.SCHEMA_KEY))
                .select("partition", "offset", "value").collect())
        if rows:
            last = max(rows, key=lambda r: (r["offset"], r["partition"]))
            schema = DatasetSchema.from_json(bytes(last["value"]))
            log.info("dataset %s: partitioned; schema %s (key %s) from %s partition %d offset %d", dataset,
                     schema.spark_ddl(), list(schema.key), topic, last["partition"], last["offset"])
            return schema
        if time.monotonic() > deadline:
            raise TransientError(f"dataset {dataset}: no schema record on changelog topic {topic} after "
                                 f"{timeout:.0f}s; is the refresher publishing it?")
        log.info("dataset %s: no schema record on %s yet; waiting", dataset, topic)
        time.sleep(1.0)

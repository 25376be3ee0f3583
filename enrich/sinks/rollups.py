"""The rollups' outputs: each rollup's rows of a micro-batch, and the batch's rollup dead letters
and counts, from the rollup step's packed values (:mod:`enrich.state.rollups`).

Kafka: one topic per rollup (``cleanup.policy=compact``), each row a record keyed by the JSON
object of the rollup's keys and ``window_start``, its value the row as JSON; a batch's rows are
written in one transaction with the batch id in the topic's ledger (the driver's transactional
writer, as the dead letters'), so a replayed batch is not written again.

Database (PostgreSQL, MariaDB/MySQL): one table per rollup, created if missing with a primary key on
(keys, ``window_start``), a row per window upserted with its latest revision; the batch's rows and
its fence row (``<table>_commits``: query, batch) in one transaction, so a replayed batch writes
nothing (the event output's database fence, :mod:`enrich.sinks.database.slots`). A window whose
keys hold a null cannot have a primary key: it is not written to the table (counted in the log).

Parquet: one directory per rollup, ``<path>/batch_id=<N>/`` per micro-batch holding every row the
batch wrote (each revision appended); written by the executors to ``<path>/_staging/`` and renamed
into place once complete, and not written again for a batch whose directory exists (a replay after
a crash), as the event output's Parquet is. The latest revision of each window is the row with the
greatest ``_revision`` per (keys, ``window_start``) (docs/rollups.md gives the query).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from enrich.columns import PACK_KIND, ROWS
from enrich.ipc import from_ipc
from enrich.rollups.config import RollupConfig
from enrich.rollups.packs import COUNTS, COUNTS_SCHEMA, DEAD, rows_kind
from enrich.rollups.spec import WINDOW_START, RollupSpec
from enrich.sinks.database.sink import check_existing, ensure, prune_fence
from enrich.sinks.database.slots import write_rows
from enrich.sinks.database.tables import TableSpec, table_spec
from enrich.sinks.deadletter import COLUMNS as DEAD_COLUMNS
from enrich.sinks.deadletter import SCHEMA as DEAD_SCHEMA
from enrich.sinks.deadletter import empty, refused, too_large
from enrich.sinks.jsonrow import dumps, json_value
from enrich.sinks.kafka.writer import TransactionalBatchWriter
from enrich.sinks.parquet import write_batch
from refstream.contract import TOPIC_CONFIG
from refstream.kafka import ensure_topic

log = logging.getLogger(__name__)

__all__ = ["RollupBatch", "RollupWriter", "rows_of"]


@dataclass(frozen=True)
class RollupBatch:
    """What a batch gave the rollups: ``dead`` letters (events beyond a horizon), ``counts``
    (rollup, result) -> events, and ``rows`` rollup -> rows written (None: written before, a replay)."""

    dead: pa.Table
    counts: dict[tuple[str, str], int]
    rows: dict[str, int | None]


def rows_of(batches: Iterable[pa.RecordBatch], *, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` (``enrich.query.rollup_rows``): the rollup rows held by packed values."""
    for batch in batches:
        for value in batch.column(ROWS).to_pylist():
            table = from_ipc(value)
            if table.num_rows:
                yield from table.cast(schema).to_batches()


class RollupWriter:
    """Writes each rollup's rows of a batch (at most once per batch id) and reads the batch's rollup
    dead letters and counts (small: collected)."""

    def __init__(self, specs: Sequence[RollupSpec], configs: Sequence[RollupConfig],
                 kafka: Mapping[str, str] | None = None, ids: Mapping[str, str] | None = None,
                 scope: str | None = None) -> None:
        """``kafka``: the librdkafka settings, ``ids``: topic -> transactional id and ``scope``: the
        query's (``enrich.sinks.identity``), for the rollups with a Kafka topic."""
        self.specs = tuple(specs)
        self.paths = tuple(c.output.parquet.resolve() if c.output.parquet is not None else None for c in configs)
        for path in self.paths:
            if path is not None:
                (path / "_staging").mkdir(parents=True, exist_ok=True)
        self.topics: list[TransactionalBatchWriter | None] = []
        self.tables: list[TableSpec | None] = []
        self.scope = scope or ""
        for spec, c in zip(self.specs, configs, strict=True):
            db = c.output.database
            if db is None:
                self.tables.append(None)
                continue
            table = table_spec(db, from_arrow_schema(spec.output_schema()).fields, (*spec.by, WINDOW_START))
            ensure(table)
            check_existing(db, table.key)
            self.tables.append(table)
        self.databases = [c.output.database for c in configs]
        try:
            for c in configs:
                topic = c.output.kafka
                if topic is None:
                    self.topics.append(None)
                    continue
                assert kafka is not None and ids is not None
                ensure_topic(kafka, topic, config=TOPIC_CONFIG)
                self.topics.append(TransactionalBatchWriter(kafka, topic, ids[topic], scope=scope))
        except BaseException:
            self.close()
            raise

    def write(self, batch_id: int, df: DataFrame, frames: Sequence[DataFrame]) -> RollupBatch:
        """``df``: a batch of the rollup step's output (``PACK_KIND``, ``ROWS``), cached by the caller;
        ``frames``: each rollup's rows in it (``enrich.query.rollup_rows``)."""
        rows: dict[str, int | None] = {}
        dead_rows: list[pa.Table] = []  # rows an output could not take, as dead letters
        # One Spark job collects what the driver writes or reads: the rows of the rollups with a
        # table or a topic, the dead letters and the counts (small: windows, not events).
        driver = {rows_kind(i) for i in range(len(self.specs)) if self.topics[i] is not None or self.tables[i] is not None}
        small = df.where(F.col(PACK_KIND).isin(DEAD, COUNTS, *driver)).select(PACK_KIND, ROWS).toArrow()
        packed: dict[str, list[pa.Table]] = {}
        for kind, value in zip(small.column(PACK_KIND).to_pylist(), small.column(ROWS).to_pylist(), strict=True):
            packed.setdefault(kind, []).append(from_ipc(value))
        for i, (spec, frame) in enumerate(zip(self.specs, frames, strict=True)):
            path, kafka, table, db = self.paths[i], self.topics[i], self.tables[i], self.databases[i]
            got = None
            if rows_kind(i) in driver:
                got = pa.concat_tables([t.cast(spec.output_schema()) for t in packed.get(rows_kind(i), [])]) \
                    if rows_kind(i) in packed else spec.output_schema().empty_table()
            # A batch without rows writes nothing anywhere (a replay has none either), so quiet
            # triggers leave no empty directories, fence rows or transactions.
            if got is not None and got.num_rows == 0:
                rows[spec.name] = 0
                continue
            if path is not None:
                rows[spec.name] = self._parquet(batch_id, frame, spec, path)
            if table is not None:
                assert got is not None
                rows[spec.name], left_out = self._database(batch_id, got, spec, table)
                dead_rows.append(left_out)
                prune_fence(db, self.scope, batch_id)
            if kafka is not None:
                assert got is not None
                rows[spec.name], left = kafka.write_fitting(batch_id, records(spec, got), f"rollup {spec.name}")
                dead_rows.append(too_large(left, f"rollup {spec.name} row", kafka.record_limit, kafka.topic))
        dead = dead_letters([*packed.get(DEAD, []), *dead_rows])
        counts = Counter[tuple[str, str]]()
        for part in packed.get(COUNTS, []):
            for r in part.cast(COUNTS_SCHEMA).to_pylist():
                counts[(r["rollup"], r["result"])] += r["events"]
        return RollupBatch(dead, dict(counts), rows)

    def _database(self, batch_id: int, rows: pa.Table, spec: RollupSpec,
                  table: TableSpec) -> tuple[int | None, pa.Table]:
        """The rows written (None: a replay) and, as dead letters, those the table would refuse."""
        keyed = pc.is_valid(rows.column(spec.by[0]))
        for b in spec.by[1:]:
            keyed = pc.and_(keyed, pc.is_valid(rows.column(b)))
        nulls = rows.num_rows - int(pc.sum(keyed).as_py() or 0)
        if nulls:
            log.warning("batch %d: rollup %s: %d row(s) with a null key not written to %s (a primary key "
                        "cannot hold one)", batch_id, spec.name, nulls, table.table)
            rows = rows.filter(keyed)
        written, left, reasons = write_rows(table, self.scope, batch_id, rows, f"rollup {spec.name}")
        return written, refused(records(spec, left), reasons, f"rollup {spec.name} row", table.table)

    def close(self) -> None:
        for writer in self.topics:
            if writer is not None:
                writer.close()

    def _parquet(self, batch_id: int, df: DataFrame, spec: RollupSpec, path: Path) -> int | None:
        final = path / f"batch_id={batch_id}"
        if final.exists():
            log.info("batch %d: rollup %s: %s exists (a replay); not written again", batch_id, spec.name, final)
            return None
        return write_batch(path, batch_id, df.write.parquet, keep_empty=False)  # no isEmpty() job first


def records(spec: RollupSpec, rows: pa.Table) -> pa.Table:
    """Rollup rows as Kafka records (``key``, ``value``): the key the JSON object of the rollup's
    keys and ``window_start``, the value the row; times as ``2026-01-01T00:00:00.000000Z``."""
    keys, values = [], []
    for row in rows.cast(spec.output_schema()).to_pylist():
        row = {k: json_value(v) for k, v in row.items()}
        keys.append(dumps({**{b: row[b] for b in spec.by}, WINDOW_START: row[WINDOW_START]}))
        values.append(dumps(row))
    return pa.table({"key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.binary())})


def dead_letters(parts: Iterable[pa.Table]) -> pa.Table:
    """The batch's rollup dead letters in one table of one schema: the step's (Spark's types: an
    int32 partition) and the rows an output could not take (:mod:`enrich.sinks.deadletter`'s)."""
    got = [t.select(list(DEAD_COLUMNS)).cast(DEAD_SCHEMA) for t in parts if t.num_rows]
    return pa.concat_tables(got) if got else empty()

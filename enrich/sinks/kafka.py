"""Kafka output: JSON values, key = the event's key, one transaction per micro-batch.

The batch is computed once (good and dead-letter rows together, collected as Arrow) and handed to
``enrich.kafka.TransactionalBatchWriter``, which commits the records and a batch marker atomically and
skips a batch id it has committed before: exactly-once effect for ``read_committed`` consumers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

from enrich.deadletter import COLUMNS as DEAD_COLUMNS
from enrich.deadletter import too_large_error
from enrich.events import ERROR, SLOW, SOURCE
from enrich.sinks.abc import EnrichedBatch

log = logging.getLogger(__name__)


class KafkaSink:
    reparses = True

    def __init__(self, settings: Mapping[str, str], topic: str, transactional_id: str,
                 scope: str | None = None) -> None:
        from enrich.kafka import TransactionalBatchWriter

        self.topic = topic
        self._writer = TransactionalBatchWriter(dict(settings), topic, transactional_id, scope=scope)

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        t0 = time.monotonic()
        table = self._too_large_to_dead_letters(collect(batch))
        t1 = time.monotonic()
        failed = pc.is_valid(table.column(ERROR))
        good = table.filter(pc.invert(failed)).select(["key", "value"])
        self._writer.write(batch_id, good)
        log.info("batch %d: %d events computed and collected in %.2fs, written in %.2fs", batch_id,
                 table.num_rows, t1 - t0, time.monotonic() - t1)
        return table.filter(failed).select(list(DEAD_COLUMNS))

    def _too_large_to_dead_letters(self, table: pa.Table) -> pa.Table:
        """Enriched events too large for the producer become dead letters (reason ``too_large``,
        the enriched value as the dead letter's value, cut to fit there): one such event must
        not fail the batch again on every restart."""
        limit = self._writer.record_limit
        size = pc.add(pc.fill_null(pc.binary_length(table.column("value")), 0),
                      pc.fill_null(pc.binary_length(table.column("key")), 0))
        over = pc.and_(pc.is_null(table.column(ERROR)), pc.greater(size, limit))
        if not pc.any(over).as_py():
            return table
        sizes = size.to_pylist()
        at = np.flatnonzero(over.to_numpy(zero_copy_only=False))
        errors = table.column(ERROR).to_pylist()
        values = table.column("_value").to_pylist()
        for i in at:
            errors[i] = too_large_error("enriched event", sizes[i], limit)
            log.warning("event at %s/%s offset %s: %s; sent to the dead-letter topic", table.column("_topic")[i],
                        table.column("_partition")[i], table.column("_offset")[i], errors[i])
        enriched = table.column("value").to_pylist()
        for i in at:
            values[i] = enriched[i]
        table = table.set_column(table.schema.get_field_index(ERROR), ERROR,
                                 pa.array(errors, table.schema.field(ERROR).type))
        table = table.set_column(table.schema.get_field_index("_value"), "_value",
                                 pa.array(values, table.schema.field("_value").type))
        key_col = table.column("key")
        if "_key" in table.column_names:
            keys = table.column("_key").to_pylist()
            src = key_col.to_pylist()
            for i in at:
                keys[i] = src[i]
            table = table.set_column(table.schema.get_field_index("_key"), "_key",
                                     pa.array(keys, table.schema.field("_key").type))
        return table

    def close(self) -> None:
        self._writer.close()


def collect(batch: EnrichedBatch) -> pa.Table:
    """The batch as Arrow: ``key``, ``value`` (the JSON of a good event) and the dead-letter columns,
    in event order. Rows the fast parser left to Spark are redone through ``batch.redo`` and put back
    where their events were, so that the order of events within a Kafka partition is kept."""
    has_slow = SLOW in batch.df.columns
    raw = F.col(ERROR).isNotNull() | F.col(SLOW) if has_slow else F.col(ERROR).isNotNull()
    good = F.col(ERROR).isNull() & ~F.col(SLOW) if has_slow else F.col(ERROR).isNull()
    # Positions are kept for every row: a dead letter made later (too_large) names its source.
    position = ("_topic", "_partition", "_offset")
    table = batch.df.select(
        F.col("_key").alias("key"),
        F.when(good, batch.json_value()).cast("binary").alias("value"),
        *[F.col(c) if c in position else F.when(raw, F.col(c)).alias(c) for c in DEAD_COLUMNS],
        *([F.col(SLOW)] if has_slow else [])).toArrow()
    if not has_slow:
        return table
    slow = table.column(SLOW).to_numpy(zero_copy_only=False)
    table = table.drop_columns([SLOW])
    if not slow.any():
        return table
    assert batch.redo is not None, "a batch with slow rows needs redo"
    at = np.flatnonzero(slow)
    raw_rows = table.take(pa.array(at)).select(list(SOURCE))
    redone = collect(batch.redo(raw_rows))
    where = {(p, o): int(i) for p, o, i in zip(raw_rows.column("_partition").to_pylist(),
                                              raw_rows.column("_offset").to_pylist(), at, strict=True)}
    redone_at = [where[(p, o)] for p, o in zip(redone.column("_partition").to_pylist(),
                                                redone.column("_offset").to_pylist(), strict=True)]
    log.debug("%d of %d events parsed by Spark", len(at), len(slow))
    keep = np.flatnonzero(~slow)
    merged = pa.concat_tables([table.take(pa.array(keep)), redone.cast(table.schema)])
    order = np.argsort(np.concatenate([keep, np.asarray(redone_at, dtype=np.int64)]), kind="stable")
    return merged.take(pa.array(order))

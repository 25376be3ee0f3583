"""Kafka output: JSON values, key = the event's key, one transaction per micro-batch.

The batch is computed once (good and dead-letter rows together, collected as Arrow) and handed to
``enrich.kafka.TransactionalBatchWriter``, which commits the records and a batch marker atomically and
skips a batch id it has committed before: exactly-once effect for ``read_committed`` consumers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

from enrich.deadletter import COLUMNS as DEAD_COLUMNS
from enrich.events import ERROR
from enrich.sinks.abc import EnrichedBatch

log = logging.getLogger(__name__)


class KafkaSink:
    def __init__(self, settings: Mapping[str, str], topic: str, transactional_id: str,
                 scope: str | None = None) -> None:
        from enrich.kafka import TransactionalBatchWriter

        self.topic = topic
        self._writer = TransactionalBatchWriter(dict(settings), topic, transactional_id, scope=scope)

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        df = batch.df.select(
            F.col("_key").alias("key"),
            F.when(F.col(ERROR).isNull(), batch.json_value()).cast("binary").alias("value"),
            *[F.when(F.col(ERROR).isNotNull(), F.col(c)).alias(c) for c in DEAD_COLUMNS])
        table = df.toArrow()
        failed = pc.is_valid(table.column(ERROR))
        good = table.filter(pc.invert(failed)).select(["key", "value"])
        self._writer.write(batch_id, good)
        return table.filter(failed).select(list(DEAD_COLUMNS))

    def close(self) -> None:
        close = getattr(self._writer, "close", None)
        if close is not None:
            close()

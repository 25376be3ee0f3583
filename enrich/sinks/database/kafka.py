"""The database output together with Kafka: each task writes its slot's table rows in a database
transaction that commits inside the slot's Kafka transaction's commit step, just before
``commit_transaction`` (:meth:`enrich.sinks.kafka.tasks.TaskWriter.companion`). So a read_committed
consumer that sees a slot's records finds the database already holding their rows.

Each side is written once: a slot whose Kafka ledger says the batch is committed skips both (its
database transaction committed before); a slot whose database transaction committed and whose
Kafka commit did not happen (a crash between the two) finds its fence row on the replay and writes
only the Kafka side again, under the Kafka sink's own protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame

from enrich.columns import ERROR
from enrich.config import EnrichConfig
from enrich.sinks.abc import EnrichedBatch
from enrich.sinks.database.sink import DatabaseSink, SlotRows, drop_connection, task_connection
from enrich.sinks.database.slots import write_slot
from enrich.sinks.kafka.sink import KafkaSink, records_frame
from enrich.sinks.kafka.tasks import TaskWriter, too_large_to_dead_letters
from enrich.sinks.kafka.writer import record_limit
from refstream.errors import RefstreamError

__all__ = ["DatabaseKafkaSink", "DatabaseKafkaTaskWriter"]

#: The prefix of the table's columns in the rows the Kafka tasks get.
PREFIX = "__db_"


@dataclass(frozen=True)
class DatabaseKafkaTaskWriter(TaskWriter):
    """The Kafka sink's task writer, with the slot's table rows (the ``__db_`` columns) committed
    to the database just before the Kafka transaction."""

    rows: SlotRows | None = None
    query_id: str = ""

    def companion(self, slot: int) -> DatabaseSlot:
        return DatabaseSlot(self, slot)

    def written(self, slot: int) -> None:
        """Called after the slot's rows went into the database, before its transactions commit;
        nothing here (a test hook)."""


class DatabaseSlot:
    """One task's table rows, collected as its records go to Kafka, written when it commits."""

    def __init__(self, writer: DatabaseKafkaTaskWriter, slot: int) -> None:
        self.w, self.slot = writer, slot
        self.limit = record_limit(writer.settings)
        self.parts: list[pa.Table] = []
        #: Rows written at the commit; None: the fence row was there (written before).
        self.written: int | None = 0

    def take(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """The table's part of ``batch``; the Kafka part back, where a row the database would
        refuse is a dead letter (its enriched value as the value, as a record too large is), so
        that it is in neither output; and a record too large for Kafka is in neither either."""
        names = batch.schema.names
        ours = [n for n in names if n.startswith(PREFIX)]
        full = too_large_to_dead_letters(pa.Table.from_batches([batch]), self.limit)
        t = full.select(ours).rename_columns([n[len(PREFIX):] for n in ours])
        assert self.w.rows is not None
        error = full.column(ERROR)
        why = self.w.rows.refusals(t)
        refused = pc.and_(pc.is_null(error), pc.is_valid(why))
        if pc.any(refused).as_py():
            for name, value in ((ERROR, why), ("_value", full.column("value")), ("_key", full.column("key"))):
                i = full.schema.get_field_index(name)
                full = full.set_column(i, name, pc.if_else(refused, value, full.column(name)))
            error = full.column(ERROR)
        self.parts.append(t.filter(pc.is_null(error)))
        out = full.select([n for n in names if not n.startswith(PREFIX)]).combine_chunks().to_batches()
        return out[0] if out else batch.select([n for n in names if not n.startswith(PREFIX)])

    def committing(self) -> None:
        w = self.w
        assert w.rows is not None
        table, _, _ = w.rows.table(self.parts)
        if not table.num_rows:
            return
        spec = w.rows.spec
        try:
            self.written = write_slot(task_connection(spec), spec, w.query_id, self.slot, w.batch_id, table,
                                      written=lambda: w.written(self.slot))
        except RefstreamError:
            drop_connection(spec)
            raise

    def close(self) -> None:
        self.parts = []


class DatabaseKafkaSink(KafkaSink):
    """``output.database`` with ``output.kafka``: the Kafka sink whose tasks also write the table."""

    def __init__(self, cfg: EnrichConfig, event_fields: Sequence[str], transactional_id: str, scope: str) -> None:
        assert cfg.output.topic is not None
        super().__init__(cfg.kafka, cfg.output.topic, transactional_id, cfg.dead_letter_topic, scope)
        self.database = DatabaseSink(cfg, event_fields, scope)

    def task_writer(self, batch_id: int, batch: EnrichedBatch) -> TaskWriter:
        plan = self.database.plan(batch)
        return DatabaseKafkaTaskWriter(self.settings, self.topic, self.dead_letter_topic, self.ledger_topic,
                                       self.transactional_id, self.scope, batch_id,
                                       rows=self.database.slot_rows(plan, batch, batch_id), query_id=str(self.scope))

    def frame(self, batch: EnrichedBatch) -> DataFrame:
        plan = self.database.plan(batch)
        return records_frame(batch, self.database.good_rows(plan, batch, PREFIX))

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        dead = super().write(batch_id, batch)
        self.database.finish(batch_id)
        return dead

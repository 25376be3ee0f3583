"""Kafka output: JSON values, key = the event's key, written by the executors, exactly once.

The driver builds the batch's output rows (:func:`records_frame`: the enriched JSON of good events,
the source columns of dead letters) and runs ``enrich.sinks.kafka.tasks.TaskWriter`` over them in a
``mapInArrow``: each task commits its own partition of the output and of the dead letters in one
Kafka transaction, recorded in its slot's ledger (:mod:`enrich.sinks.kafka.ledger`). The driver collects one row of counts
per task, never an event.

A task whose rows hold an event the fast parser left to ``from_json`` (``_slow``) writes nothing and
asks for its slot to be written again from ``from_json``'s parse: :attr:`KafkaSink.pending` after
:meth:`KafkaSink.write`; the job then writes those slots from the exact plan (same input ranges,
same slots), with the same batch id.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping, Sequence

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from enrich.columns import CORRECTION, ERROR, IDENTITY, KIND, KIND_CORRECTION, LATE, SLOW, TAIL, UNMATCHED
from enrich.failures import transient_cause
from enrich.sinks.abc import Counted, EnrichedBatch
from enrich.sinks.deadletter import COLUMNS as DEAD_COLUMNS
from enrich.sinks.kafka.ledger import ensure_ledger
from enrich.sinks.kafka.tasks import RESULT_DDL, TaskWriter, summary
from enrich.sinks.kafka.values import Fused, RecordMaker, supported

log = logging.getLogger(__name__)



class KafkaSink:
    """``transactional_id`` is the base of the tasks' ids (``<base>-<slot>``)."""

    writes_dead_letters = True
    reparses = True
    counts: tuple[str, ...] = ("enriched", "unmatched", "late", "dead_letters")  # in the tasks

    def __init__(self, settings: Mapping[str, str], topic: str, transactional_id: str, dead_letter_topic: str,
                 scope: str | None = None) -> None:
        self.topic, self.dead_letter_topic = topic, dead_letter_topic
        self.transactional_id, self.scope = transactional_id, scope
        self.settings = dict(settings)
        self.ledger_topic = ensure_ledger(self.settings, topic)
        #: The tasks' result rows of the last batch written (``enrich.sinks.kafka.tasks.RESULT_DDL``).
        self.last_results: list[dict[str, object]] = []
        #: Slots of the last batch written that are to be written again from ``from_json``'s parse.
        self.pending: tuple[int, ...] = ()
        #: The tasks' counts of the last write: exact, each task's result row is collected once.
        self.counted = Counted(0, 0, 0, 0)

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        empty = pa.table({c: pa.array([], pa.null()) for c in DEAD_COLUMNS})
        self.pending = ()
        self.last_results = []
        self.counted = Counted(0, 0, 0, 0)
        t0 = time.monotonic()
        writer = self.task_writer(batch_id, batch)
        fused = self.fused(batch)
        if fused is not None:
            frame = fused[0]
            writer = dataclasses.replace(writer, upstream=fused[1])
        else:
            frame = self.frame(batch)
        try:
            rows = [r.asDict() for r in frame.mapInArrow(writer, RESULT_DDL).collect()]
        except Exception as exc:
            # A task that failed transiently (broker away) fails the Spark job: the batch is tried
            # again, and the tasks that committed skip it by their ledgers.
            transient = transient_cause(exc)
            if transient is not None:
                raise transient from exc
            raise
        self.last_results = rows
        records, unmatched, late, dead, fixed = (sum(int(str(r[c])) for r in rows) for c in (
            "records", "unmatched", "late", "dead_letters", "corrections"))
        self.counted = Counted(records - fixed, unmatched, late, dead, fixed)
        self.pending = tuple(sorted(int(str(r["slot"])) for r in rows if r["redo"]))
        records, dead, skipped = summary(rows)
        log.info("batch %d: %d records and %d dead letters written by %d task(s) (%d skipped as committed, "
                 "%d left to from_json) in %.2fs; writers: %s", batch_id, records, dead, len(rows), skipped,
                 len(self.pending), time.monotonic() - t0,
                 ", ".join(f"slot {r['slot']} in {r['worker']}" for r in rows if not r["redo"]))
        log.info("batch %d: task times: %s", batch_id, "; ".join(_times(r) for r in rows))
        for r in rows:
            log.debug("batch %d: %s", batch_id, r)
            if r["leaked"]:
                log.warning("batch %d slot %s: %s records of an aborted attempt were visible already (the broker "
                            "shows aborted transactions) and were not written again", batch_id, r["slot"], r["leaked"])
        return empty

    def task_writer(self, batch_id: int, batch: EnrichedBatch) -> TaskWriter:
        """The tasks' writer of ``batch``."""
        return TaskWriter(self.settings, self.topic, self.dead_letter_topic, self.ledger_topic,
                          self.transactional_id, self.scope, batch_id)

    def frame(self, batch: EnrichedBatch) -> DataFrame:
        """What the tasks get of ``batch``: :func:`records_frame`."""
        return records_frame(batch)

    def fused(self, batch: EnrichedBatch) -> tuple[DataFrame, Fused] | None:
        """What the tasks get of ``batch`` and make the records of themselves (the join pass and the
        JSON in the writer's worker, :mod:`enrich.sinks.kafka.values`), or None: :meth:`frame`
        makes them in the JVM (a subclass whose rows are more than the records, an output type
        the Python JSON does not write)."""
        if type(self).frame is not KafkaSink.frame or batch.before is None or batch.schema is None:
            return None
        fields = {f.name: f for f in batch.schema.fields}
        ident = [c for c in IDENTITY if c in fields and c not in batch.columns]
        tail = [c for c in TAIL if c in fields]  # with corrections: columns; else _kind, the same in every row
        values = StructType([fields[c] for c in (*batch.columns, *ident, *tail)])
        if not supported(values):
            return None
        tz = batch.before.sparkSession.conf.get("spark.sql.session.timeZone") or "UTC"
        maker = RecordMaker(values, batch.matched, tz) if not tail else RecordMaker(values, batch.matched, tz, ())
        return batch.before, Fused(batch.step, maker)

    def close(self) -> None:
        pass


def _times(row: Mapping[str, object]) -> str:
    """A task's times (``enrich.sinks.kafka.tasks.RESULT_DDL``) for the batch's log line."""
    return (f"slot {row['slot']} {float(str(row['seconds'])):.2f}s (setup done at {float(str(row['setup'])):.2f}s, "
            f"first rows at {float(str(row['first_rows'])):.2f}s, commit {float(str(row['commit'])):.2f}s)")


def records_frame(batch: EnrichedBatch, extra: Sequence[Column] = ()) -> DataFrame:
    """The batch's output rows in event order: ``key``, ``value`` (the JSON of a good event, null
    for a dead letter) and the dead-letter columns (``_key`` and ``_value`` of dead letters only;
    the positions of every row: a dead letter made later, ``too_large``, names its source), and
    ``_slow`` from the fast parser (those rows' values are null); the flags the tasks count:
    ``_unmatched`` when the batch has joins, ``_late`` when it has the state step's ``_late``."""
    slow = SLOW in batch.df.columns
    good = F.col(ERROR).isNull() & ~F.col(SLOW) if slow else F.col(ERROR).isNull()
    position = ("_topic", "_partition", "_offset")
    flags: dict[str, Column] = {}
    if batch.matched:
        matched = [F.coalesce(F.col(f"`{m}`"), F.lit(False)) for m in batch.matched]
        flags[UNMATCHED] = ~functools.reduce(lambda a, b: a & b, matched)
    if LATE in batch.df.columns:
        flags[LATE] = F.coalesce(F.col(LATE), F.lit(False))
    if KIND in batch.df.columns:  # with corrections: counted apart, never as unmatched or late
        fixed = F.col(KIND) == F.lit(KIND_CORRECTION)
        flags = {n: F.when(fixed, F.lit(False)).otherwise(f) for n, f in flags.items()}
        flags[CORRECTION] = fixed
    return batch.df.select(
        F.col("_key").alias("key"),
        F.when(good, batch.json_value()).cast("binary").alias("value"),
        *[F.col(c) if c in position else F.when(F.col(ERROR).isNotNull(), F.col(c)).alias(c) for c in DEAD_COLUMNS],
        *([F.col(SLOW)] if slow else []), *(f.alias(n) for n, f in flags.items()), *extra)

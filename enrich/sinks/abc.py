"""The sink interface: one micro-batch of enriched events in, its dead letters out.

A sink must be idempotent per batch id (a batch replayed after a crash is written at most once)
and returns the batch's dead-letter rows (``enrich.sinks.deadletter.COLUMNS``) for the dead-letter topic,
unless it writes them itself (``writes_dead_letters``: the Kafka sink, in the tasks' transactions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from enrich.columns import ERROR, IDENTITY, KIND, KIND_EVENT, TAIL
from enrich.sinks.deadletter import COLUMNS as DEAD_COLUMNS

#: How enriched events are written as JSON: nulls kept (an unmatched join shows as nulls), microseconds kept.
JSON_OPTIONS = {"ignoreNullFields": "false", "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
                "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS"}


@dataclass(frozen=True)
class EnrichedBatch:
    """``df`` holds the output ``columns`` plus ``_error`` and the Kafka source columns, and for a
    sink that ``reparses``, the fast parser's ``_slow`` flag (such rows hold no parsed fields).
    ``matched`` names the joins' ``_<dataset>_matched`` columns among ``columns``.

    ``df`` is ``before`` through the join pass ``step`` (a ``mapInArrow`` function giving ``schema``;
    None: ``df`` is ``before``) when those are given: a sink may run the pass in a task of its own
    instead (the Kafka output does: ``enrich.sinks.kafka.values``)."""

    df: DataFrame
    columns: tuple[str, ...]
    matched: tuple[str, ...] = ()
    before: DataFrame | None = None
    step: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = None
    schema: StructType | None = None

    def good(self) -> DataFrame:
        """The good events as written: the output columns, then :meth:`tail`."""
        return self.df.filter(F.col(ERROR).isNull()).select(*[F.col(f"`{c}`") for c in self.columns], *self.tail())

    def tail(self) -> list[Column]:
        """What ends every enriched event: where it was read (``_topic``, ``_partition``, ``_offset``)
        and what it is (``_kind``: ``event``; with corrections, the column, then ``_revision`` and
        ``_cause``: enrich.state.corrections)."""
        ident = [F.col(c) for c in IDENTITY if c in self.df.columns and c not in self.columns]
        tail = [F.col(c) for c in TAIL if c in self.df.columns]
        return [*ident, *(tail or [F.lit(KIND_EVENT).alias(KIND)])]

    def dead_letters(self) -> pa.Table:
        return self.df.filter(F.col(ERROR).isNotNull()).select(*DEAD_COLUMNS).toArrow()

    def json_value(self) -> Column:
        """An event's JSON: the output columns, then :meth:`tail`. The identity makes every output
        record unique, so a retried task that counts the records already in the log as its own (a
        broker that shows aborted transactions) never takes another task's record for one of its
        own when two events carry the same bytes."""
        return F.to_json(F.struct(*[F.col(f"`{c}`") for c in self.columns], *self.tail()), JSON_OPTIONS)


@dataclass(frozen=True)
class Counted:
    """What a sink counted of the events its last :meth:`Sink.write` wrote; None: not counted by it.
    ``unmatched`` (some join found no row) and ``late`` (``_late`` true) count among ``enriched``."""

    enriched: int | None = None
    unmatched: int | None = None
    late: int | None = None
    dead_letters: int | None = None
    corrections: int | None = None


class Sink(Protocol):
    #: True when :meth:`write` writes the dead letters itself (and returns none).
    writes_dead_letters: bool
    #: True when :meth:`write` takes the fast parser's rows (``_slow`` set on the events it left to
    #: ``from_json``) and leaves the slots holding such rows in :attr:`pending`.
    reparses: bool
    #: After :meth:`write`: slots (partition indexes of the batch's plan) to be written again, with
    #: the same batch id, from the batch parsed by ``from_json``.
    pending: tuple[int, ...]
    #: After :meth:`write`: what it counted of the events it wrote.
    counted: Counted
    #: The fields of :attr:`counted` this sink counts (``Counted`` field names); the job counts the
    #: batch's late events and the dead letters it collects when the sink does not.
    counts: tuple[str, ...]

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        """Write the good events of ``batch`` (at most once per batch id); return its dead letters."""

    def close(self) -> None: ...

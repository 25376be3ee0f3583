"""Events into the state step: parsed, joined, checked, bucketed and packed in Python passes.

Two ``mapInArrow`` passes (:class:`EventPacker`) bring the Kafka records to the step
(``enrich.query.attach``):

1. *fast*: pyarrow parses the values it parses exactly (``enrich.events.fastparse``); those events go
   through the in-plan joins, get ``_error`` when their state key or time is null, their event time
   in microseconds and their bucket's grouping key (:class:`enrich.state.layout.BucketLayout`, from
   Spark's own ``hash``),
   and leave packed (:func:`enrich.packed.pack`). The values the fast parser leaves
   (``_slow``) leave as they came, as Kafka records;
2. *rest*: Spark's ``from_json`` (``enrich.events.parse``) has parsed those records in the plan in
   between; this pass gives them the same treatment and packs them, and passes the packed rows of
   the first pass through.

So ``from_json`` runs on the rare values pyarrow leaves, never on the others, and the events cross
from the JVM to Python once. Where the fast parser cannot parse the event schema, the first pass is
left out and the second one takes every event from ``from_json``.

An event more than ``state.max_future_skew`` ahead of its micro-batch's time (``_batch_time``: Spark's
``current_timestamp()`` of the batch, recorded in the offset log, so a replay judges every event as
the first attempt did) is a dead letter too. A dead letter's ``_ts_us`` is null: the watermark, taken
on each packed chunk's greatest ``_ts_us``, never moves for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from enrich import packed
from enrich.columns import BATCH_TIME, BUCKET, ERROR, MAX_TS, ROWS, SLOW, SOURCE, TS_US
from enrich.events import FastEvents
from enrich.joins import JoinSpec, Lookup, PlanEnricher
from enrich.state.layout import BucketLayout
from enrich.worker import settle
from refstream.config import format_duration

#: The Kafka columns of a record the fast pass leaves to ``from_json``, as the source names them.
RAW = tuple(SOURCE.values())


def key_is_null(key: str) -> str:
    """The dead-letter reason of an event without a state key."""
    return f"state.key {key} is null"


def time_is_null(timestamp: str) -> str:
    """The dead-letter reason of an event without an event time."""
    return f"state.timestamp {timestamp} is null"


def key_too_long(key: str, size: int, limit: int) -> str:
    """The dead-letter reason of an event whose state key is ``size`` bytes, more than ``limit``."""
    return f"state.key {key} is {size} bytes, more than state.max_key_bytes {limit}"


def too_far_ahead(micros: int, skew: timedelta) -> str:
    """The dead-letter reason of an event whose time (``micros`` since the epoch) is more than
    ``skew`` ahead of its batch's time."""
    try:
        at = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)).isoformat().replace("+00:00", "Z")
    except OverflowError:  # beyond year 9999 (Spark's TIMESTAMP goes further)
        at = f"{micros} us after 1970-01-01T00:00:00Z"
    return f"event time {at} is more than {format_duration(skew)} ahead of the clock"


@dataclass(frozen=True)
class EventPacker:
    """The ``mapInArrow`` function of either pass (see the module doc); picklable.

    ``events`` is the schema of the packed event tables, the same from both passes (the processor
    concatenates them): the parsed fields, ``_error``, the Kafka columns, the in-plan joins' columns
    and ``_ts_us``. ``out`` is the pass's output schema: the packed rows (``_bucket``, ``_max_ts``,
    ``rows``) and, in the fast pass, the :data:`RAW` columns of the records it leaves.
    ``max_future_skew``: how far ahead of the input's :data:`~enrich.columns.BATCH_TIME` an event
    may be (None, or no such column: no limit)."""

    key: str
    timestamp: str
    layout: BucketLayout
    events: pa.Schema
    out: pa.Schema
    joins: tuple[JoinSpec, ...] = ()
    parse: FastEvents | None = None     # set: the fast pass; None: the rest pass
    max_future_skew: timedelta | None = None
    keep_values: bool = False           # every event keeps ``_value`` (a call may make it a dead letter later)
    max_key_bytes: int | None = None    # a longer string or binary key makes the event a dead letter

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        settle()
        enricher = PlanEnricher(self.joins, ERROR)
        lookups: dict[str, tuple[Lookup, Lookup | None]] | None = None
        for b in batches:
            if b.num_rows == 0:
                continue
            now_us = _batch_time_us(b)
            if self.parse is not None:
                table, left = self._fast(b)
                if left is not None:
                    yield left
            elif ROWS not in b.schema.names:  # no fast pass: every event comes from from_json
                table = pa.Table.from_batches([b])
            else:
                done = b.column(ROWS).is_valid()
                if pc.any(done).as_py():
                    yield self._out(b.filter(done), (BUCKET, MAX_TS, ROWS))
                table = pa.Table.from_batches([b]).filter(pc.invert(done)).drop_columns([BUCKET, MAX_TS, ROWS])
            if table.num_rows == 0:
                continue
            if self.joins:
                if lookups is None:  # a task without rows fetches no version
                    lookups = enricher.lookups()
                table = enricher.join(table, lookups)
            for packed_batch in packed.pack([self._checked(table, now_us)], bucket=BUCKET, timestamp=TS_US,
                                            packed_schema=self._packed_schema()):
                yield self._out(packed_batch, (BUCKET, MAX_TS, ROWS))

    def _fast(self, b: pa.RecordBatch) -> tuple[pa.Table, pa.RecordBatch | None]:
        """The events the fast parser took, with their original ``_value`` (a later dead letter
        needs it), and the records it left, as output rows."""
        assert self.parse is not None
        table = self.parse(b)
        slow = table.column(SLOW).combine_chunks()
        table = table.drop_columns([SLOW]).set_column(table.schema.get_field_index("_value"), "_value",
                                                       b.column("_value"))
        if not pc.any(slow).as_py():
            return table, None
        left = pa.Table.from_batches([b]).filter(slow)
        raw = pa.RecordBatch.from_arrays([left.column(f"_{c}").combine_chunks() for c in RAW], names=list(RAW))
        return table.filter(pc.invert(slow)), self._out(raw, RAW)

    def _checked(self, table: pa.Table, now_us: int | None = None) -> pa.Table:
        """``table`` as the step takes it: ``_error`` set on events without a state key or time, or
        too far ahead of the batch's time ``now_us``; ``_value`` kept in dead letters only;
        ``_ts_us`` (null in dead letters) and ``_bucket`` added."""
        table = self._long_keys(table)
        key, ts = table.column(self.key), table.column(self.timestamp)
        error = table.column(ERROR)
        no_key, no_ts = pc.is_null(key), pc.is_null(ts)
        error = pc.if_else(pc.is_valid(error), error,
                           pc.if_else(no_key, pa.scalar(key_is_null(self.key)),
                                      pc.if_else(no_ts, pa.scalar(time_is_null(self.timestamp)),
                                                 pa.scalar(None, pa.string()))))
        micros = ts.cast(pa.timestamp("us", ts.type.tz)).cast(pa.int64())
        if self.max_future_skew is not None and now_us is not None:
            error = self._ahead(error, micros, now_us + self.max_future_skew // timedelta(microseconds=1))
        table = table.set_column(table.schema.get_field_index(ERROR), ERROR, error)
        value = table.column("_value")
        dead = pc.is_valid(error)
        if not self.keep_values:
            table = table.set_column(table.schema.get_field_index("_value"), "_value",
                                     pc.if_else(dead, value, pa.scalar(None, value.type)))
        # The state never applies a dead letter; nor may the watermark (each chunk's greatest _ts_us)
        # move for one: a single clock years ahead would otherwise expire every device for good.
        table = table.append_column(TS_US, pc.if_else(dead, pa.scalar(None, pa.int64()), micros))
        table = table.select(self.events.names)
        if table.schema != self.events:
            table = table.cast(self.events)
        return table.append_column(BUCKET, pa.array(self.layout.of(key), pa.int32()))

    def _long_keys(self, table: pa.Table) -> pa.Table:
        """``table`` with ``_error`` set on events whose key is longer than ``max_key_bytes``, and
        their key nulled: a megabyte key would otherwise travel through the state step and cost
        every pass over it (the dead letter keeps the event's original bytes)."""
        key = table.column(self.key)
        if self.max_key_bytes is None or not (pa.types.is_string(key.type) or pa.types.is_binary(key.type)
                                              or pa.types.is_large_string(key.type)
                                              or pa.types.is_large_binary(key.type)):
            return table
        sizes = pc.binary_length(key)
        long_ = pc.fill_null(pc.greater(sizes, self.max_key_bytes), False).combine_chunks()
        if not pc.any(long_).as_py():
            return table
        error = table.column(ERROR)
        values = sizes.combine_chunks()
        reasons: list[str | None] = [None] * len(long_)
        for i in np.flatnonzero(long_.to_numpy(zero_copy_only=False)):  # rare: a message for these only
            reasons[i] = key_too_long(self.key, values[int(i)].as_py(), self.max_key_bytes)
        error = pc.if_else(pc.and_(long_, pc.is_null(error)), pa.array(reasons, pa.string()), error)
        table = table.set_column(table.schema.get_field_index(ERROR), ERROR, error)
        return table.set_column(table.schema.get_field_index(self.key), self.key,
                                pc.if_else(long_, pa.scalar(None, key.type), key))

    def _ahead(self, error: pa.ChunkedArray, micros: pa.ChunkedArray, limit_us: int) -> pa.ChunkedArray:
        """``error`` with the reason of every event not yet a dead letter whose time is after ``limit_us``."""
        ahead = pc.fill_null(pc.and_(pc.is_null(error), pc.greater(micros, limit_us)), False).combine_chunks()
        if not pc.any(ahead).as_py():
            return error
        assert self.max_future_skew is not None
        values = micros.combine_chunks()
        reasons: list[str | None] = [None] * len(ahead)
        for i in np.flatnonzero(ahead.to_numpy(zero_copy_only=False)):  # rare: a message for these only
            reasons[i] = too_far_ahead(values[int(i)].as_py(), self.max_future_skew)
        return pc.if_else(ahead, pa.array(reasons, pa.string()), error)

    def _packed_schema(self) -> pa.Schema:
        return pa.schema([self.out.field(BUCKET), self.out.field(MAX_TS), self.out.field(ROWS)])

    def _out(self, batch: pa.RecordBatch | pa.Table, names: tuple[str, ...]) -> pa.RecordBatch:
        """``batch``'s ``names`` columns in the pass's output schema, the others null."""
        n = batch.num_rows
        cols = [batch.column(f.name) if f.name in names else pa.nulls(n, f.type) for f in self.out]
        arrays = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in cols]
        arrays = [a if a.type == f.type else a.cast(f.type) for a, f in zip(arrays, self.out, strict=True)]
        return pa.RecordBatch.from_arrays(arrays, schema=self.out)


def _batch_time_us(b: pa.RecordBatch) -> int | None:
    """The micro-batch's time in ``b`` (the same in every row), in microseconds; None without it."""
    if BATCH_TIME not in b.schema.names:
        return None
    col = b.column(BATCH_TIME)
    now = pc.max(col.cast(pa.timestamp("us", col.type.tz)).cast(pa.int64())).as_py()
    return int(now) if now is not None else None


def events_schema(fields: pa.Schema) -> pa.Schema:
    """The packed events' schema from the Arrow schema of the parsed (and in-plan joined) events."""
    return pa.schema([*fields, pa.field(TS_US, pa.int64())])

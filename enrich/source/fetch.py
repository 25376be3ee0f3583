"""Executor side of the source: read one offset range of one partition into Arrow record batches.

A range ``[start, end)`` is read exactly: records at or past ``end`` are dropped and reading stops
as soon as ``end`` is reached, by a record at ``end - 1`` or later, or by partition EOF at or past
``end``. Offsets the reader never sees (transaction markers, aborted records under read_committed)
make a range hold fewer records than ``end - start``; that is expected, not data loss.

``Consumer.consume(n, timeout)`` waits for ``n`` messages or the timeout, so it is asked for no more
than the range can still hold and with a short timeout: the tail of a range never costs seconds.
Consumers are kept per Python worker process (Spark reuses workers) and re-assigned per task.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from pyspark.sql.datasource import InputPartition

from enrich.worker import settle
from refstream.errors import DataError, TransientError
from refstream.kafka import offset_of, shared_consumer

log = logging.getLogger(__name__)

SCHEMA_DDL = ("key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP, "
              "timestampType INT, headers ARRAY<STRUCT<key: STRING, value: BINARY>>")
"""The columns of Spark's built-in Kafka source (with ``includeHeaders``)."""

HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
ARROW_SCHEMA = pa.schema([
    ("key", pa.binary()), ("value", pa.binary()), ("topic", pa.string()), ("partition", pa.int32()),
    ("offset", pa.int64()), ("timestamp", pa.timestamp("us", tz="UTC")), ("timestampType", pa.int32()),
    ("headers", HEADERS_TYPE),
])

#: What the source gives with its ``ranges`` option, in place of the records: one row per task, the
#: offsets ``[start, end)`` of one partition, which the task reads itself (:class:`RangeReader`).
RANGE_DDL = "topic STRING, partition INT, start BIGINT, end BIGINT"
RANGE_SCHEMA = pa.schema([("topic", pa.string()), ("partition", pa.int32()), ("start", pa.int64()),
                          ("end", pa.int64())])

BATCH_MESSAGES = 20_000
POLL_TIMEOUT = 0.05


@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """One Spark task's work: offsets ``[start, end)`` of one partition."""

    topic: str
    partition: int
    start: int
    end: int


#: The columns every read gives; the timestamp's and the headers' follow when asked for.
CORE = ("key", "value", "topic", "partition", "offset")


def _to_batch(msgs: list[Message], topic: str, partition: int, full: bool = True) -> pa.RecordBatch:
    n = len(msgs)
    core = [
        pa.array([m.key() for m in msgs], pa.binary()),
        pa.array([m.value() for m in msgs], pa.binary()),
        pa.array([topic] * n, pa.string()),
        pa.array(np.full(n, partition, dtype=np.int32)),
        pa.array(np.fromiter((m.offset() for m in msgs), dtype=np.int64, count=n)),
    ]
    if not full:
        return pa.RecordBatch.from_arrays(core, schema=pa.schema(list(ARROW_SCHEMA)[:len(CORE)]))
    ts = [m.timestamp() for m in msgs]
    ts_type = np.fromiter((t[0] for t in ts), dtype=np.int32, count=n)
    ts_ms = np.fromiter((t[1] for t in ts), dtype=np.int64, count=n)
    # librdkafka: 0 none, 1 create time, 2 log append time; Spark/Java: -1, 0, 1.
    ts_missing = ts_type == 0
    headers = [m.headers() for m in msgs]
    if any(h is not None for h in headers):
        headers_col = pa.array(headers, type=HEADERS_TYPE)
    else:
        headers_col = pa.nulls(n, HEADERS_TYPE)
    return pa.RecordBatch.from_arrays([
        *core,
        pa.array(ts_ms * 1000, type=pa.timestamp("us", tz="UTC"), mask=ts_missing if ts_missing.any() else None),
        pa.array(ts_type - 1),
        headers_col,
    ], schema=ARROW_SCHEMA)


def range_batch(rng: OffsetRange) -> pa.RecordBatch:
    """The one :data:`RANGE_SCHEMA` row of ``rng``."""
    return pa.RecordBatch.from_pydict({"topic": [rng.topic], "partition": [rng.partition], "start": [rng.start],
                                       "end": [rng.end]}, schema=RANGE_SCHEMA)


@dataclass(frozen=True)
class RangeReader:
    """The ``mapInArrow`` step that reads the records of the ranges it is given (:data:`RANGE_SCHEMA`
    rows, the source's ``ranges`` option) where it runs, so that they never cross into the JVM: as
    :data:`ARROW_SCHEMA` batches, or with ``columns`` only those, renamed (``{new: old}``). A column
    of a range's row beyond the range's own (the batch's time, say) is repeated on each of its records."""

    settings: dict[str, str]
    poll_timeout_s: float
    fail_on_data_loss: bool
    columns: dict[str, str] | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        settle()
        full = self.columns is None or not set(self.columns.values()) <= set(CORE)
        for b in batches:
            extra = [n for n in b.schema.names if n not in RANGE_SCHEMA.names]
            for i, r in enumerate(b.to_pylist()):
                rng = OffsetRange(r["topic"], r["partition"], r["start"], r["end"])
                for rec in read_range(self.settings, rng, poll_timeout_s=self.poll_timeout_s,
                                      fail_on_data_loss=self.fail_on_data_loss, full=full):
                    if self.columns is not None:
                        rec = pa.RecordBatch.from_arrays([rec.column(old) for old in self.columns.values()],
                                                         names=list(self.columns))
                    if extra:
                        at = pa.array(np.full(rec.num_rows, i, dtype=np.int64))
                        rec = pa.RecordBatch.from_arrays([*rec.columns, *[b.column(n).take(at) for n in extra]],
                                                         names=[*rec.schema.names, *extra])
                    yield rec


def read_range(settings: Mapping[str, str], rng: OffsetRange, *, poll_timeout_s: float = 120.0,
               fail_on_data_loss: bool = True, full: bool = True) -> Iterator[pa.RecordBatch]:
    """Yield the records of ``rng`` as Arrow batches of :data:`ARROW_SCHEMA` (without ``full``, of
    its :data:`CORE` columns only: no timestamps and headers made of every record).

    Raises :class:`TransientError` when the range's end is not reached within ``poll_timeout_s``
    without progress, :class:`DataError` when records of the range were deleted (retention) and
    ``fail_on_data_loss`` is set.
    """
    if rng.end <= rng.start:
        return
    c = shared_consumer(settings, role="fetch")
    tp = TopicPartition(rng.topic, rng.partition, rng.start)
    c.assign([tp])
    try:
        next_offset = rng.start  # offsets below it are done (read, or skipped by the broker)
        first = True
        last_progress = time.monotonic()
        while next_offset < rng.end:
            want = min(BATCH_MESSAGES, rng.end - next_offset + 1)  # +1: room for the EOF event
            msgs = c.consume(want, timeout=POLL_TIMEOUT)
            if not msgs:
                if time.monotonic() - last_progress > poll_timeout_s:
                    raise TransientError(
                        f"reading {rng.topic}/{rng.partition} [{rng.start}, {rng.end}): stuck at offset "
                        f"{next_offset} for {poll_timeout_s:.0f}s")
                continue
            records = msgs
            if any(m.error() is not None for m in msgs):
                records = []
                for m in msgs:
                    err = m.error()
                    if err is None:
                        records.append(m)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        if offset_of(m) >= rng.end and m.partition() == rng.partition and m.topic() == rng.topic:
                            next_offset = max(next_offset, offset_of(m))
                    elif err.fatal() or not (err.retriable() or err.code() == KafkaError._TRANSPORT):
                        raise TransientError(f"reading {rng.topic}/{rng.partition}: {err}")
                    else:
                        log.warning("reading %s/%d: %s (retrying)", rng.topic, rng.partition, err)
            if records:
                if first:
                    first = False
                    _check_data_loss(c, rng, offset_of(records[0]), fail_on_data_loss)
                if offset_of(records[-1]) >= rng.end:
                    cut = 0
                    while cut < len(records) and offset_of(records[cut]) < rng.end:
                        cut += 1
                    records = records[:cut]
                    next_offset = rng.end
                if records:
                    next_offset = max(next_offset, offset_of(records[-1]) + 1)
                    yield _to_batch(records, rng.topic, rng.partition, full)
            last_progress = time.monotonic()
        if first:
            # Not one record: the range may be all transaction markers and aborted records, or
            # entirely deleted (the consumer was moved to the log start, at or past its end).
            _check_data_loss(c, rng, None, fail_on_data_loss)
    finally:
        c.unassign()


def lost_offsets(rng: OffsetRange, first: int | None, low: int | None) -> tuple[int, int] | None:
    """The offsets of ``rng`` deleted before they were read, given the first offset read (None:
    no record) and the partition's log start ``low`` (None: unknown); None when nothing is lost.
    A first record past the start alone is no loss (transaction markers, aborted records)."""
    if low is None or low < 0 or low <= rng.start or (first is not None and first <= rng.start):
        return None
    return rng.start, min(low, rng.end)


def _check_data_loss(c: Consumer, rng: OffsetRange, first: int | None, fail: bool) -> None:
    if first is not None and first <= rng.start:
        return
    low, _ = c.get_watermark_offsets(TopicPartition(rng.topic, rng.partition), cached=True)
    gone = lost_offsets(rng, first, low)
    if gone is None:
        return
    msg = (f"topic {rng.topic} partition {rng.partition}: offsets [{gone[0]}, {gone[1]}) were deleted (retention) "
           "before they were read")
    if fail:
        raise DataError(f"{msg}; set failOnDataLoss (events.fail_on_data_loss) to false to skip them")
    log.warning("%s: skipped (failOnDataLoss=false)", msg)

"""The dead-letter topic: events that could not be parsed, with the error and the original bytes.

Record: key and value are the original event's key and value, byte for byte; headers ``error``,
``source.topic``, ``source.partition``, ``source.offset`` say what went wrong and where it came from.
A record larger than the producer's ``message.max.bytes`` (an enriched event, a rollup row, a gap
record, or a dead letter itself) gets ``reason: too_large`` and ``original.size`` headers and its
value cut to fit: it never fails the batch. For an enriched event the value is the enriched JSON (cut), its key the output key.
Written per micro-batch in one Kafka transaction that is skipped when the batch id was committed
already, so a replayed batch does not duplicate dead letters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

log = logging.getLogger(__name__)

#: Columns a sink hands over for dead letters.
COLUMNS = ("_error", "_key", "_value", "_topic", "_partition", "_offset")
HEADERS_TYPE = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))


#: Reason of a record too large for the producer: it is dead-lettered with its value cut to fit.
TOO_LARGE = "too_large"


def too_large_error(what: str, size: int, limit: int) -> str:
    return f"{TOO_LARGE}: {what} of {size} bytes is larger than the {limit} bytes a record may have (message.max.bytes)"


def to_records(bad: pa.Table, limit: int | None = None) -> pa.Table:
    """Dead-letter rows as ``key``, ``value``, ``headers`` for the transactional writer. A record
    larger than ``limit`` bytes (key + value + headers) keeps its key and headers; its value is cut
    to fit and its headers say so (``reason: too_large``, ``original.size``)."""
    rows = bad.select(list(COLUMNS)).to_pylist()
    keys, values, headers = [], [], []
    for r in rows:
        key, value = r["_key"], r["_value"]
        # A dead letter that is no event (:func:`unpositioned`) has no position.
        hdr = [{"key": "error", "value": (r["_error"] or "").encode()},
               {"key": "source.topic", "value": str(r["_topic"]).encode()},
               *[{"key": f"source.{f}", "value": str(r[f"_{f}"]).encode()} for f in ("partition", "offset")
                 if r[f"_{f}"] is not None]]
        size = len(key or b"") + len(value or b"") + sum(len(h["key"]) + len(h["value"]) for h in hdr)
        if limit is not None and size > limit:
            if not (r["_error"] or "").startswith(TOO_LARGE):
                hdr[0]["value"] = (too_large_error("dead letter", size, limit) + "; " + (r["_error"] or "")).encode()
            hdr += [{"key": "reason", "value": TOO_LARGE.encode()},
                    {"key": "original.size", "value": str(len(value or b"")).encode()}]
            hdr[0]["value"] = hdr[0]["value"][:1024]
            key = None if key is not None and len(key) > limit // 4 else key  # a key that large cannot be kept
            room = limit - len(key or b"") - sum(len(h["key"]) + len(h["value"]) for h in hdr)
            value = None if value is None else value[:max(room, 0)]
        keys.append(key)
        values.append(value)
        headers.append(hdr)
    return pa.table({"key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.binary()),
                     "headers": pa.array(headers, HEADERS_TYPE)})


#: The dead letters' columns as this module makes them (:func:`unpositioned`, :func:`empty`).
SCHEMA = pa.schema([("_error", pa.string()), ("_key", pa.binary()), ("_value", pa.binary()), ("_topic", pa.string()),
                    ("_partition", pa.int64()), ("_offset", pa.int64())])


def empty() -> pa.Table:
    """No dead letters, as :data:`SCHEMA`."""
    return SCHEMA.empty_table()


def unpositioned(errors: Sequence[str], recs: pa.Table, output: str) -> pa.Table:
    """Dead letters (:data:`SCHEMA`) of records that are no event - a rollup row, a gap record - which
    their output could not take: ``recs`` their Kafka records (``key``, ``value``), ``_topic`` the
    output (a topic or a table), no partition or offset (:func:`to_records` then writes no
    ``source.partition`` or ``source.offset`` header)."""
    n = recs.num_rows
    return pa.table({"_error": pa.array(list(errors), pa.string()), "_key": recs.column("key"),
                     "_value": recs.column("value"), "_topic": pa.array([output] * n, pa.string()),
                     "_partition": pa.nulls(n, pa.int64()), "_offset": pa.nulls(n, pa.int64())}, schema=SCHEMA)


def too_large(left: pa.Table, what: str, limit: int, topic: str) -> pa.Table:
    """:func:`unpositioned` dead letters of the records (``key``, ``value``) ``topic`` could not take,
    larger than ``limit``; ``what`` names one (``rollup device_1m row``)."""
    size = pc.add(pc.fill_null(pc.binary_length(left.column("key")), 0),
                  pc.fill_null(pc.binary_length(left.column("value")), 0)).to_pylist()
    return unpositioned([too_large_error(what, n, limit) for n in size], left, topic)


def refused(recs: pa.Table, reasons: Sequence[str], what: str, table: str) -> pa.Table:
    """:func:`unpositioned` dead letters of rows ``table`` would refuse (``reasons``, one per row),
    as their Kafka records ``recs``; ``what`` names one."""
    return unpositioned([f"{what} refused by {table}: {r}" for r in reasons], recs, table)


class DeadLetters:
    """Exactly-once writer of dead letters to ``topic``."""

    def __init__(self, settings: Mapping[str, str], topic: str, transactional_id: str, scope: str | None = None) -> None:
        from enrich.sinks.kafka.writer import TransactionalBatchWriter

        self.topic = topic
        self._writer = TransactionalBatchWriter(dict(settings), topic, transactional_id, scope=scope)
        self.total = 0

    def write(self, batch_id: int, bad: pa.Table) -> None:
        if bad.num_rows == 0:
            return
        # Per-row Python is fine here: dead letters are the exception, not the hot path.
        self._writer.write(batch_id, to_records(bad, self._writer.record_limit))
        self.total += bad.num_rows
        log.warning("batch %d: %d dead letter(s) to topic %s (first: %s)", batch_id, bad.num_rows,
                    self.topic, bad.column("_error")[0].as_py())

    def close(self) -> None:
        self._writer.close()

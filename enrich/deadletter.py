"""The dead-letter topic: events that could not be parsed, with the error and the original bytes.

Record: key and value are the original event's key and value, byte for byte; headers ``error``,
``source.topic``, ``source.partition``, ``source.offset`` say what went wrong and where it came from.
Written per micro-batch in one Kafka transaction that is skipped when the batch id was committed
already, so a replayed batch does not duplicate dead letters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pyarrow as pa

log = logging.getLogger(__name__)

#: Columns a sink hands over for dead letters.
COLUMNS = ("_error", "_key", "_value", "_topic", "_partition", "_offset")
HEADERS_TYPE = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))


def to_records(bad: pa.Table) -> pa.Table:
    """Dead-letter rows as ``key``, ``value``, ``headers`` for the transactional writer."""
    rows = bad.select(list(COLUMNS)).to_pylist()
    headers = [[{"key": "error", "value": (r["_error"] or "").encode()},
                {"key": "source.topic", "value": str(r["_topic"]).encode()},
                {"key": "source.partition", "value": str(r["_partition"]).encode()},
                {"key": "source.offset", "value": str(r["_offset"]).encode()}] for r in rows]
    return pa.table({"key": pa.array([r["_key"] for r in rows], pa.binary()),
                     "value": pa.array([r["_value"] for r in rows], pa.binary()),
                     "headers": pa.array(headers, HEADERS_TYPE)})


class DeadLetters:
    """Exactly-once writer of dead letters to ``topic``."""

    def __init__(self, settings: Mapping[str, str], topic: str, transactional_id: str, scope: str | None = None) -> None:
        from enrich.kafka import TransactionalBatchWriter

        self.topic = topic
        self._writer = TransactionalBatchWriter(dict(settings), topic, transactional_id, scope=scope)
        self.total = 0

    def write(self, batch_id: int, bad: pa.Table) -> None:
        if bad.num_rows == 0:
            return
        # Per-row Python is fine here: dead letters are the exception, not the hot path.
        self._writer.write(batch_id, to_records(bad))
        self.total += bad.num_rows
        log.warning("batch %d: %d event(s) to dead-letter topic %s (first: %s)", batch_id, bad.num_rows,
                    self.topic, bad.column("_error")[0].as_py())

    def close(self) -> None:
        self._writer.close()

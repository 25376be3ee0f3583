"""``df.writeStream.format("refstream-kafka")``: an at-least-once streaming sink.

Each Spark task produces its rows from the executor with an idempotent producer and flushes before
it returns its commit message, so a batch Spark commits is durable in Kafka. A batch that fails and
is retried may be written again (at-least-once); for exactly-once use ``foreachBatch`` with
:class:`~enrich.kafka.writer.TransactionalBatchWriter`.

Input columns (as for Spark's Kafka sink): ``value`` (binary or string, required), ``key`` (binary or
string), ``topic`` (string; required unless the ``topic`` option is set), ``headers``
(array<struct<key string, value binary>>), ``partition`` (int).
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
from confluent_kafka import KafkaError, Message, Producer
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, IntegerType, StringType, StructType

from enrich.kafka.options import SinkOptions
from refstream.errors import ConfigError, TransientError

log = logging.getLogger(__name__)

FLUSH_TIMEOUT = 120.0


@dataclass
class KafkaCommitMessage(WriterCommitMessage):
    records: int


def check_schema(schema: StructType, topic_option: str | None) -> None:
    """Fail fast, on the driver, with the column at fault."""
    fields = {f.name: f.dataType for f in schema.fields}
    text = (BinaryType(), StringType())
    if fields.get("value") not in text:
        raise ConfigError(f"refstream-kafka sink: a 'value' column of type binary or string is required, "
                          f"got columns {schema.simpleString()}")
    if "key" in fields and fields["key"] not in text:
        raise ConfigError(f"refstream-kafka sink: column 'key' must be binary or string, not {fields['key']}")
    if "topic" in fields and fields["topic"] != StringType():
        raise ConfigError("refstream-kafka sink: column 'topic' must be a string")
    if "partition" in fields and fields["partition"] != IntegerType():
        raise ConfigError("refstream-kafka sink: column 'partition' must be an int")
    if topic_option is None and "topic" not in fields:
        raise ConfigError("refstream-kafka sink: set option 'topic' or provide a 'topic' column")


_PRODUCERS: dict[tuple[tuple[str, str], ...], Producer] = {}


def _producer(settings: Mapping[str, str]) -> Producer:
    key = tuple(sorted(settings.items()))
    p = _PRODUCERS.get(key)
    if p is None:
        p = Producer({"linger.ms": 20, "batch.size": 1 << 20, "compression.type": "lz4",
                      "partitioner": "murmur2_random", "acks": "all", **settings,
                      "enable.idempotence": True})
        _PRODUCERS[key] = p
    return p


@atexit.register
def _flush_producers() -> None:
    for p in _PRODUCERS.values():
        p.flush(10)


def _bytes_list(col: pa.Array | pa.ChunkedArray) -> list:
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return [None if v is None else v.encode() for v in col.to_pylist()]
    return col.to_pylist()


class KafkaStreamWriter(DataSourceStreamArrowWriter):
    """Executor-side producing; see the module docstring for columns and guarantees."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.options = SinkOptions.parse(options)
        check_schema(schema, self.options.topic)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> KafkaCommitMessage:
        p = _producer(self.options.settings)
        failures: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                failures.append(err)

        n = 0
        for batch in iterator:
            names = batch.schema.names
            values = _bytes_list(batch.column("value"))
            keys = _bytes_list(batch.column("key")) if "key" in names else None
            topics = batch.column("topic").to_pylist() if "topic" in names else None
            parts = batch.column("partition").to_pylist() if "partition" in names else None
            headers = batch.column("headers").to_pylist() if "headers" in names else None
            for i, value in enumerate(values):
                topic = (topics[i] if topics is not None else None) or self.options.topic
                kwargs = {}
                if parts is not None and parts[i] is not None:
                    kwargs["partition"] = parts[i]
                if headers is not None and headers[i]:
                    kwargs["headers"] = [(h["key"], h["value"]) for h in headers[i]]
                while True:
                    try:
                        p.produce(topic, value, keys[i] if keys is not None else None,
                                  on_delivery=on_delivery, **kwargs)
                        break
                    except BufferError:
                        p.poll(0.05)
                if i & 0x3FFF == 0:
                    p.poll(0)
            n += len(values)
        left = p.flush(FLUSH_TIMEOUT)
        if left:
            raise TransientError(f"refstream-kafka sink: {left} records not delivered in {FLUSH_TIMEOUT:.0f}s")
        if failures:
            raise TransientError(f"refstream-kafka sink: {len(failures)} records failed, first: {failures[0]}")
        return KafkaCommitMessage(records=n)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        total = sum(m.records for m in messages if isinstance(m, KafkaCommitMessage))
        log.info("refstream-kafka sink: batch %d committed, %d records", batchId, total)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        # Produced records cannot be taken back; the retried batch writes them again (at-least-once).
        log.warning("refstream-kafka sink: batch %d aborted", batchId)

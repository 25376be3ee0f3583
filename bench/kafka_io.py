"""Throughput of the Kafka I/O of the enrichment job, on its own (no parsing, no join).

    .venv/bin/python -m bench.kafka_io --records 1000000 --partitions 4

Measures, against an embedded broker (or ``--bootstrap``):
1. plain confluent-kafka consume of the topic in one process (the per-process ceiling);
2. the ``refstream-kafka`` source: Spark local[N] reading the topic into the ``noop`` sink with
   ``trigger(availableNow=True)``, wall time including query start, and the per-batch rate Spark reports;
3. the transactional writer: one Arrow table of the same records written in micro-batches.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack

import pyarrow as pa

from bench.common import broker_settings
from refstream.kafka import consumer, ensure_topic, producer
from refstream.logs import setup_logging

log = logging.getLogger(__name__)


def fill(settings: dict[str, str], topic: str, n: int, partitions: int, size: int) -> float:
    p = producer(settings, role="bulk", **{"linger.ms": 50})
    pad = b"x" * max(0, size - 40)
    started = time.monotonic()
    for i in range(n):
        value = b'{"device_id":"dev-%07d","seq":%d,"p":"' % (i % 100_000, i) + pad + b'"}'
        while True:
            try:
                p.produce(topic, value[:size], key=b"dev-%07d" % (i % 100_000), partition=i % partitions)
                break
            except BufferError:
                p.poll(0.05)
    p.flush(120)
    return n / (time.monotonic() - started)


def plain_consume(settings: dict[str, str], topic: str, n: int) -> float:
    from confluent_kafka import TopicPartition

    from refstream.kafka import partitions_of

    c = consumer(settings)
    c.assign([TopicPartition(topic, p, 0) for p in partitions_of(settings, topic)])
    got, started = 0, time.monotonic()
    while got < n:
        for m in c.consume(10_000, timeout=0.5):
            if m.error() is None:
                got += 1
    rate = got / (time.monotonic() - started)
    c.close()
    return rate


def spark_source(settings: dict[str, str], topic: str, n: int, master: str, max_per_trigger: int | None
                 ) -> tuple[float, float, int]:
    from enrich.query import read_stream
    from enrich.session import build_session

    spark = build_session(master, "bench-kafka-io", {"spark.driver.memory": "2g"})
    try:
        # Warm-up: JVM, Python workers and the source's code paths.
        warm = read_stream(spark, settings, [topic], starting_offsets="earliest", max_offsets_per_trigger=1000)
        with tempfile.TemporaryDirectory() as cp:
            q = warm.writeStream.format("noop").option("checkpointLocation", cp).trigger(once=True).start()
            q.awaitTermination()
        df = read_stream(spark, settings, [topic], starting_offsets="earliest",
                         max_offsets_per_trigger=max_per_trigger)
        with tempfile.TemporaryDirectory() as cp:
            started = time.monotonic()
            q = df.writeStream.format("noop").option("checkpointLocation", cp).trigger(availableNow=True).start()
            q.awaitTermination()
            wall = time.monotonic() - started
            progress = q.recentProgress
        for p in progress:
            log.info("batch %s: %s rows, %s", p["batchId"], p["numInputRows"], p["durationMs"])
        rows = sum(p["numInputRows"] for p in progress)
        busy = sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000.0
        return rows / wall, rows / busy if busy else 0.0, rows
    finally:
        spark.stop()


def transactional_write(settings: dict[str, str], n: int, partitions: int, size: int, batch: int) -> float:
    from enrich.sinks.kafka.writer import TransactionalBatchWriter

    topic = f"bench-out-{uuid.uuid4().hex[:8]}"
    ensure_topic(settings, topic, partitions=partitions)
    keys = [b"dev-%07d" % (i % 100_000) for i in range(batch)]
    values = [(b'{"device_id":"dev-%07d","seq":%d,"p":"' % (i % 100_000, i) + b"x" * size)[:size]
              for i in range(batch)]
    table = pa.table({"key": pa.array(keys, pa.binary()), "value": pa.array(values, pa.binary())})
    w = TransactionalBatchWriter(settings, topic, f"bench-{uuid.uuid4().hex[:8]}")
    started = time.monotonic()
    written = 0
    for batch_id in range(max(1, n // batch)):
        written += w.write(batch_id, table)
    rate = written / (time.monotonic() - started)
    w.close()
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kafka_io", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--size", type=int, default=150, help="value bytes")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--max-per-trigger", type=int, default=None)
    ap.add_argument("--write-batch", type=int, default=100_000)
    ap.add_argument("--bootstrap", help="an existing broker instead of an embedded one")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of: plain,source,writer")
    args = ap.parse_args(argv)
    setup_logging(logging.INFO if args.verbose else logging.WARNING)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    skip = set(filter(None, args.skip.split(",")))
    with ExitStack() as stack:
        settings = broker_settings(stack, args.bootstrap)
        topic = f"bench-in-{uuid.uuid4().hex[:8]}"
        ensure_topic(settings, topic, partitions=args.partitions)
        rate = fill(settings, topic, args.records, args.partitions, args.size)
        print(f"filled {args.records} x {args.size} B into {args.partitions} partitions: {rate:,.0f} msgs/s")
        if "plain" not in skip:
            print(f"plain confluent-kafka consume, 1 process: {plain_consume(settings, topic, args.records):,.0f} msgs/s")
        if "source" not in skip:
            wall, busy, rows = spark_source(settings, topic, args.records, args.master, args.max_per_trigger)
            print(f"refstream-kafka source, {args.master}, {rows} rows: {wall:,.0f} events/s wall "
                  f"(incl. query start), {busy:,.0f} events/s in batches")
        if "writer" not in skip:
            rate = transactional_write(settings, args.records, args.partitions, args.size, args.write_batch)
            print(f"TransactionalBatchWriter, batches of {args.write_batch}: {rate:,.0f} events/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

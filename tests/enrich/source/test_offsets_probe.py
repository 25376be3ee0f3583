"""The end-offset probe while a producer writes all the time (a live event stream)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from confluent_kafka import Producer

from enrich.source.offsets import EndOffsetProbe
from refstream.kafka import ensure_topic


def test_probe_answers_quickly_while_a_producer_writes_continuously(kafka: dict[str, str],
                                                                     unique: Callable[[str], str]) -> None:
    topic = unique("src-live")
    ensure_topic(kafka, topic, partitions=1)
    produced = [0]  # the topic's end is at most this count (its delivery reports may lag)
    stop = threading.Event()

    def write() -> None:
        p = Producer({**kafka, "linger.ms": 2})
        while not stop.is_set():
            for _ in range(20):
                produced[0] += 1  # before the record can reach the broker
                p.produce(topic, b"e" * 150, partition=0)
            p.poll(0.005)
        p.flush(10)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    probe = EndOffsetProbe(kafka)  # 5 s deadline: a probe waiting for EOF would take that long
    try:
        time.sleep(1.0)
        last = 0
        for _ in range(5):
            started = time.monotonic()
            end = probe.probe([(topic, 0)], {(topic, 0): last}).end[(topic, 0)]
            took = time.monotonic() - started
            high = produced[0]
            assert took < 2.0, f"probe took {took:.1f}s"
            assert last < end <= high, (last, end, high)
            last = end
            time.sleep(0.2)
    finally:
        stop.set()
        writer.join(15)
        probe.close()

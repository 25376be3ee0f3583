"""The end-offset probe while a producer writes all the time (a live event stream), and when the broker stops answering."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer

from demo.broker import EmbeddedBroker
from enrich.source.offsets import EndOffsetProbe
from refstream.kafka import ensure_topic
from tests.enrich.source.test_kafka import produce
from tests.timing import bound


def test_probe_answers_quickly_while_a_producer_writes_continuously(kafka: dict[str, str],
                                                                     unique: Callable[[str], str]) -> None:
    topic = unique("src-live")
    ensure_topic(kafka, topic, partitions=1)
    produced = [0]  # the topic's end is at most this count (its delivery reports may lag)
    delivered = [0]  # and at least this one
    stop = threading.Event()

    def acked(err: object, _msg: object) -> None:
        if err is None:
            delivered[0] += 1

    def write() -> None:
        p = Producer({**kafka, "linger.ms": 2})
        while not stop.is_set():
            for _ in range(20):
                produced[0] += 1  # before the record can reach the broker
                p.produce(topic, b"e" * 150, partition=0, on_delivery=acked)
            p.poll(0.005)
        p.flush(10)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    probe = EndOffsetProbe(kafka)  # 5 s deadline: a probe waiting for EOF would take that long
    try:
        last = 0
        for _ in range(5):
            # The producer is writing: the broker holds records past the last end found (a loaded
            # machine may hold the writer back for a while, which is not what is tested here).
            deadline = time.monotonic() + bound(30)
            while delivered[0] <= last and time.monotonic() < deadline:
                time.sleep(0.01)
            assert delivered[0] > last, f"the producer delivered nothing past {last}"
            # This broker may acknowledge a record before its fetches return it (seen: the end found
            # at the last one with 240 more acknowledged): each probe must answer quickly and never
            # overshoot, and one of them within the round finds records past the last end.
            while True:
                started = time.monotonic()
                end = probe.probe([(topic, 0)], {(topic, 0): last}).end[(topic, 0)]
                took = time.monotonic() - started
                high = produced[0]
                assert took < min(bound(2.0), 4.0), f"probe took {took:.1f}s"  # below the 5 s deadline
                assert last <= end <= high, (last, end, high)
                if end > last:
                    break
                assert time.monotonic() < deadline, f"no probe found a record past {last}"
                time.sleep(0.05)
            last = end
    finally:
        stop.set()
        writer.join(15)
        probe.close()


@pytest.mark.integration  # starts a broker of its own
def test_a_partition_that_does_not_answer_keeps_its_start_offset(tmp_path: Path,
                                                                 unique: Callable[[str], str]) -> None:
    """The broker stops answering (SIGSTOP) once the probe has listed the partition's end: the probe
    gives up at its deadline and answers the known start, not a guess, and the next probe, with the
    broker back, finds the true end."""
    broker = EmbeddedBroker(log_path=tmp_path / "broker.log").start()
    settings = {"bootstrap.servers": broker.bootstrap}
    topic = unique("src-silent")
    ensure_topic(settings, topic, partitions=1)
    produce(settings, topic, [(None, f"e{i}".encode(), 0) for i in range(5)])
    assert broker.proc is not None

    class Silenced(EndOffsetProbe):
        def listed_end(self, tp: tuple[str, int]) -> tuple[int, int]:
            listed = super().listed_end(tp)
            pid = broker.proc.pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGSTOP)
            # The signal stops the broker when it is next scheduled; on a loaded machine that can be
            # after the probe's first fetch: wait until the kernel says it is stopped.
            stat = Path(f"/proc/{pid}/stat")
            deadline = time.monotonic() + bound(10)
            while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
                assert time.monotonic() < deadline, "the broker did not stop"
                time.sleep(0.005)
            return listed

    probe = Silenced(settings, deadline=1.0)
    try:
        t0 = time.monotonic()
        result = probe.probe([(topic, 0)], {(topic, 0): 2})
        took = time.monotonic() - t0
        assert result.end[(topic, 0)] == 2, result
        assert took < bound(6), f"probe took {took:.1f}s"
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
        probe.close()
    again = EndOffsetProbe(settings)
    try:
        assert again.probe([(topic, 0)], {(topic, 0): 2}).end[(topic, 0)] == 5
    finally:
        again.close()
        broker.stop()

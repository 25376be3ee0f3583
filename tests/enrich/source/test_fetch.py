"""A task's read of its offset range (enrich.source.fetch) when the range's end never comes."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from enrich.source.fetch import OffsetRange, read_range
from refstream.errors import TransientError
from refstream.kafka import ensure_topic
from tests.enrich.source.test_kafka import produce
from tests.timing import bound


def test_a_range_whose_end_never_comes_fails_after_the_poll_timeout(kafka: dict[str, str],
                                                                      unique: Callable[[str], str]) -> None:
    """``kafkaConsumer.pollTimeoutMs``: three records of a range planned to end at 10 (as a range
    would whose records were lost to a broker that came back empty); the read yields them, then
    fails transiently after the timeout without progress, naming the partition and the offset."""
    topic = unique("src-stall")
    ensure_topic(kafka, topic, partitions=1)
    produce(kafka, topic, [(None, f"e{i}".encode(), 0) for i in range(3)])
    got = []
    t0 = time.monotonic()
    with pytest.raises(TransientError, match=rf"reading {topic}/0 \[0, 10\): stuck at offset 3 for 1s"):
        for batch in read_range(kafka, OffsetRange(topic, 0, 0, 10), poll_timeout_s=1.0):
            got.extend(batch.column("value").to_pylist())
    assert got == [b"e0", b"e1", b"e2"]
    assert time.monotonic() - t0 < bound(10)

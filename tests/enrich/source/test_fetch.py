"""A task's read of its offset range (enrich.source.fetch) when the range's end never comes."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from enrich.source.fetch import CORE, OffsetRange, read_range
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


def test_a_range_reader_reads_the_records_of_the_ranges_it_is_given(kafka: dict[str, str],
                                                                     unique: Callable[[str], str]) -> None:
    """The source's ``ranges`` rows read where they land (enrich.source.fetch.RangeReader): each range's
    records in order, renamed to the internal columns, a row's other columns repeated on its records,
    nothing outside a range."""
    import pyarrow as pa

    from enrich.columns import SOURCE
    from enrich.source import range_reader
    from enrich.source.fetch import range_batch

    topic = unique("src-ranges")
    ensure_topic(kafka, topic, partitions=2)
    produce(kafka, topic, [(f"k{i}".encode(), f"e{i}".encode(), i % 2) for i in range(10)])
    rows = pa.Table.from_batches([range_batch(OffsetRange(topic, 0, 1, 4)), range_batch(OffsetRange(topic, 1, 0, 2))])
    rows = rows.append_column("_batch_time", pa.array([7, 8], pa.int64()))
    reader = range_reader(kafka, [topic], columns=SOURCE)
    got = pa.Table.from_batches(list(reader(iter(rows.to_batches()))))
    assert got.column_names == [*SOURCE, "_batch_time"]
    assert got.column("_value").to_pylist() == [b"e2", b"e4", b"e6", b"e1", b"e3"]
    assert got.column("_key").to_pylist() == [b"k2", b"k4", b"k6", b"k1", b"k3"]
    assert list(zip(got.column("_partition").to_pylist(), got.column("_offset").to_pylist(), strict=True)) == [
        (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    assert got.column("_batch_time").to_pylist() == [7, 7, 7, 8, 8]
    whole = pa.Table.from_batches(list(range_reader(kafka, [topic])(iter(rows.select(range(4)).to_batches()))))
    assert whole.column_names == ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType",
                                  "headers"]
    # Without the timestamp's and the headers' columns when the reader gives none of them.
    core = pa.Table.from_batches(list(read_range(kafka, OffsetRange(topic, 0, 0, 5), full=False)))
    assert core.column_names == list(CORE) and core.column("value").to_pylist() == [b"e0", b"e2", b"e4", b"e6", b"e8"]

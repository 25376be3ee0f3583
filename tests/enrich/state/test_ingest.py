"""Events into the state step (``enrich.state.ingest``): the fast pass packs what pyarrow parses and
leaves the rest as Kafka records; the rest pass packs ``from_json``'s events alike (pure Arrow)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from enrich import events
from enrich.columns import BATCH_TIME, BUCKET, ERROR, MAX_TS, ROWS
from enrich.events import FastEvents
from enrich.events.fastparse import FastParser
from enrich.ipc import from_ipc
from enrich.state import ingest
from enrich.state.layout import BucketLayout

SCHEMA = StructType([StructField("device_id", StringType()), StructField("ts", TimestampType()),
                     StructField("temp", DoubleType())])
PARSED = StructType([*SCHEMA.fields, StructField(ERROR, StringType()), StructField("_key", BinaryType()),
                     StructField("_value", BinaryType()), StructField("_topic", StringType()),
                     StructField("_partition", IntegerType()), StructField("_offset", LongType())])
PACKED = to_arrow_schema(StructType([StructField(BUCKET, IntegerType()), StructField(MAX_TS, TimestampType()),
                                     StructField(ROWS, BinaryType())]), timezone="UTC")
FIRST = to_arrow_schema(StructType([StructField(BUCKET, IntegerType()), StructField(MAX_TS, TimestampType()),
                                    StructField(ROWS, BinaryType()), StructField("key", BinaryType()),
                                    StructField("value", BinaryType()), StructField("topic", StringType()),
                                    StructField("partition", IntegerType()), StructField("offset", LongType())]),
                        timezone="UTC")
EVENTS = ingest.events_schema(to_arrow_schema(PARSED, timezone="UTC"))
LAYOUT = BucketLayout.even(8)


def packer(out: pa.Schema, fast: bool) -> ingest.EventPacker:
    parse = None
    if fast:
        parser = FastParser.for_schema(SCHEMA)
        assert parser is not None
        parse = FastEvents(parser, to_arrow_schema(events.fast_schema(PARSED), timezone="UTC"))
    return ingest.EventPacker("device_id", "ts", LAYOUT, EVENTS, out, (), parse)


def kafka(values: list[bytes | None]) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_pydict({
        "_key": pa.array([f"k{i}".encode() for i in range(n)], pa.binary()), "_value": pa.array(values, pa.binary()),
        "_topic": pa.array(["events"] * n), "_partition": pa.array([0] * n, pa.int32()),
        "_offset": pa.array(range(n), pa.int64())})


def unpacked(batches: list[pa.RecordBatch]) -> tuple[pa.Table, list[int]]:
    """The packed events of ``batches`` in offset order, and each one's bucket."""
    tables, buckets = [], []
    for b in batches:
        for row in b.to_pylist():
            if row[ROWS] is not None:
                t = from_ipc(row[ROWS])
                tables.append(t.replace_schema_metadata(None))
                buckets += [row[BUCKET]] * t.num_rows
    table = pa.concat_tables(tables)
    order = sorted(range(table.num_rows), key=lambda i: table.column("_offset")[i].as_py())
    return table.take(order), [buckets[i] for i in order]


def ev(device: str | None, ts: str | None, temp: float = 1.5) -> bytes:
    return json.dumps({"device_id": device, "ts": ts, "temp": temp}).encode()


GOOD = [ev("d1", "2026-01-01T00:00:01Z"), ev("d2", "2026-01-01T00:00:03Z"), ev("d1", "2026-01-01T00:00:02Z")]


def test_the_fast_pass_packs_by_sparks_bucket_and_leaves_what_it_cannot_parse() -> None:
    values = [*GOOD, b"{'device_id': 'd3'}", ev(None, "2026-01-01T00:00:04Z"), ev("d4", None), None]
    out = list(packer(FIRST, fast=True)([kafka(values)]))
    assert all(b.schema == FIRST for b in out)
    left = [r for b in out for r in b.to_pylist() if r[ROWS] is None]
    # The single-quoted value and the record without one are from_json's to judge, as Kafka records.
    assert [(r["offset"], r["value"]) for r in left] == [(3, values[3]), (6, None)]
    assert all(r[BUCKET] is None and r["key"] == f"k{r['offset']}".encode() for r in left)
    table, buckets = unpacked(out)
    assert table.schema.remove_metadata() == EVENTS
    assert table.column("_offset").to_pylist() == [0, 1, 2, 4, 5]
    assert buckets == LAYOUT.of(table.column("device_id")).tolist()
    assert table.column(ERROR).to_pylist() == [None, None, None, "state.key device_id is null",
                                               "state.timestamp ts is null"]
    # The source bytes stay in the dead letters only.
    assert table.column("_value").to_pylist() == [None, None, None, values[4], values[5]]
    # A dead letter has no event time in the step: the watermark (the chunks' greatest) ignores it.
    assert table.column("_ts_us").to_pylist() == [1_767_225_601_000_000, 1_767_225_603_000_000,
                                                  1_767_225_602_000_000, None, None]
    greatest = {r[BUCKET]: r[MAX_TS] for b in out for r in b.to_pylist() if r[ROWS] is not None}
    assert max(v for v in greatest.values() if v is not None).second == 3


def test_an_event_too_far_ahead_of_the_batch_time_is_a_dead_letter_that_moves_no_watermark() -> None:
    now = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)
    values = [*GOOD, ev("d1", "2026-01-01T01:10:00Z"), ev("d2", "2026-01-01T01:10:00.000001Z"),
              ev("d9", "2031-05-06T07:08:09.5Z"), ev(None, "2031-05-06T07:08:09Z")]
    batch = kafka(values)
    batch = batch.append_column(BATCH_TIME, pa.array([now] * batch.num_rows, pa.timestamp("us", tz="UTC")))
    fast = dataclasses.replace(packer(FIRST, fast=True), max_future_skew=timedelta(hours=1))
    out = list(fast([batch]))
    table, _ = unpacked(out)
    assert table.column(ERROR).to_pylist() == [
        None, None, None, None,   # exactly 1h ahead is not more than 1h
        "event time 2026-01-01T01:10:00.000001Z is more than 1h ahead of the clock",
        "event time 2031-05-06T07:08:09.500000Z is more than 1h ahead of the clock",
        "state.key device_id is null"]
    assert table.column("_value").to_pylist()[4:] == values[4:]
    assert table.column("_ts_us").to_pylist()[4:] == [None, None, None]
    greatest = [r[MAX_TS] for b in out for r in b.to_pylist() if r[ROWS] is not None]
    assert max(v for v in greatest if v is not None) == datetime(2026, 1, 1, 1, 10, tzinfo=UTC)
    # Off, or without the batch's time, no event is judged by its time.
    for unchecked, given in ((dataclasses.replace(fast, max_future_skew=None), batch), (fast, kafka(values))):
        table, _ = unpacked(list(unchecked([given])))
        assert table.column(ERROR).to_pylist()[:6] == [None] * 6


def test_the_rest_pass_packs_parsed_events_like_the_fast_pass_and_passes_packed_rows_through() -> None:
    fast = list(packer(FIRST, fast=True)([kafka(GOOD)]))
    fast_table, fast_buckets = unpacked(fast)
    # What the plan hands the rest pass: from_json's columns for the records left, the packed rows carried.
    parsed = fast_table.drop_columns(["_ts_us"]).cast(to_arrow_schema(PARSED, timezone="UTC"))
    parsed = parsed.set_column(parsed.schema.get_field_index("_offset"), "_offset",
                               pa.array([10, 11, 12], pa.int64()))
    carried = pa.concat_tables([
        pa.Table.from_batches(fast).select([BUCKET, MAX_TS, ROWS]).cast(PACKED),
        pa.table({BUCKET: pa.nulls(3, pa.int32()), MAX_TS: pa.nulls(3, PACKED.field(MAX_TS).type),
                  ROWS: pa.nulls(3, pa.binary())})])
    nulls = pa.table({c: pa.nulls(len(fast[0]), t) for c, t in zip(parsed.column_names, parsed.schema.types,
                                                                     strict=True)})
    rest_in = pa.concat_tables([nulls, parsed]).append_column(BUCKET, carried.column(BUCKET)) \
        .append_column(MAX_TS, carried.column(MAX_TS)).append_column(ROWS, carried.column(ROWS))
    out = list(packer(PACKED, fast=False)(rest_in.to_batches()))
    assert all(b.schema == PACKED for b in out)
    table, buckets = unpacked(out)
    assert table.schema.remove_metadata() == EVENTS
    assert table.column("_offset").to_pylist() == [0, 1, 2, 10, 11, 12]
    assert buckets == fast_buckets + fast_buckets
    assert table.slice(3).drop_columns(["_offset"]).equals(table.slice(0, 3).drop_columns(["_offset"]))


def test_a_key_longer_than_max_key_bytes_is_a_dead_letter_and_leaves_the_step_unhashed() -> None:
    """A megabyte device id is a dead letter naming its size, its original bytes kept; the packed
    row carries no key beside them (nor is the key hashed whole); the limit counts bytes,
    not characters, and a key of exactly the limit passes. Both passes check keys in ``_checked``."""
    values = [*GOOD, ev("k" * (1 << 20), "2026-01-01T00:00:04Z"), ev("é" * 512, "2026-01-01T00:00:05Z"),
              ev("é" * 513, "2026-01-01T00:00:06Z")]
    step = dataclasses.replace(packer(FIRST, fast=True), max_key_bytes=1024)
    out = list(step([kafka(values)]))
    table, _ = unpacked(out)
    assert table.column(ERROR).to_pylist()[len(GOOD):] == [
        "state.key device_id is 1048576 bytes, more than state.max_key_bytes 1024", None,
        "state.key device_id is 1026 bytes, more than state.max_key_bytes 1024"]
    assert table.column("_value").to_pylist()[len(GOOD):] == [values[3], None, values[5]]
    assert table.column("device_id").to_pylist()[len(GOOD):] == [None, "é" * 512, None]
    # The dead letter's original bytes travel (the sink writes them), the key a second time does not.
    assert sum(len(r[ROWS] or b"") for b in out for r in b.to_pylist()) < len(values[3]) + 50_000

"""The fast event parser: what it takes, what it leaves to Spark, and that the result is Spark's.

The differential tests run the same raw events through the fast path (pyarrow in the join pass) and
through the ``from_json`` path, on real Spark: every row the fast path keeps must be the ``from_json``
path's row, byte for byte and in order; every other row is flagged ``_slow`` (the Kafka sink then
writes its task's slot from the ``from_json`` path: tests/enrich/sinks/kafka/test_tasks.py,
tests/enrich/test_job.py).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import (
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from enrich import events, joins
from enrich.events.fastparse import FastParser
from enrich.query import apply_joins
from enrich.sinks.abc import EnrichedBatch
from enrich.sinks.kafka.sink import records_frame
from refstream.errors import ConfigError

SCHEMA = StructType([StructField("device_id", StringType()), StructField("ts", TimestampType()),
                     StructField("temperature", DoubleType()), StructField("battery", IntegerType()),
                     StructField("seq", LongType())])

GOOD = [
    b'{"device_id":"a","ts":"2026-11-23T12:00:03.123Z","temperature":21.5,"battery":87,"seq":1}',
    b'{"device_id":"b","ts":"2026-11-23T12:00:03+02:00","temperature":-1,"battery":null,"fw":{"x":[1]}}',
    b'{"device_id":"c","ts":"2026-11-23T12:00:03.123456-05:30"}',
    b'{"device_id":"d","ts":"2026-11-23T12:00:03"}',
    b'{"device_id":"\\u00e9t\xc3\xa9 \\"q\\"","temperature":1.5E-3,"seq":9007199254740993}',
    b'{"device_id":"f","ts":null,"extra":"ignored"}',
    b'{"device_id":""}',
]
#: Values the fast path must leave to Spark: Spark accepts some of them (lenient options) and
#: refuses others; either way its answer is the one that counts.
LEFT = [
    b"{'device_id':'single quotes'}",
    b'{"device_id":5}',
    b'{"device_id":"n","temperature":"NaN"}',
    b'{"device_id":"x","battery":1.0}',
    b'{"device_id":"x","battery":3000000000}',
    b'{"device_id":"x","temperature":1e400}',
    b'{"device_id":"x","ts":"2026-11-23 12:00:03"}',
    b'{"device_id":"x","ts":"2024-02-30T00:00:00Z"}',
    b'{"device_id":"x","ts":"2026-11-23T12:00:03.1234567Z"}',
    b'{"device_id":"x","ts":1700000000}',
    b'{"device_id":"dup","device_id":"twice"}',
    b'{"device_id":"a"}{"device_id":"b"}',
    b'{"device_id":"g","x":1}{"device_id":"h","y":',
    b' {"device_id":"padded"} ',
    b'{"device_id":"nl",\n"battery":1}',
    b'[{"device_id":"array"}]',
    b'null',
    b'',
    None,
    b'not json',
    b'{"device_id":"trunc',
    b'{"device_id":"\xff\xfe"}',
    b'{"device_id":"\\ud800"}',
    b'{"battery":1}',            # required device_id missing
    b'{"device_id":null}',
    b'{}',
]


def parser() -> FastParser:
    p = FastParser.for_schema(SCHEMA, ["device_id"], "UTC")
    assert p is not None
    return p


def test_takes_strict_json_and_leaves_everything_else() -> None:
    values = pa.array(GOOD + LEFT, pa.binary())
    table, slow = parser().parse(values.slice(0))
    assert list(slow) == [False] * len(GOOD) + [True] * len(LEFT)
    rows = table.to_pylist()
    assert rows[0]["battery"] == 87 and rows[0]["ts"].isoformat() == "2026-11-23T12:00:03.123000+00:00"
    assert rows[1]["ts"].isoformat() == "2026-11-23T10:00:03+00:00"   # the offset is honoured
    assert rows[4]["device_id"] == 'été "q"' and rows[4]["seq"] == 9007199254740993
    assert all(all(v is None for v in r.values()) for r in rows[len(GOOD):])  # left rows hold nothing


def test_a_bad_value_in_a_large_batch_is_isolated() -> None:
    good = [json.dumps({"device_id": f"d{i}", "battery": i}).encode() for i in range(5000)]
    values = good[:1234] + [b'{"device_id":"x","battery":"five"}'] + good[1234:]
    table, slow = parser().parse(pa.array(values, pa.binary()))
    assert list(map(int, slow.nonzero()[0])) == [1234]
    assert table.column("battery").to_pylist()[1235] == 1234


def test_only_schemas_with_an_exact_fast_path() -> None:
    assert FastParser.for_schema(StructType([StructField("p", DecimalType(10, 2))])) is None
    naive = FastParser.for_schema(SCHEMA, (), "Europe/Paris")
    assert naive is not None
    _, slow = naive.parse(pa.array([b'{"ts":"2026-11-23T12:00:03"}', b'{"ts":"2026-11-23T12:00:03Z"}']))
    assert list(slow) == [True, False]   # a naive timestamp means the session zone: Spark decides


def raw_frame(spark: SparkSession, values: list[bytes | None]) -> tuple:
    rows = [(f"k{i % 3}".encode(), v, "events", i % 2, i) for i, v in enumerate(values)]
    return spark.createDataFrame(rows, "key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT")


def both_paths(spark: SparkSession, values: list[bytes | None]) -> tuple[pa.Table, pa.Table]:
    """The Kafka sink's output rows of ``values``, parsed by ``from_json`` and by the fast path."""
    raw = raw_frame(spark, values).repartition(1)
    parsed = events.parse(raw, SCHEMA, ["device_id"])
    _, out = joins.resolve([], {}, parsed.schema)
    _, fast_out = joins.resolve([], {}, events.fast_schema(parsed.schema))
    cols = tuple(f.name for f in out.fields if f.name not in events.INTERNAL)
    exact = records_frame(EnrichedBatch(parsed, cols)).toArrow()
    fast_df = apply_joins(events.source_columns(raw), [], fast_out, {}, events.ERROR, parser=parser(),
                         parsed_schema=events.fast_schema(parsed.schema))
    return exact, records_frame(EnrichedBatch(fast_df, cols)).toArrow()


def test_rows_taken_are_from_json_rows_in_the_same_order_and_the_rest_is_flagged(spark: SparkSession) -> None:
    values = [v for pair in zip(GOOD * 4, LEFT, strict=False) for v in pair] + LEFT[len(GOOD) * 4:]
    exact, fast = both_paths(spark, values)
    assert fast.num_rows == exact.num_rows == len(values)
    slow = fast.column(events.SLOW).to_pylist()
    assert fast.drop_columns([events.SLOW]).schema == exact.schema
    for name in exact.column_names:
        taken = [v for v, s in zip(fast.column(name).to_pylist(), slow, strict=True) if not s]
        assert taken == [v for v, s in zip(exact.column(name).to_pylist(), slow, strict=True) if not s], name
    assert slow == [v not in GOOD for v in values]   # all of GOOD taken, all of LEFT left to from_json
    errors = exact.column("_error").to_pylist()
    assert len([e for e in errors if e]) > 10   # the corpus does reach the dead-letter rules
    assert all(s for s, e in zip(slow, errors, strict=True) if e)   # no dead letter decided by pyarrow
    accepted_leniently = [v for v, e, out in zip(values, errors, exact.column("value").to_pylist(), strict=True)
                          if v in LEFT and e is None and out]
    assert b"{'device_id':'single quotes'}" in accepted_leniently   # Spark's answer, not pyarrow's


def test_all_fast_batch_gives_the_same_values(spark: SparkSession) -> None:
    exact, fast = both_paths(spark, GOOD * 3)
    assert not any(fast.column(events.SLOW).to_pylist())
    assert fast.column("value").to_pylist() == exact.column("value").to_pylist()
    assert all(json.loads(v) for v in fast.column("value").to_pylist())


@pytest.mark.parametrize("name", ["_kind", "_offset", "_error", "_corrupt_record"])
def test_an_event_field_named_like_an_output_or_internal_column_is_refused(spark: SparkSession, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"events.schema: field name\(s\) \['{name}'\] are reserved"):
        events.event_schema(f"device_id STRING, {name} STRING")

"""The Kafka output's records made in Python (enrich.sinks.kafka.values) against the JVM's
(records_frame, Spark's to_json): the same values, on real Spark."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, LongType, MapType, StringType, StructField, StructType

from enrich.columns import ERROR, LATE, SLOW
from enrich.sinks.abc import JSON_OPTIONS, EnrichedBatch
from enrich.sinks.kafka.sink import records_frame
from enrich.sinks.kafka.values import RecordMaker, json_values, supported

#: Every type the Python JSON writes, with nulls, escapes, non-BMP text, NaN and the infinities,
#: whole floats, a null struct and a struct holding nulls.
ROWS_SQL = r"""
SELECT * FROM VALUES
  ('plain', 1, CAST(2 AS BIGINT), CAST(3 AS SMALLINT), CAST(4 AS TINYINT), true, 20.0D, CAST(0.1 AS FLOAT),
   CAST('12.30' AS DECIMAL(10,2)), DATE'2026-01-31', TIMESTAMP'2026-01-31 23:59:59.123456',
   TIMESTAMP_NTZ'2026-07-01 12:00:00', X'00ff10', named_struct('a', 1, 'b', 'x', 't', TIMESTAMP'2026-06-01 00:00:00')),
  ('q"uote\\back\nline\ttab\u0001 é 𝄞', -7, CAST(-9007199254740993 AS BIGINT), NULL, NULL, false,
   CAST('NaN' AS DOUBLE), CAST('Infinity' AS FLOAT), CAST('-0.05' AS DECIMAL(10,2)), NULL,
   TIMESTAMP'1969-12-31 23:59:59.999999', NULL, NULL, named_struct('a', NULL, 'b', NULL, 't', NULL)),
  (NULL, NULL, NULL, NULL, NULL, NULL, CAST('-Infinity' AS DOUBLE), NULL, NULL, NULL, NULL, NULL, NULL, NULL),
  ('big', 0, 0, 0, 0, true, 1e300D, CAST(3.4028235e38 AS FLOAT), CAST(0 AS DECIMAL(10,2)), DATE'1970-01-01',
   TIMESTAMP'2026-03-08 07:30:00', TIMESTAMP_NTZ'1999-12-31 23:59:59.999999', X'', NULL),
  ('small', 1, 1, 1, 1, false, 1e-7D, CAST(-2.5e-6 AS FLOAT), NULL, DATE'2000-02-29',
   TIMESTAMP'2026-11-01 05:59:59.5', NULL, NULL, named_struct('a', 2, 'b', '', 't', TIMESTAMP'2026-11-01 06:00:00'))
AS t(s, i, l, sh, by, b, d, f, dec, dt, ts, ntz, bin, st)
"""


@pytest.fixture
def in_zone(spark: SparkSession) -> Iterator[object]:
    """Runs the test body's frames in each zone given (the shared session's zone restored after)."""
    before = spark.conf.get("spark.sql.session.timeZone")

    def set_zone(zone: str) -> None:
        spark.conf.set("spark.sql.session.timeZone", zone)

    yield set_zone
    spark.conf.set("spark.sql.session.timeZone", before)


def spark_json(df: DataFrame) -> list[object]:
    return [json.loads(r[0]) for r in df.select(F.to_json(F.struct(*df.columns), JSON_OPTIONS)).collect()]


@pytest.mark.parametrize("zone", ["UTC", "America/New_York", "Asia/Kolkata"])
def test_python_json_is_spark_to_json_value_for_value(spark: SparkSession, in_zone, zone: str) -> None:  # type: ignore[no-untyped-def]
    in_zone(zone)
    df = spark.sql(ROWS_SQL).coalesce(1)
    assert supported(df.schema)
    expected = spark_json(df)
    got = [json.loads(v) for v in json_values(df.toArrow(), df.schema, zone).to_pylist()]
    assert got == expected
    # The same kinds of numbers: a float column's whole value stays a float, not an int.
    assert [type(r["d"]) for r in got] == [type(r["d"]) for r in expected]
    assert got[0]["d"] == 20.0 and isinstance(got[0]["d"], float)
    if zone != "UTC":   # the zone's offset, daylight saving included, as Spark's XXX
        assert got[3]["ts"] == expected[3]["ts"] and not got[3]["ts"].endswith("Z")


def test_types_the_python_json_leaves_to_spark() -> None:
    assert not supported(StructType([StructField("xs", ArrayType(LongType()))]))
    assert not supported(StructType([StructField("s", StructType([StructField("m", MapType(StringType(),
                                                                                        LongType()))]))]))
    assert supported(StructType([StructField("s", StructType([StructField("x", LongType())]))]))


def test_records_are_records_frames_rows(spark: SparkSession) -> None:
    df = spark.sql("""
        SELECT * FROM VALUES
          (X'6b31', X'7b7d', 'events', 0, CAST(10 AS BIGINT), NULL, false, 'd1', 21.5D, true, NULL),
          (X'6b32', X'6261', 'events', 1, CAST(11 AS BIGINT), 'bad json', false, NULL, NULL, NULL, NULL),
          (NULL, X'7b7d', 'events', 0, CAST(12 AS BIGINT), NULL, true, NULL, NULL, NULL, NULL),
          (X'6b34', X'7b7d', 'events', 1, CAST(13 AS BIGINT), NULL, false, 'd4', NULL, false, true),
          (X'6b35', NULL, 'events', 1, CAST(14 AS BIGINT), NULL, false, 'd5', 1.0D, NULL, false)
        AS t(_key, _value, _topic, _partition, _offset, _error, _slow, device_id, temperature,
             _devices_matched, _late)""").coalesce(1)
    batch = EnrichedBatch(df, ("device_id", "temperature", "_devices_matched"), ("_devices_matched",))
    expected = records_frame(batch).toArrow()
    values = StructType([df.schema[c] for c in ("device_id", "temperature", "_devices_matched", "_topic",
                                                 "_partition", "_offset")])
    got = RecordMaker(values, batch.matched, "UTC")(df.toArrow())
    assert got.schema.names == expected.schema.names
    for name in expected.schema.names:
        want, have = expected.column(name).to_pylist(), got.column(name).to_pylist()
        if name == "value":
            want = [None if v is None else json.loads(v) for v in want]
            have = [None if v is None else json.loads(v) for v in have]
        assert have == want, name
    assert got.column("value").to_pylist()[1:3] == [None, None]   # a dead letter, a row left to from_json
    assert got.column(ERROR).to_pylist()[1] == "bad json" and got.column(SLOW).to_pylist()[2]
    assert got.column(LATE).to_pylist() == [False, False, False, True, False]


def test_a_batch_of_no_rows_is_written_as_none(spark: SparkSession) -> None:
    schema = StructType([StructField("s", StringType())])
    assert json_values(pa.table({"s": pa.array([], pa.string())}), schema, "UTC").to_pylist() == []


def test_a_batch_of_good_events_has_no_dead_letter_columns_set() -> None:
    t = pa.table({"_key": pa.array([b"k1", b"k2"]), "_value": pa.array([b"{}", b"{}"]), "_topic": ["e", "e"],
                  "_partition": pa.array([0, 1], pa.int32()), "_offset": pa.array([5, 6], pa.int64()),
                  "_error": pa.array([None, None], pa.string()), "n": pa.array([1, None], pa.int64())})
    values = StructType([StructField("n", LongType()), StructField("_offset", LongType())])
    got = RecordMaker(values, (), "UTC")(t)
    assert [json.loads(v) for v in got.column("value").to_pylist()] == [{"n": 1, "_offset": 5, "_kind": "event"},
                                                                         {"n": None, "_offset": 6, "_kind": "event"}]
    assert got.column("_value").null_count == got.column("_key").null_count == got.column(ERROR).null_count == 2
    assert got.column("_offset").to_pylist() == [5, 6] and got.column("key").to_pylist() == [b"k1", b"k2"]

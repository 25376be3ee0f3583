"""The state step's bucket in numpy is Spark's ``pmod(hash(key), buckets)``, bit for bit, on real Spark;
so is a bucket's grouping key, and the state partition Spark's shuffle puts it in."""

from __future__ import annotations

import datetime as dt
import random
import string

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from enrich.state.hashing import buckets_of, spark_hash, supports
from enrich.state.layout import BucketLayout

_rng = random.Random(7)
_TEXT = string.printable + "éüß日本語\u0000\U0001f600"
STRINGS = ["", "a", "ab", "abc", "abcd", "abcde", "dev-000001", "é", "日本語テキスト", "\x00\x7f", "\U0001f600", None,
           *["".join(_rng.choice(_TEXT) for _ in range(_rng.randint(0, 41))) for _ in range(1500)],
           # Long values, hashed value by value once few are left (enrich.state.hashing._FEW).
           "k" * (1 << 20), "é" * 5001, *["".join(_rng.choice(_TEXT) for _ in range(_rng.randint(100, 3000)))
                                          for _ in range(6)]]
INTS = [0, 1, -1, 2**31 - 1, -(2**31), None, *[_rng.randint(-(2**31), 2**31 - 1) for _ in range(500)]]
LONGS = [0, 1, -1, 2**63 - 1, -(2**63), None, *[_rng.randint(-(2**63), 2**63 - 1) for _ in range(500)]]
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
TIMES = [EPOCH, EPOCH - dt.timedelta(microseconds=1), None,
         *[EPOCH + dt.timedelta(microseconds=_rng.randint(-(10**16), 10**16)) for _ in range(300)]]
DATES = [dt.date(1970, 1, 1), dt.date(1, 1, 1), dt.date(9999, 12, 31), None,
         *[dt.date(1970, 1, 1) + dt.timedelta(days=_rng.randint(-700_000, 2_900_000)) for _ in range(300)]]

CASES = [
    ("string", pa.string(), STRINGS),
    ("binary", pa.binary(), [None if s is None else s.encode() for s in STRINGS]),
    ("int", pa.int32(), INTS),
    ("smallint", pa.int16(), [None if i is None else i % 65536 - 32768 for i in INTS]),
    ("tinyint", pa.int8(), [None if i is None else i % 256 - 128 for i in INTS]),
    ("bigint", pa.int64(), LONGS),
    ("boolean", pa.bool_(), [True, False, None]),
    ("timestamp", pa.timestamp("us", tz="UTC"), TIMES),
    ("date", pa.date32(), DATES),
]


@pytest.mark.integration
@pytest.mark.parametrize(("ddl", "arrow", "values"), CASES, ids=[c[0] for c in CASES])
def test_numpy_hash_and_bucket_are_sparks(spark: SparkSession, ddl: str, arrow: pa.DataType,
                                          values: list[object]) -> None:
    df = spark.createDataFrame([(v,) for v in values], f"k {ddl}")
    layout = BucketLayout.even(64, 12)
    rows = df.select(F.hash("k").alias("h"), F.pmod(F.hash("k"), F.lit(64)).alias("b"),
                     F.pmod(F.hash("k"), F.lit(7)).alias("b7"), layout.column(F.col("k")).alias("g")).collect()
    arr = pa.array(values, arrow)
    assert spark_hash(arr).tolist() == [r.h for r in rows]
    assert buckets_of(arr, 64).tolist() == [r.b for r in rows]
    assert buckets_of(arr, 7).tolist() == [r.b7 for r in rows]
    assert layout.of(arr).tolist() == [r.g for r in rows]


@pytest.mark.integration
@pytest.mark.parametrize(("partitions", "start"), [(2, None), (4, None), (8, None), (12, 12), (4, 12)])
def test_sparks_shuffle_puts_the_grouping_keys_where_the_layout_says(spark: SparkSession, partitions: int,
                                                                     start: int | None) -> None:
    # The state step's shuffle is hash partitioning on _bucket, as repartition(n, column) is, and as
    # Spark's offline state repartition re-hashes the grouping keys.
    layout = BucketLayout.even(64, start)
    df = spark.createDataFrame([(i,) for i in layout.ids], "_bucket int").repartition(partitions, "_bucket")
    where = dict(df.select("_bucket", F.spark_partition_id().alias("p")).collect())  # type: ignore[arg-type]
    assert [where[i] for i in layout.ids] == layout.partitions(partitions).tolist()
    assert max(layout.spread(partitions)) - min(layout.spread(partitions)) <= 1
    if 64 % partitions == 0:
        assert [where[i] for i in layout.ids] == [b % partitions for b in range(64)]


def test_chunked_sliced_and_large_arrays_hash_alike() -> None:
    arr = pa.array(STRINGS, pa.string())
    whole = spark_hash(arr)
    assert spark_hash(arr.slice(5, 100)).tolist() == whole[5:105].tolist()
    assert spark_hash(pa.chunked_array([arr.slice(0, 10), arr.slice(10)])).tolist() == whole.tolist()
    assert spark_hash(arr.cast(pa.large_string())).tolist() == whole.tolist()
    millis = pa.array(TIMES, pa.timestamp("us", tz="UTC")).cast(pa.timestamp("ms", tz="UTC"), safe=False)
    assert spark_hash(millis).tolist() == spark_hash(millis.cast(pa.timestamp("us", tz="UTC"))).tolist()


def test_types_without_a_hash_here_are_refused() -> None:
    assert not supports(pa.float64()) and not supports(pa.decimal128(10, 2))
    with pytest.raises(TypeError, match="double"):
        spark_hash(pa.array([1.5]))


def test_hashing_is_linear_in_the_bytes_hashed() -> None:
    """One 1 MB key beside ten thousand short ones: the word positions past the short keys' lengths
    cost what they hash (about 50 ms here), not a pass over every value each (4 s before)."""
    import time

    from tests.timing import bound

    keys = pa.array(["k" * (1 << 20), *[f"dev-{i}" for i in range(10_000)]])
    started = time.monotonic()
    got = spark_hash(keys)
    assert time.monotonic() - started < bound(1.0)
    assert got[0] == spark_hash(keys.slice(0, 1))[0] and got[1:].tolist() == spark_hash(keys.slice(1)).tolist()

"""The buckets' grouping keys: even over every number of state partitions that divides the bucket
count, and over the number a checkpoint starts with."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from enrich.state.hashing import buckets_of, spark_hash
from enrich.state.layout import BucketLayout


def partition_of(ids: tuple[int, ...], partitions: int) -> list[int]:
    """Where Spark's hash partitioning of the int grouping key puts each id."""
    return np.mod(spark_hash(pa.array(ids, pa.int32())).astype(np.int64), partitions).tolist()


def test_the_bucket_numbers_as_grouping_keys_would_spread_unevenly() -> None:
    # What the layout removes: 64 buckets grouped by their own number, on 4 state partitions.
    assert sorted(Counter(partition_of(tuple(range(64)), 4)).values()) == [11, 16, 16, 21]


@pytest.mark.parametrize("buckets", [1, 2, 3, 8, 12, 64, 100, 500])
def test_every_number_that_divides_the_buckets_gets_its_share(buckets: int) -> None:
    layout = BucketLayout.even(buckets)
    assert len(layout.ids) == buckets and len(set(layout.ids)) == buckets and min(layout.ids) >= 0
    for n in [n for n in range(1, buckets + 1) if buckets % n == 0]:
        # Bucket b is in partition b % n, for the start and for every rescale to such an n.
        assert partition_of(layout.ids, n) == [b % n for b in range(buckets)], n
        assert layout.spread(n) == [buckets // n] * n
    assert BucketLayout.even(buckets) == layout   # the same on every start
    # The smallest such integers: bucket b's id is the first integer Spark hashes to b modulo buckets.
    first = {}
    for i, r in enumerate(partition_of(tuple(range(max(layout.ids) + 1)), buckets)):
        first.setdefault(r, i)
    assert layout.ids == tuple(first[b] for b in range(buckets))


@pytest.mark.parametrize(("buckets", "partitions"), [(64, 12), (64, 6), (64, 3), (64, 200), (10, 4), (3, 8),
                                                     (500, 7), (4096, 7)])
def test_a_start_with_another_number_is_even_over_it_too(buckets: int, partitions: int) -> None:
    layout = BucketLayout.even(buckets, partitions)
    assert len(set(layout.ids)) == buckets and min(layout.ids) >= 0 and max(layout.ids) < 2**31
    spread = layout.spread(partitions)
    assert max(spread) - min(spread) <= 1 and sum(spread) == buckets
    for n in [n for n in range(1, buckets + 1) if buckets % n == 0]:
        assert layout.spread(n) == [buckets // n] * n, n
    assert BucketLayout.even(buckets, partitions) == layout


def test_a_divisor_start_is_the_plain_even_layout() -> None:
    assert BucketLayout.even(64, 4) == BucketLayout.even(64, 64) == BucketLayout.even(64)


def test_another_number_spreads_as_the_hash_falls() -> None:
    layout = BucketLayout.even(64)
    assert layout.spread(3) == np.bincount(partition_of(layout.ids, 3), minlength=3).tolist()
    assert sum(layout.spread(6)) == 64 and max(layout.spread(6)) - min(layout.spread(6)) > 1


def test_a_device_key_gets_its_bucket_s_grouping_key() -> None:
    keys = pa.array([f"dev-{i}" for i in range(1000)])
    layout = BucketLayout.even(16)
    b = buckets_of(keys, 16)
    assert layout.of(keys).tolist() == [layout.ids[i] for i in b]
    assert layout.of(keys).dtype == np.int32


def test_impossible_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        BucketLayout.even(0)
    with pytest.raises(ValueError, match="must be positive"):
        BucketLayout.even(64, 0)

"""The buckets' grouping keys: the plain layout and the one spread evenly over the state partitions."""

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


def test_the_plain_layout_groups_by_the_bucket_number_whatever_the_spread() -> None:
    plain = BucketLayout.plain(64)
    assert plain.ids == tuple(range(64)) and plain.is_plain
    # What it spreads over 4 state partitions: the skew the balanced layout removes.
    assert sorted(Counter(partition_of(plain.ids, 4)).values()) == [11, 16, 16, 21]


@pytest.mark.parametrize(("buckets", "partitions"), [(64, 4), (64, 2), (64, 8), (64, 200), (10, 4), (3, 8), (1, 1),
                                                     (500, 7)])
def test_the_balanced_layout_gives_every_partition_its_share(buckets: int, partitions: int) -> None:
    layout = BucketLayout.balanced(buckets, partitions)
    assert len(layout.ids) == buckets and len(set(layout.ids)) == buckets and min(layout.ids) >= 0
    where = partition_of(layout.ids, partitions)
    # Bucket b is in partition b % partitions: every partition holds buckets // partitions or one more.
    assert where == [b % partitions for b in range(buckets)]
    counts = Counter(where)
    assert max(counts.values()) - min(counts.values()) <= 1 and len(counts) == min(buckets, partitions)
    assert BucketLayout.balanced(buckets, partitions) == layout   # the same on every start


def test_a_device_key_gets_its_bucket_s_grouping_key() -> None:
    keys = pa.array([f"dev-{i}" for i in range(1000)])
    layout = BucketLayout.balanced(16, 4)
    b = buckets_of(keys, 16)
    assert layout.of(keys).tolist() == [layout.ids[i] for i in b]
    assert layout.of(keys).dtype == np.int32
    assert BucketLayout.plain(16).of(keys).tolist() == b.tolist()


def test_impossible_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        BucketLayout.balanced(64, 0)

"""Which grouping key each hash bucket of devices gets, so that the state partitions share the buckets evenly.

The state step groups its rows by one integer per bucket (``_bucket``), and Spark places a group in
state partition ``pmod(hash(_bucket), partitions)``: its shuffle's hash partitioning, and the
offline state repartition (``enrich rescale``) re-hashes the grouping keys the same way. With the
bucket number itself as that integer, 64 buckets fall 11 / 21 / 16 / 16 on 4 partitions (27 / 37 on
2, 5 to 12 on 8): the partition with the most buckets has the most devices and events, and every
batch waits for its task.

So bucket ``b`` of ``B`` gets the smallest non-negative integer whose Spark hash is ``b`` modulo
``B`` (:meth:`BucketLayout.even`). For every ``N`` that divides ``B``, ``pmod(h, B) mod N ==
pmod(h, N)``: bucket ``b`` lands in partition ``b mod N``, and each of the ``N`` partitions holds
``B / N`` buckets - for the number of state partitions a checkpoint starts with and for every
number it is rescaled to, as long as it divides ``B`` (64 buckets: 1, 2, 4, 8, 16, 32 or 64
partitions). Another number spreads the buckets as the hash falls (:meth:`BucketLayout.spread`).

The checkpoint records the layout with the state settings (:mod:`enrich.state.record`): it never
changes for the life of the state, whatever the number of state partitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark.sql import Column
from pyspark.sql import functions as F

from enrich.state.hashing import buckets_of, spark_hash


def partitions_of(ids: tuple[int, ...] | list[int], partitions: int) -> np.ndarray:
    """The state partition Spark's hash partitioning puts each int grouping key in, int64."""
    return np.mod(spark_hash(pa.array(ids, pa.int32())).astype(np.int64), partitions)


@dataclass(frozen=True)
class BucketLayout:
    """The grouping key of each bucket: ``ids[b]`` for bucket ``b = pmod(hash(key), len(ids))``. Picklable."""

    ids: tuple[int, ...]

    @classmethod
    def even(cls, buckets: int, partitions: int | None = None) -> BucketLayout:
        """Bucket ``b`` grouped as the smallest non-negative integer Spark hashes to ``b`` modulo
        ``buckets``: spread evenly over every number of state partitions that divides ``buckets``.
        With ``partitions`` (the number a checkpoint starts with) that does not divide it, the
        smallest such integer that Spark also hashes to the partition a round robin gives the bucket
        (among those its residue allows): spread evenly over ``partitions`` too."""
        if buckets < 1 or (partitions is not None and partitions < 1):
            raise ValueError(f"buckets ({buckets}) and partitions ({partitions}) must be positive")
        target = None
        if partitions is not None and buckets % partitions:
            # pmod(h, buckets) fixes pmod(h, g), g = gcd: the buckets of each residue of g go round
            # robin over the partitions of the same residue, ``buckets // partitions`` each or one more.
            g, target = math.gcd(buckets, partitions), np.zeros(buckets, dtype=np.int64)
            for c in range(g):
                mine, theirs = np.arange(c, buckets, g), np.arange(c, partitions, g)
                target[mine] = theirs[np.arange(len(mine)) % len(theirs)]
        found = np.full(buckets, -1, dtype=np.int64)
        start, chunk = 0, max(8 * buckets * (partitions or 1), 4096)
        while (found < 0).any():
            if start + chunk > 2**31:
                raise ValueError(f"no even layout of {buckets} buckets over {partitions} partitions among int32")
            candidates = np.arange(start, start + chunk, dtype=np.int64)
            h = spark_hash(pa.array(candidates, pa.int32())).astype(np.int64)
            bucket = np.mod(h, buckets)
            if target is not None:
                assert partitions is not None
                fits = np.mod(h, partitions) == target[bucket]
                candidates, bucket = candidates[fits], bucket[fits]
            seen, first = np.unique(bucket, return_index=True)  # candidates ascend: the first is the smallest
            new = found[seen] < 0
            found[seen[new]] = candidates[first[new]]
            start += chunk
        return cls(tuple(found.tolist()))

    @property
    def buckets(self) -> int:
        return len(self.ids)

    def partitions(self, partitions: int) -> np.ndarray:
        """The state partition of each bucket with ``partitions`` state partitions."""
        return partitions_of(self.ids, partitions)

    def spread(self, partitions: int) -> list[int]:
        """How many buckets each of ``partitions`` state partitions holds."""
        return np.bincount(self.partitions(partitions), minlength=partitions).tolist()

    def of(self, keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """The grouping key of each device key, int32 (as :meth:`column` computes it in Spark)."""
        return np.asarray(self.ids, dtype=np.int32)[buckets_of(keys, self.buckets)]

    def column(self, key: Column) -> Column:
        """The grouping key of the device ``key`` in the plan (int)."""
        b = F.pmod(F.hash(key), F.lit(self.buckets)).cast("int")
        return F.element_at(self.all(), b + 1)

    def all(self) -> Column:
        """Every bucket's grouping key, as an array (a record every bucket gets)."""
        return F.array(*[F.lit(i) for i in self.ids])

"""Which grouping key each hash bucket of devices gets, so that the state partitions share the buckets evenly.

The state step groups its rows by one integer per bucket (``_bucket``), and Spark places a group in
state partition ``pmod(hash(_bucket), partitions)`` (its shuffle's hash partitioning). With the
bucket number itself as that integer, 64 buckets fall 11 / 21 / 16 / 16 on 4 partitions (27 / 37 on
2, 5 to 12 on 8): the partition with the most buckets has the most devices and events, and every
batch waits for its task. So a new checkpoint gives bucket ``b`` the ``b // partitions``-th smallest
non-negative integer that Spark hashes to partition ``b % partitions``: each partition then holds
``buckets // partitions`` buckets or one more.

The layout depends on the number of state partitions, which Spark fixes at a checkpoint's first
batch (``spark.sql.shuffle.partitions``, kept in its offset log); the job records it with the state
settings (:mod:`enrich.state.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark.sql import Column
from pyspark.sql import functions as F

from enrich.state.hashing import buckets_of, spark_hash


@dataclass(frozen=True)
class BucketLayout:
    """The grouping key of each bucket: ``ids[b]`` for bucket ``b = pmod(hash(key), len(ids))``;
    ``partitions``: the state partitions they were spread over (None: the plain layout,
    ``ids[b] == b``). Picklable."""

    ids: tuple[int, ...]
    partitions: int | None = None

    @classmethod
    def plain(cls, buckets: int) -> BucketLayout:
        """Bucket ``b`` grouped as ``b``: the hash's own bucket numbers, which :meth:`balanced` renumbers."""
        return cls(tuple(range(buckets)))

    @classmethod
    def balanced(cls, buckets: int, partitions: int) -> BucketLayout:
        """Each of ``partitions`` state partitions gets ``buckets // partitions`` buckets or one more."""
        if buckets < 1 or partitions < 1:
            raise ValueError(f"buckets ({buckets}) and partitions ({partitions}) must be positive")
        need = -(-buckets // partitions)  # per partition, at most
        found: list[list[int]] = [[] for _ in range(partitions)]
        start, chunk = 0, max(4 * need * partitions, 64)
        while any(len(f) < need for f in found):
            candidates = np.arange(start, start + chunk, dtype=np.int32)
            where = np.mod(spark_hash(pa.array(candidates)).astype(np.int64), partitions)
            for value, p in zip(candidates.tolist(), where.tolist(), strict=True):
                if len(found[p]) < need:
                    found[p].append(value)
            start += chunk
        return cls(tuple(found[b % partitions][b // partitions] for b in range(buckets)), partitions)

    @property
    def buckets(self) -> int:
        return len(self.ids)

    @property
    def is_plain(self) -> bool:
        return self.partitions is None

    def of(self, keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """The grouping key of each device key, int32 (as :meth:`column` computes it in Spark)."""
        b = buckets_of(keys, self.buckets)
        return b if self.is_plain else np.asarray(self.ids, dtype=np.int32)[b]

    def column(self, key: Column) -> Column:
        """The grouping key of the device ``key`` in the plan (int)."""
        b = F.pmod(F.hash(key), F.lit(self.buckets)).cast("int")
        if self.is_plain:
            return b
        return F.element_at(self.all(), b + 1)

    def all(self) -> Column:
        """Every bucket's grouping key, as an array (a record every bucket gets)."""
        return F.array(*[F.lit(i) for i in self.ids])

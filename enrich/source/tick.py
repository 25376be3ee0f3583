"""The tick source (``refstream-tick``): a stream with one row for every bucket of the state step
at each trigger, unioned with the events when a join waits for completeness (``joins[].wait``).

Spark runs a micro-batch only when some source has new data, and calls a stateful processor only
for the groups a batch has rows of. Events held for completeness must be released within one
trigger of the completeness passing them or of ``max_wait`` expiring, even when no events arrive:
each trigger this source has new data (its offset is the wall clock in milliseconds, strictly
increasing), and its rows reach every bucket (each a packed value of kind :data:`TICK` holding no
rows, :func:`enrich.packed.marker`). It keeps no state of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence

from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from enrich.packed import marker

__all__ = ["FORMAT", "SCHEMA_DDL", "TICK", "TickDataSource", "tick_options"]

FORMAT = "refstream-tick"
#: The packed kind of a tick row.
TICK = "tick"
#: Rows as the state step's packed input takes them: the bucket's grouping key, a packed value.
SCHEMA_DDL = "_bucket INT, rows BINARY"


class TickDataSource(DataSource):
    """``spark.readStream.format("refstream-tick").option("buckets", "[ids...]")``: the grouping
    keys of every bucket (``enrich.state.layout.BucketLayout.ids``) as a JSON list."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA_DDL

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return TickStreamReader(tuple(int(b) for b in json.loads(self.options["buckets"])))


class _Tick(InputPartition):
    pass


class TickStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"ms": wall clock}``; every range holds one tick per bucket. Under
    ``Trigger.AvailableNow`` the ticks stop at the time the run started: a source without it would
    make Spark fall back to a single batch for the whole query (only a batch left uncommitted by a
    crash, say, and none after it)."""

    def __init__(self, buckets: Sequence[int]) -> None:
        self.buckets = tuple(buckets)
        self._until: int | None = None

    def initialOffset(self) -> dict:
        return {"ms": _now_ms()}

    def prepareForTriggerAvailableNow(self) -> None:
        self._until = _now_ms()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = int(start["ms"])
        if self._until is not None:
            return {"ms": max(begin, self._until)}  # one tick batch at most, up to the run's start
        return {"ms": max(_now_ms(), begin + 1)}

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        return [_Tick(None)]

    def commit(self, end: dict) -> None:
        pass

    def read(self, partition: InputPartition) -> Iterator[tuple[int, bytes]]:
        value = marker(TICK)
        for bucket in self.buckets:
            yield bucket, value


def _now_ms() -> int:
    return int(time.time() * 1000)


def tick_options(spark: SparkSession, buckets: Sequence[int]) -> dict[str, str]:
    """The options of the tick stream of ``buckets`` (format :data:`FORMAT`), the source registered
    in ``spark`` (the query reads it: :mod:`enrich.query`)."""
    spark.dataSource.register(TickDataSource)
    return {"buckets": json.dumps(list(buckets))}

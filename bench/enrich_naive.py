"""The Spark enrichment people write themselves, as the benchmark's baselines.

:class:`NaiveBatch`: ``foreachBatch`` that, every micro-batch, reads the WHOLE changelog topic (with
the project's own Kafka reader, exposed here as a batch source), keeps the latest value per key,
drops tombstones and the schema record, parses the rows and broadcast-joins them with the parsed
events. :class:`CarefulBatch`: the same, but the rebuilt dimension is cached and rebuilt only when
the changelog's end offsets moved since the last batch. Both write the same JSON through one
transaction per micro-batch on the driver (``TransactionalBatchWriter``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSourceReader
from pyspark.sql.types import StructType

from bench.enrich_data import DEVICES, EVENT_DDL, JOIN_COLUMNS
from enrich import events
from enrich.sinks.abc import JSON_OPTIONS
from enrich.source.kafka import KafkaBatchReader, KafkaDataSource
from enrich.source.offsets import EndOffsetProbe
from enrich.source.options import SourceOptions
from refstream.compat import spark_schema
from refstream.contract import SCHEMA_KEY

log = logging.getLogger(__name__)

FORMAT = "refstream-kafka-all"


class WholeTopicSource(KafkaDataSource):
    """``spark.read.format("refstream-kafka-all")``: every record of the subscribed topics, read by
    the same executor code as the streaming source (``read_range``), ``splits`` tasks per partition."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def reader(self, schema: StructType) -> DataSourceReader:
        return KafkaBatchReader(SourceOptions.parse(self.options), int(self.options.get("splits", "2")))


def dimension(spark: SparkSession, settings: Mapping[str, str], topic: str) -> DataFrame:
    """The current devices table rebuilt from its whole changelog: latest value per key, no tombstones."""
    raw = (spark.read.format(FORMAT).options(**{f"kafka.{k}": str(v) for k, v in settings.items()})
           .option("subscribe", topic).load())
    latest = (raw.where(F.col("key") != F.lit(SCHEMA_KEY))
              .groupBy("key").agg(F.max_by("value", "offset").alias("value"))
              .where(F.col("value").isNotNull()))
    schema = spark_schema(DEVICES.spark_ddl())
    return (latest.select(F.from_json(F.col("value").cast("string"), schema).alias("d"))
            .select(*[F.col(f"d.{c}") for c in ("device_id", *JOIN_COLUMNS)]))


class NaiveBatch:
    """The ``foreachBatch`` function of the naive job."""

    def __init__(self, settings: Mapping[str, str], devices_topic: str, writer: Any) -> None:
        self.settings, self.devices_topic, self.writer = dict(settings), devices_topic, writer
        self.schema = events.event_schema(EVENT_DDL)

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        self.write(batch_df, batch_id, dimension(batch_df.sparkSession, self.settings, self.devices_topic))

    def write(self, batch_df: DataFrame, batch_id: int, dim: DataFrame) -> None:
        parsed = events.parse(batch_df, self.schema).where(F.col(events.ERROR).isNull())
        joined = parsed.join(F.broadcast(dim), "device_id", "left")
        cols = [*self.schema.fieldNames(), *JOIN_COLUMNS]
        out = joined.select(F.col("_key").alias("key"),
                            F.to_json(F.struct(*[F.col(c) for c in cols]), JSON_OPTIONS).cast("binary").alias("value"))
        self.writer.write(batch_id, out.toArrow())


class CarefulBatch(NaiveBatch):
    """The careful user's ``foreachBatch``: the dimension is re-read only when its topic changed
    (end offsets probed every batch), and kept cached in between."""

    def __init__(self, settings: Mapping[str, str], devices_topic: str, writer: Any) -> None:
        super().__init__(settings, devices_topic, writer)
        self._ends: dict | None = None
        self._dim: DataFrame | None = None
        self.rebuilds = 0

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        probe = EndOffsetProbe(self.settings)
        try:
            ends = probe.probe(probe.partitions([self.devices_topic])).end
        finally:
            probe.close()
        if self._dim is None or ends != self._ends:
            if self._dim is not None:
                self._dim.unpersist()
            self._dim = dimension(batch_df.sparkSession, self.settings, self.devices_topic).cache()
            self._dim.count()
            self._ends = ends
            self.rebuilds += 1
        self.write(batch_df, batch_id, self._dim)

    def close(self) -> None:
        if self._dim is not None:
            self._dim.unpersist()


def register(spark: SparkSession) -> None:
    spark.dataSource.register(WholeTopicSource)

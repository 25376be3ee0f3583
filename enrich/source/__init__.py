"""The job's source: Kafka topics read as a stream, built on PySpark's Python Data Source API and
confluent-kafka (Spark's own Kafka connector jar is optional; ``builtin=True`` switches to it).

- :func:`stream_format`: the format and options a streaming read of one or more topics takes
  (:func:`enrich.query.read_stream` reads it: the columns of Spark's Kafka source).
- :mod:`enrich.source.kafka`: the data source (``refstream-kafka``); :mod:`enrich.source.offsets`:
  offsets, end-offset probes and admission control; :mod:`enrich.source.fetch`: a task's read of
  its offset range; :mod:`enrich.source.options`: the reader's options.

See docs/kafka-source.md for how offsets, end offsets and admission control work.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from enrich.source.fetch import RangeReader
    from enrich.source.kafka import FORMAT, KafkaDataSource

__all__ = ["FORMAT", "KafkaDataSource", "range_reader", "register", "source_options", "stream_format"]


def __getattr__(name: str) -> Any:
    # The data source is imported on first use (PEP 562), so the job's config, which takes the
    # reader's vocabulary from enrich.source.options, imports neither pyspark nor the source.
    if name not in ("FORMAT", "KafkaDataSource"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("enrich.source.kafka"), name)
    globals()[name] = value
    return value


def register(spark: SparkSession) -> None:
    """Make ``format("refstream-kafka")`` available in ``spark`` (idempotent)."""
    from enrich.source.kafka import KafkaDataSource

    spark.dataSource.register(KafkaDataSource)


def source_options(settings: Mapping[str, str], topics: Sequence[str], *, starting_offsets: str = "latest",
                   max_offsets_per_trigger: int | None = None, fail_on_data_loss: bool = True
                   ) -> dict[str, str]:
    """Reader options, valid for both ``refstream-kafka`` and Spark's built-in ``kafka`` format."""
    opts = {f"kafka.{k}": str(v) for k, v in settings.items()}
    opts["subscribe"] = ",".join(topics)
    opts["startingOffsets"] = starting_offsets
    if max_offsets_per_trigger:
        opts["maxOffsetsPerTrigger"] = str(int(max_offsets_per_trigger))
    if not fail_on_data_loss:
        opts["failOnDataLoss"] = "false"
    return opts


def range_reader(settings: Mapping[str, str], topics: Sequence[str], *, fail_on_data_loss: bool = True,
                 columns: Mapping[str, str] | None = None) -> RangeReader:
    """The step that reads the records of the offset ranges a stream of ``topics`` with the
    ``ranges`` option gives (:func:`stream_format`), with the settings its own reader would use."""
    from enrich.source.fetch import RangeReader
    from enrich.source.options import SourceOptions

    o = SourceOptions.parse(source_options(settings, topics, fail_on_data_loss=fail_on_data_loss))
    return RangeReader(o.settings, o.poll_timeout_s, o.fail_on_data_loss, None if columns is None else dict(columns))


def stream_format(spark: SparkSession, settings: Mapping[str, str], topics: Sequence[str], *,
                  starting_offsets: str = "latest", max_offsets_per_trigger: int | None = None,
                  fail_on_data_loss: bool = True, on_offset_reset: str = "fail", builtin: bool = False,
                  ranges: bool = False) -> tuple[str, dict[str, str]]:
    """The format and options of a streaming read of ``topics`` (the data source registered in
    ``spark``); :func:`enrich.query.read_stream` documents the arguments. ``ranges`` (not with
    ``builtin``): each task's offset range instead of its records (:func:`range_reader` reads them)."""
    opts = source_options(settings, topics, starting_offsets=starting_offsets,
                          max_offsets_per_trigger=max_offsets_per_trigger, fail_on_data_loss=fail_on_data_loss)
    if builtin:
        opts.setdefault("kafka.isolation.level", "read_committed")
        opts["includeHeaders"] = "true"
        return "kafka", opts
    from enrich.source.kafka import FORMAT

    register(spark)
    opts["onOffsetReset"] = on_offset_reset
    if ranges:
        opts["ranges"] = "true"
    return FORMAT, opts

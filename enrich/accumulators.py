"""Spark accumulators the job counts with on the executors and reads on the driver, exact under task
retries and recomputed stages."""

from __future__ import annotations

from typing import Any

from pyspark.accumulators import AccumulatorParam

__all__ = ["KeyedCounts", "KeyedTallies"]


class KeyedCounts(AccumulatorParam[dict[int, int]]):
    """Counts keyed by what produced them (a state bucket, a task's partition): ``{key: count}``.

    Merging keeps the latest value per key, so adding the same value twice changes nothing: every
    attempt at a key within one micro-batch (a retried task, a recomputed stage) sees the same input
    and reports the same count; Spark merges successful attempts only. The driver empties it before a
    batch and sums or merges it after the batch's write."""

    def zero(self, value: dict[int, int]) -> dict[int, int]:
        return {}

    def addInPlace(self, value1: dict[int, int], value2: dict[int, int]) -> dict[int, int]:
        value1.update(value2)
        return value1


class KeyedTallies(AccumulatorParam[dict[int, dict[str, Any]]]):
    """Tallies keyed by what produced them (a state bucket): ``{key: {label: value}}``, merged like
    :class:`KeyedCounts` (the latest tally per key), so a retried or recomputed attempt at a key
    replaces the one before instead of adding to it."""

    def zero(self, value: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        return {}

    def addInPlace(self, value1: dict[int, dict[str, Any]],
                   value2: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        value1.update(value2)
        return value1

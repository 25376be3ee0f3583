"""The stateful processor of the keyed state step (``transformWithStateInPandas``), on the executors.

The step is keyed by a hash bucket of the device key, not by the device: a Python call costs about a
millisecond, so one call per bucket per micro-batch handles all of its devices at once through
:mod:`enrich.state.engine`. A bucket's device states are one value in Spark's state store: the
engine's state table as Arrow IPC bytes. One event-time timer per bucket, at the time its next
device expires, drops expired devices from buckets that get no more events.

Input rows: the parsed events (``enrich.events.parse``) plus ``_bucket`` and ``_ts_us`` (the event
time in microseconds: no time zone travels through pandas). Output rows: the same event columns,
then the flat state fields (``_state_<field>``, times in microseconds) and ``_late``; the streaming
plan (:mod:`enrich.state.stream`) folds the flat fields into the ``state`` struct.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.accumulators import Accumulator, AccumulatorParam
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import BinaryType, StructField, StructType

from enrich.events import ERROR
from enrich.state import engine
from enrich.state.engine import StateSpec

#: The state variable holding a bucket's device table, and its schema.
STATE_NAME = "devices"
VALUE_SCHEMA = StructType([StructField("table", BinaryType(), False)])
#: Columns the plan adds before the step, and the prefix of the flat state fields it emits.
BUCKET, TS_US, FLAT = "_bucket", "_ts_us", "_state_"
LATE = "_late"

_PANDAS_TYPES = {pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(),
                 pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}


class BucketCounts(AccumulatorParam[dict[int, int]]):
    """An accumulator of devices per bucket: ``{bucket: devices in its state after its call}``.

    Merging keeps the latest value per bucket, so updating it twice with the same value changes
    nothing: every attempt at a bucket's call within one micro-batch (a retried task, a recomputed
    stage) starts from the same state version with the same input and reports the same count. The
    driver empties it before each batch and reads it after the batch's sink has written."""

    def zero(self, value: dict[int, int]) -> dict[int, int]:
        return {}

    def addInPlace(self, value1: dict[int, int], value2: dict[int, int]) -> dict[int, int]:
        value1.update(value2)
        return value1


def stored_spec(spec: StateSpec) -> StateSpec:
    """The engine's spec as the processor runs it: event times as int64 microseconds in ``_ts_us``;
    the stored bucket tables (``first_seen``, ``last_seen``) are laid out by it."""
    return dataclasses.replace(spec, timestamp=TS_US, timestamp_type=pa.int64())


class DeviceStateProcessor(StatefulProcessor):
    """One call per bucket and micro-batch: apply its events to its devices' state (see module doc).

    ``spec`` is the engine's spec with ``_ts_us`` as the timestamp; ``inputs`` the input columns in
    the plan's order; ``columns`` the event columns passed through, in output order; ``devices`` an
    accumulator of :class:`BucketCounts` each call reports its bucket's device count to."""

    def __init__(self, spec: StateSpec, inputs: tuple[str, ...], columns: tuple[str, ...],
                 devices: Accumulator[dict[int, int]] | None = None) -> None:
        self.spec, self.inputs, self.columns, self.devices = spec, inputs, columns, devices
        self._types = {spec.key: spec.key_type, spec.timestamp: pa.int64(),
                       **{c: t for c, _, t in spec.aggregates}}

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.value = handle.getValueState(STATE_NAME, VALUE_SCHEMA)

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],  # type: ignore[override]
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        pdf = pd.concat(list(rows), ignore_index=True)
        pdf.columns = list(self.inputs)  # Spark renames columns that start with "_" (to _4, _5...)
        # Shuffle order is not stable: rows leave in source order, so a replay gives the same output.
        pdf = pdf.sort_values(["_partition", "_offset"], kind="stable", ignore_index=True)
        ok = np.flatnonzero(pdf[ERROR].isna().to_numpy())
        table = self._arrow(pdf.iloc[ok])
        applied = engine.apply(self.spec, self._load(), table, _watermark_us(timerValues))
        self._store(key, applied.state)
        at = np.full(len(pdf), -1, dtype=np.int64)
        at[ok] = np.arange(len(ok))
        pick = pa.array(at, mask=at < 0)
        extra = {c: _spark_safe(pdf[c]) for c in self.columns}
        for field, child in zip(applied.column.type, applied.column.flatten(), strict=True):
            extra[FLAT + field.name] = _pandas(child.take(pick))
        extra[LATE] = _pandas(applied.late.take(pick).fill_null(False))
        yield pd.DataFrame(extra)

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        state, dropped = engine.evict(self.spec, self._load(), _watermark_us(timerValues))
        self._store(key, state)
        return iter(())

    def close(self) -> None:
        pass

    def _load(self) -> pa.Table:
        if not self.value.exists():
            return self.spec.empty()
        stored = self.value.get()
        assert stored is not None
        return engine.state_from_ipc(stored[0], self.spec)

    def _store(self, key: Any, state: pa.Table) -> None:
        if self.devices is not None:
            self.devices.add({int(key[0]): state.num_rows})
        if state.num_rows:
            self.value.update((engine.state_to_ipc(state),))
        else:
            self.value.clear()
        for timer in list(self.handle.listTimers()):
            self.handle.deleteTimer(timer)
        expiry = engine.next_expiry(self.spec, state)
        if expiry is not None:
            self.handle.registerTimer(-(-expiry // 1000))  # milliseconds, rounded up: never early

    def _arrow(self, pdf: pd.DataFrame) -> pa.Table:
        cols = [self.spec.key, self.spec.timestamp, *self.spec.ties, *[c for c, _, _ in self.spec.aggregates]]
        arrays = []
        for c in cols:
            a = pa.array(pdf[c], from_pandas=True)
            want = self._types.get(c)
            arrays.append(a.cast(want) if want is not None and a.type != want else a)
        return pa.Table.from_arrays(arrays, names=cols)


def _watermark_us(timer_values: TimerValues) -> int | None:
    """The batch's event-time watermark in microseconds; None before the first one (Spark reports 0)."""
    ms = timer_values.getCurrentWatermarkInMs()
    return ms * 1000 if ms > 0 else None


def _pandas(a: pa.Array) -> pd.Series:
    """A column for Spark's pandas-to-Arrow conversion: nullable dtypes keep integers exact."""
    dtype = _PANDAS_TYPES.get(a.type)
    if dtype is not None:
        return pd.Series(a.to_pandas(types_mapper={a.type: dtype}.get))
    return _spark_safe(pd.Series(a.to_pandas()))


def _spark_safe(s: pd.Series) -> pd.Series:
    """A passed-through column as PySpark's pandas-to-Arrow conversion takes it. Strings as Python
    objects: it fails on pandas 3's Arrow-backed strings (it gets a chunked array); a column of
    nulls only as objects too: pandas infers float64 for it, which the conversion also fails on when
    the column is a string."""
    if isinstance(s.dtype, pd.StringDtype | pd.ArrowDtype) or (len(s) and bool(s.isna().all())):
        return s.astype(object).where(s.notna(), None)
    return s

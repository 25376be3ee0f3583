"""The Kafka output's records made in the writer's own Python worker, from the join pass's Arrow
batches: the enriched events' JSON values, the dead letters' columns and the flags the tasks count,
as :func:`enrich.sinks.kafka.sink.records_frame` makes them in the JVM.

Fused into the writer's ``mapInArrow`` (:class:`Fused`), the join pass's wide rows never cross
into the JVM and back, and Spark's ``to_json`` (a third of the JVM's time per event,
docs/benchmarks.md) is not run: every column becomes an array of JSON fragments with Arrow
kernels, and a row's fragments are joined by one kernel call (:mod:`refstream.encode`'s way).

The JSON is the one Spark's ``to_json`` writes with :data:`enrich.sinks.abc.JSON_OPTIONS`, value
for value: nulls kept, timestamps as ``yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX`` in the session's time
zone (``Z`` at offset zero), timestamps without zone without one, dates ``yyyy-MM-dd``, decimals as
numbers, floats as numbers with a fraction or exponent (``20.0``) and NaN and the infinities as the
strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, bytes in base64, structs as objects. Number
spellings may differ (``1e+10`` against Spark's ``1.0E10``): the same numbers. A batch whose
output has a type not listed here (arrays, maps) is written through ``to_json``
(:func:`supported`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    NullType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from enrich.columns import (
    CORRECTION,
    ERROR,
    IDENTITY,
    KIND,
    KIND_CORRECTION,
    KIND_EVENT,
    LATE,
    SLOW,
    UNMATCHED,
)
from enrich.sinks.deadletter import COLUMNS as DEAD_COLUMNS
from refstream import encode

__all__ = ["Fused", "RecordMaker", "json_values", "supported"]

_SIMPLE = (StringType, ByteType, ShortType, IntegerType, LongType, BooleanType, DateType, BinaryType,
           FloatType, DoubleType, TimestampType, TimestampNTZType, NullType)


def supported(dtype: DataType) -> bool:
    """Whether :func:`json_values` writes ``dtype`` (a struct: every field's type)."""
    if isinstance(dtype, StructType):
        return all(supported(f.dataType) for f in dtype.fields)
    if isinstance(dtype, DecimalType):
        return dtype.scale >= 0
    return isinstance(dtype, _SIMPLE)


_LARGE = pa.large_string()


def _s(text: str) -> pa.Scalar:
    return pa.scalar(text, _LARGE)


def _valid(arr: pa.Array, text: pa.Array) -> pa.Array:
    """``text`` where ``arr`` holds a value, ``null`` (the JSON) elsewhere."""
    text = pc.cast(text, _LARGE)
    if arr.null_count:
        text = pc.if_else(arr.is_valid(), text, _s("null"))
    return text


def _floats(arr: pa.Array) -> pa.Array:
    text = pc.cast(pc.cast(arr, pa.string()), _LARGE)
    # Arrow writes a whole number without a fraction ("20"), NaN and the infinities as nan/inf.
    whole = pc.invert(pc.match_substring_regex(text, "[.en]"))
    text = pc.if_else(whole, pc.binary_join_element_wise(text, _s(".0"), _s("")), text)
    if pc.any(pc.match_substring(text, "n")).as_py():
        text = pc.replace_substring_regex(text, "^nan$", '"NaN"')
        text = pc.replace_substring_regex(text, "^-inf$", '"-Infinity"')
        text = pc.replace_substring_regex(text, "^inf$", '"Infinity"')
    return _valid(arr, pc.fill_null(text, "null"))


def _wall(arr: pa.Array) -> pa.Array:
    """``YYYY-MM-DDTHH:MM:SS.ffffff`` of a zone-less microsecond timestamp array."""
    return pc.utf8_replace_slice(pc.cast(arr, _LARGE), 10, 11, "T")


def _offsets(seconds: np.ndarray) -> pa.Array:
    """``Z`` or ``+hh:mm`` per UTC offset (seconds), as Spark's ``XXX``."""
    found, at = np.unique(seconds, return_inverse=True)
    text = []
    for s in found.tolist():
        sign, m = ("-" if s < 0 else "+"), abs(int(s)) // 60
        text.append("Z" if s == 0 else f"{sign}{m // 60:02d}:{m % 60:02d}")
    return pa.array(text, _LARGE).take(pa.array(at.reshape(-1), pa.int64()))


def _timestamps(arr: pa.Array, timezone: str) -> pa.Array:
    us = pc.cast(arr, pa.timestamp("us", tz="UTC"))
    zero = us.fill_null(0)
    if timezone in ("UTC", "Z", "+00:00", "Etc/UTC", "GMT"):
        text = pc.binary_join_element_wise(_s('"'), _wall(zero.cast(pa.timestamp("us"))), _s('Z"'), _s(""))
    else:
        local = pc.local_timestamp(zero.cast(pa.timestamp("us", tz=timezone)))
        shift = (local.cast(pa.int64()).to_numpy(zero_copy_only=False)
                 - zero.cast(pa.int64()).to_numpy(zero_copy_only=False)) // 1_000_000
        text = pc.binary_join_element_wise(_s('"'), _wall(local), _offsets(shift), _s('"'), _s(""))
    return _valid(arr, text)


def _timestamps_ntz(arr: pa.Array) -> pa.Array:
    wall = _wall(pc.cast(arr, pa.timestamp("us")).fill_null(0))
    return _valid(arr, pc.binary_join_element_wise(_s('"'), wall, _s('"'), _s("")))


def _object(names: Sequence[str], parts: Sequence[pa.Array | pa.Scalar], n: int) -> pa.Array:
    """``{"name":fragment,...}`` per row (a scalar part: the same in every row)."""
    if not names:
        return pa.array(["{}"] * n, _LARGE)
    args: list[pa.Scalar | pa.Array] = []
    for i, (name, part) in enumerate(zip(names, parts, strict=True)):
        args += [_s(("{" if i == 0 else ",") + json.dumps(name, ensure_ascii=False) + ":"), part]
    return pc.binary_join_element_wise(*args, _s("}"), _s(""))


def fragments(arr: pa.Array, dtype: DataType, timezone: str) -> pa.Array:
    """The JSON text of every value of ``arr`` (Spark type ``dtype``) as a large_string array
    without nulls (``null`` for a null)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if isinstance(dtype, StructType):
        fields = [fragments(pc.struct_field(arr, [i]), f.dataType, timezone) for i, f in enumerate(dtype.fields)]
        return _valid(arr, _object([f.name for f in dtype.fields], fields, len(arr)))
    if isinstance(dtype, FloatType | DoubleType):
        return _floats(arr)
    if isinstance(dtype, TimestampType):
        return _timestamps(arr, timezone)
    if isinstance(dtype, TimestampNTZType):
        return _timestamps_ntz(arr)
    if isinstance(dtype, DecimalType):
        return _valid(arr, pc.fill_null(pc.cast(arr, pa.string()), "null"))
    return encode.fragments(arr)


def json_values(t: pa.Table | pa.RecordBatch, schema: StructType, timezone: str,
                constants: Sequence[tuple[str, str]] = ()) -> pa.Array:
    """Each row of ``t``'s columns named by ``schema``, then the string fields ``constants`` (name,
    value: the same in every row), as the JSON object Spark's ``to_json`` writes of it (the
    module's doc), one binary value per row."""
    parts: list[pa.Array | pa.Scalar] = [fragments(t.column(f.name), f.dataType, timezone) for f in schema.fields]
    parts += [_s(json.dumps(v, ensure_ascii=False)) for _, v in constants]
    joined = _object([*schema.names, *(n for n, _ in constants)], parts, t.num_rows)
    return pc.cast(joined, pa.large_binary()).cast(pa.binary())


@dataclass(frozen=True)
class RecordMaker:
    """One Arrow batch of the join pass to the Kafka writer's rows, as ``records_frame`` makes them:
    ``key``, ``value`` (the JSON of ``values``' columns and ``constants`` for a good event, null for a dead letter or
    an event the fast parser left to ``from_json``), the dead-letter columns (``_error``, ``_key``
    and ``_value`` of dead letters only, the positions of every row), ``_slow``, and the flags the
    tasks count: ``_unmatched`` (some of the ``matched`` columns not true), ``_late``."""

    values: StructType
    matched: tuple[str, ...]
    timezone: str
    constants: tuple[tuple[str, str], ...] = ((KIND, KIND_EVENT),)

    def __call__(self, t: pa.Table) -> pa.RecordBatch:
        names = t.column_names
        failed = t.column(ERROR).is_valid()
        good = pc.invert(failed)
        if SLOW in names:
            good = pc.and_(good, pc.invert(pc.fill_null(t.column(SLOW), False)))
        value = json_values(t, self.values, self.timezone, self.constants)
        if not pc.all(good).as_py():  # (the common batch has only good events: no copy of the values)
            value = pc.if_else(good, value, pa.scalar(None, pa.binary()))
        cols: dict[str, pa.Array] = {"key": t.column("_key"), "value": value}
        any_failed = pc.any(failed).as_py()
        for c in DEAD_COLUMNS:
            col = t.column(c)
            if c in IDENTITY:
                cols[c] = col
            else:
                cols[c] = pc.if_else(failed, col, pa.scalar(None, col.type)) if any_failed else pa.nulls(len(col), col.type)
        if SLOW in names:
            cols[SLOW] = t.column(SLOW)
        flags = []
        if self.matched:
            every = functools.reduce(pc.and_, [pc.fill_null(t.column(m), False) for m in self.matched])
            cols[UNMATCHED] = pc.invert(every)
            flags.append(UNMATCHED)
        if LATE in names:
            cols[LATE] = pc.fill_null(t.column(LATE), False)
            flags.append(LATE)
        if KIND in names:  # with corrections: counted apart, never as unmatched or late
            fixed = pc.fill_null(pc.equal(t.column(KIND), KIND_CORRECTION), False)
            for f in flags:
                cols[f] = pc.and_(cols[f], pc.invert(fixed))
            cols[CORRECTION] = fixed
        return pa.RecordBatch.from_pydict({k: _array(v) for k, v in cols.items()})


def _array(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


@dataclass(frozen=True)
class Fused:
    """The join pass (``step``: :class:`enrich.joins.Enricher`; None: the rows are joined already)
    and :class:`RecordMaker`, run in the Kafka writer's task in place of a ``mapInArrow`` of their own."""

    step: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None
    make: RecordMaker

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in (self.step(batches) if self.step is not None else batches):
            if b.num_rows:
                yield self.make(pa.Table.from_batches([b]))

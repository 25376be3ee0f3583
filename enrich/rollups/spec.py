"""What a rollup computes, and the schemas of its tables: the partial aggregates of its windows
(:meth:`RollupSpec.window_schema`), a bucket's state (:func:`enrich.rollups.engine.state_schema`) and
the rows it writes (:meth:`RollupSpec.output_schema`).

A rollup groups events by its ``by`` columns and a tumbling event-time window of ``window_us``
microseconds aligned to the epoch: an event at ``ts`` (µs UTC) falls in the window starting at
``floor(ts / window_us) * window_us`` (negative times too) and ending, exclusive, ``window_us`` later.
A null ``by`` value is a group of its own.

Metrics per column: ``count`` (non-null values), ``count_distinct`` (exact) and ``last`` (the value
of the latest event by event time, ties by Kafka partition then offset) take a column of any type;
``min``, ``max``, ``sum``, ``mean`` and the percentiles ``p50``/``p95``/``p99`` a numeric one. Nulls,
NaN and +-Infinity are ignored by every metric; a metric of no values is null (``count`` and
``count_distinct``: 0). Percentiles come from KLL sketches (:mod:`enrich.rollups.sketch`): exact
below ``KLL_K`` values in a window, within ``KLL_RANK_ERROR`` of the true rank beyond.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import pyarrow as pa

Metric = Literal["count", "min", "max", "mean", "sum", "last", "p50", "p95", "p99", "count_distinct"]
METRICS: tuple[Metric, ...] = get_args(Metric)
#: The metrics that need a numeric (integer or floating point) column.
NUMERIC_METRICS: frozenset[Metric] = frozenset({"min", "max", "mean", "sum", "p50", "p95", "p99"})
#: The percentiles' normalized ranks.
QUANTILES: dict[Metric, float] = {"p50": 0.50, "p95": 0.95, "p99": 0.99}

#: The output's own columns (besides the ``by`` columns and the metrics), and the state's flag.
WINDOW_START, WINDOW_END = "window_start", "window_end"
KIND, REVISION, EVENTS, FINALIZED_BY, CAUSE = "_kind", "_revision", "_events", "_finalized_by", "_cause"
FINAL = "_final"
#: A per-device rollup's window inside a gap of its device (``gaps:``, with ``fill``): the row says
#: the device was silent, not that it had nothing to report.
GAP = "_gap"
#: ``_kind`` values; ``_finalized_by`` values (a final row's); ``_cause`` of a correction.
PROVISIONAL_KIND, FINAL_KIND, CORRECTION_KIND = "provisional", "final", "correction"
BY_WATERMARK, BY_IDLE = "watermark", "idle"
LATE_EVENT = "late event"

TIMESTAMP = pa.timestamp("us", tz="UTC")

# The accumulators of a metric column, in the window table's column order, and which metrics need each.
_ACCUMULATORS: tuple[tuple[str, frozenset[str]], ...] = (
    ("n", frozenset({"count", "mean"})),
    ("sum", frozenset({"sum", "mean"})),
    ("min", frozenset({"min"})),
    ("max", frozenset({"max"})),
    ("last", frozenset({"last"})),
    ("last_ts", frozenset({"last"})),
    ("last_p", frozenset({"last"})),
    ("last_o", frozenset({"last"})),
    ("kll", frozenset({"p50", "p95", "p99"})),
    ("set", frozenset({"count_distinct"})),
)


def numeric(typ: pa.DataType) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ)


def accumulators(metrics: tuple[Metric, ...]) -> tuple[str, ...]:
    """The accumulators (``n``, ``sum``, ...) a column's ``metrics`` need, in column order."""
    return tuple(acc for acc, needed_by in _ACCUMULATORS if needed_by.intersection(metrics))


def metric_type(metric: Metric, typ: pa.DataType) -> pa.DataType:
    """The output type of ``metric`` over a column of type ``typ``."""
    if metric in ("count", "count_distinct"):
        return pa.int64()
    if metric in ("min", "max", "last"):
        return typ
    return pa.float64()


@dataclass(frozen=True)
class RollupSpec:
    """One rollup, resolved against the events' schema; picklable.

    ``metrics`` holds ``(column, metrics, arrow type of the column)``. ``correct_for_us``: how long
    after a window's end a late event still corrects it (the correction horizon); the window's state
    is dropped once the watermark reaches ``window_end + correct_for_us``. ``fill`` and
    ``idle_finalize_us`` are the job's to act on (the engine's :func:`~enrich.rollups.engine.finalize_idle`
    is what an idle timer calls)."""

    name: str
    by: tuple[str, ...]
    by_types: tuple[pa.DataType, ...]
    window_us: int
    metrics: tuple[tuple[str, tuple[Metric, ...], pa.DataType], ...]
    correct_for_us: int
    fill: bool = False
    idle_finalize_us: int | None = None
    #: With ``fill``: the dataset of the broadcast join every ``by`` column comes from (its key or its
    #: columns), whose every key gets a row for each window the watermark passes; None: keys with events.
    fill_keys: str | None = None
    #: With ``fill`` by the state key alone and ``gaps:``: each row says whether its window lies in a
    #: gap of its device (``_gap``), from the gaps the state step closes and withdraws.
    gaps: bool = False
    #: Its ``by`` or metric columns hold a column a corrected join adds in the state step: a late
    #: version moves events between its windows (:func:`enrich.rollups.engine.move`), so the rollup
    #: step keeps each window's part from each state bucket.
    moves: bool = False

    @property
    def needs_ticks(self) -> bool:
        """Whether every rollup bucket must be called each trigger (the tick source): to finalize by
        wall clock, or to fill windows of keys that have no events."""
        return self.idle_finalize_us is not None or self.fill_keys is not None

    def __post_init__(self) -> None:
        where = f"rollup {self.name!r}"
        if len(self.by) != len(self.by_types):
            raise ValueError(f"{where}: {len(self.by)} by column(s) but {len(self.by_types)} type(s)")
        if len(set(self.by)) != len(self.by):
            raise ValueError(f"{where}: by names a column twice: {list(self.by)}")
        if self.window_us <= 0:
            raise ValueError(f"{where}: the window must be positive, not {self.window_us} µs")
        if self.correct_for_us <= 0:
            raise ValueError(f"{where}: the correction horizon must be positive, not {self.correct_for_us} µs")
        if self.idle_finalize_us is not None and self.idle_finalize_us <= 0:
            raise ValueError(f"{where}: idle_finalize must be positive, not {self.idle_finalize_us} µs")
        if not self.metrics:
            raise ValueError(f"{where}: no metrics")
        seen: set[str] = set()
        for column, metrics, typ in self.metrics:
            if column in seen:
                raise ValueError(f"{where}: column {column!r} is listed twice; give all its metrics at once")
            seen.add(column)
            if not metrics:
                raise ValueError(f"{where}: column {column!r} has no metrics")
            bad = [m for m in metrics if m not in METRICS]
            if bad:
                raise ValueError(f"{where}: metric(s) {bad} of column {column!r} are not among {list(METRICS)}")
            if len(set(metrics)) != len(metrics):
                raise ValueError(f"{where}: column {column!r} lists a metric twice: {list(metrics)}")
            need = [m for m in metrics if m in NUMERIC_METRICS]
            if need and not numeric(typ):
                raise ValueError(f"{where}: metric(s) {need} need a numeric column; {column!r} is {typ}")
        # A by column named like an output column (or two metrics' names meeting) would make the
        # tables ambiguous.
        for names in (self.output_schema().names, [*self.window_schema().names, REVISION, FINAL]):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{where}: column name(s) {dup} would appear twice in its rows; rename the "
                                 "by column(s)")

    def output_schema(self) -> pa.Schema:
        """The rows the rollup writes: the ``by`` columns, the window, ``<column>_<metric>`` per metric
        in configured order, and the row's kind, revision, event count, and why it is final or a
        correction."""
        return self._made("_made_output_schema", self._output_schema)

    def window_schema(self) -> pa.Schema:
        """A window table (:mod:`enrich.rollups.partial`): one row per (``by`` values, window) with
        the window's start (µs), its event count and, per metric column ``c``, the accumulators its
        metrics need: ``c.n`` (non-null count), ``c.sum``, ``c.min``, ``c.max``, ``c.last`` with the
        time, partition and offset of its event (``c.last_ts``/``c.last_p``/``c.last_o``), ``c.kll``
        (a serialized KLL sketch, null for no values) and ``c.set`` (the distinct values, sorted)."""
        return self._made("_made_window_schema", self._window_schema)

    def _made(self, name: str, make: Callable[[], pa.Schema]) -> pa.Schema:
        """A schema made once per spec: the steps ask for them on every call of every bucket."""
        got = self.__dict__.get(name)
        if got is None:
            got = make()
            object.__setattr__(self, name, got)  # a cache beside the fields, not one of them
        return got

    def _output_schema(self) -> pa.Schema:
        fields = [pa.field(b, t) for b, t in zip(self.by, self.by_types, strict=True)]
        fields += [pa.field(WINDOW_START, TIMESTAMP, False), pa.field(WINDOW_END, TIMESTAMP, False)]
        fields += [pa.field(f"{column}_{m}", metric_type(m, typ)) for column, metrics, typ in self.metrics
                   for m in metrics]
        fields += [pa.field(KIND, pa.string(), False), pa.field(REVISION, pa.int64(), False),
                   pa.field(EVENTS, pa.int64(), False), pa.field(FINALIZED_BY, pa.string()),
                   pa.field(CAUSE, pa.string())]
        if self.gaps:
            fields.append(pa.field(GAP, pa.bool_(), False))
        return pa.schema(fields)

    def _window_schema(self) -> pa.Schema:
        fields = [pa.field(b, t) for b, t in zip(self.by, self.by_types, strict=True)]
        fields += [pa.field(WINDOW_START, pa.int64(), False), pa.field(EVENTS, pa.int64(), False)]
        for column, metrics, typ in self.metrics:
            for acc in accumulators(metrics):
                acc_type = {"n": pa.int64(), "sum": pa.float64(), "last_ts": pa.int64(), "last_p": pa.int64(),
                            "last_o": pa.int64(), "kll": pa.binary(), "set": pa.list_(typ)}.get(acc, typ)
                fields.append(pa.field(f"{column}.{acc}", acc_type, acc not in ("n", "set")))
        return pa.schema(fields)

    def empty_windows(self) -> pa.Table:
        return self.window_schema().empty_table()

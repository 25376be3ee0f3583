"""The rollup engine: one bucket of (``by`` values, window)s, one micro-batch of their partial
aggregates, in Arrow.

Pure and vectorised (no Spark): the keyed step calls :func:`advance` once per bucket per micro-batch
with the bucket's state table, the batch's window table for the bucket
(:func:`enrich.rollups.partial.partials`) and the batch's watermark, and :func:`finalize_idle` when a bucket got no events for the rollup's
``idle_finalize``. The state is a window table with each window's ``_revision`` (the last revision
written, 0: never) and ``_final`` (a final row was written).

Semantics, per window (``window_end = window_start + window_us``; the watermark has *reached* a
window when ``watermark >= window_end``):

* A window the batch touched is merged with its stored partial and written with its revision + 1:
  ``provisional`` while the watermark has not reached it (or there is none); once it has, ``final``
  (``_finalized_by: watermark``) if no final row was written yet - a window whose events all came
  after the watermark passed its end is written final at once, never first as a correction - and
  else a ``correction`` (``_cause: late event``).
* A window the batch did not touch, not final, that the watermark has reached, is written ``final``
  (``watermark``) from its stored partial, its revision + 1.
* A final window is dropped from the state once the watermark reaches ``window_end +
  correct_for_us`` (after its row of this batch, if any, is written). Events of a window beyond that
  horizon must be left out before their partials are built (:func:`beyond_horizon`): they would
  otherwise start the window afresh and write it final again with revision 1.
* :func:`finalize_idle` writes every window not yet final ``final`` (``_finalized_by: idle``); a later
  event of such a window writes a correction, whatever the watermark (even none).

Every row carries its window's metrics as of its revision, computed from the partial: ``count``,
``sum``, ``min``, ``max``, ``mean`` (``sum / count``), ``last``, ``p50``/``p95``/``p99`` (the
sketch's quantile; :mod:`enrich.rollups.sketch`) and ``count_distinct``, null (counts: 0) when the
window has no values of the column, and ``_events``, the window's event count. A window's revisions
increase strictly, exactly one of its rows is final and every row after that is a correction. Rows
and the state come sorted by the ``by`` columns (nulls last) and the window start, so the same
inputs give the same tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from enrich.ipc import from_ipc, to_ipc
from enrich.rollups import sketch
from enrich.rollups.partial import as_numpy, combine_sorted, sort_groups
from enrich.rollups.spec import (
    BY_IDLE,
    BY_WATERMARK,
    CAUSE,
    CORRECTION_KIND,
    EVENTS,
    FINAL,
    FINAL_KIND,
    FINALIZED_BY,
    GAP,
    KIND,
    LATE_EVENT,
    PROVISIONAL_KIND,
    QUANTILES,
    REVISION,
    TIMESTAMP,
    WINDOW_END,
    WINDOW_START,
    RollupSpec,
)


def state_schema(spec: RollupSpec) -> pa.Schema:
    """A bucket's state: its window table, with each window's last revision written and whether a
    final row was written (and, marking gaps, whether it lies in a gap of its device)."""
    return pa.schema([*spec.window_schema(), pa.field(REVISION, pa.int64(), False),
                      pa.field(FINAL, pa.bool_(), False), *([pa.field(GAP, pa.bool_(), False)] if spec.gaps else [])])


@dataclass(frozen=True)
class Marks:
    """A batch's gaps of the devices of a per-device rollup (``by`` the state key): the closed ones
    (their empty windows lie in a gap) and the withdrawn ones (theirs no longer do, unless a closed
    one holds them), each ``(key, start µs, end µs or None: open)``."""

    closed: tuple[tuple[Any, int, int | None], ...] = ()
    withdrawn: tuple[tuple[Any, int, int | None], ...] = ()

    @classmethod
    def of(cls, table: pa.Table | None) -> Marks:
        """From the state step's table (``key``, ``start``, ``end``, ``closed``)."""
        if table is None or not table.num_rows:
            return cls()
        rows = list(zip(table.column("key").to_pylist(), table.column("start").to_pylist(),
                        table.column("end").to_pylist(), table.column("closed").to_pylist(), strict=True))
        return cls(tuple((k, s, e) for k, s, e, c in rows if c), tuple((k, s, e) for k, s, e, c in rows if not c))


def _marked(spec: RollupSpec, windows: pa.Table, old: np.ndarray, marks: Marks) -> np.ndarray:
    """Each window's ``_gap`` after ``marks``: a window of no events wholly inside a closed gap of its
    device is in a gap; one inside a withdrawn gap is not, unless a closed one holds it."""
    gap = old.copy()
    if not windows.num_rows or not (marks.closed or marks.withdrawn):
        return gap
    # Each mark looks at its own device's windows only: a site's outage marks thousands at once.
    keys = windows.column(spec.by[0]).to_pylist()
    marked_keys = {k for k, _, _ in (*marks.closed, *marks.withdrawn)}
    rows: dict[Any, list[int]] = {}
    for i, k in enumerate(keys):
        if k in marked_keys:
            rows.setdefault(k, []).append(i)
    start = as_numpy(windows.column(WINDOW_START))
    empty = as_numpy(windows.column(EVENTS)) == 0
    for marked, intervals in ((False, marks.withdrawn), (True, marks.closed)):
        for k, s, e in intervals:
            at = np.asarray(rows.get(k, ()), dtype=np.int64)
            if not len(at):
                continue
            inside = at[(start[at] >= s) & (start[at] + spec.window_us <= (e if e is not None else np.iinfo(np.int64).max))]
            gap[inside[empty[inside]] if marked else inside] = marked
    return gap & empty


@dataclass(frozen=True)
class Advanced:
    """:func:`advance`'s (and :func:`finalize_idle`'s) result: the bucket's new state table, the rows
    to write (``spec.output_schema()``), how many windows were dropped from the state, and how many
    of the batch's events went into windows already final (written as corrections)."""

    state: pa.Table
    rows: pa.Table
    evicted: int
    corrected: int = 0


def advance(spec: RollupSpec, state: pa.Table | None, partials: pa.Table | None,
            watermark_us: int | None, marks: Marks | None = None) -> Advanced:
    """Fold one micro-batch's window table into the bucket's state and write what changed (see the
    module docstring). ``watermark_us``: the batch's watermark in microseconds (None: the
    watermark makes no window final and drops none). ``marks``: the batch's gaps of the rollup's
    devices (:class:`Marks`; a rollup that marks gaps): a window whose ``_gap`` they change is
    written again."""
    sschema, wschema = state_schema(spec), spec.window_schema()
    state = sschema.empty_table() if state is None else state.cast(sschema)
    batch = wschema.empty_table() if partials is None else partials.cast(wschema)
    stored = state.num_rows
    if stored + batch.num_rows == 0:
        return Advanced(state, spec.output_schema().empty_table(), 0)
    gaps_before = np.concatenate([as_numpy(state.column(GAP)), np.zeros(batch.num_rows, bool)]) if spec.gaps \
        else None

    windows = pa.concat_tables([state.select(wschema.names), batch])
    order, starts = sort_groups(windows, [*spec.by, WINDOW_START])
    n = windows.num_rows
    sizes = np.diff(np.append(starts, n))
    revisions = np.concatenate([as_numpy(state.column(REVISION)), np.zeros(batch.num_rows, np.int64)])[order]
    finals = np.concatenate([as_numpy(state.column(FINAL)), np.zeros(batch.num_rows, bool)])[order]
    touched = np.logical_or.reduceat(order >= stored, starts)
    revision = np.maximum.reduceat(revisions, starts)
    was_final = np.logical_or.reduceat(finals, starts)
    fresh = np.concatenate([np.zeros(stored, np.int64), as_numpy(batch.column(EVENTS))])[order]
    corrected = int(np.add.reduceat(fresh, starts)[was_final].sum())

    # Only the touched windows have rows to combine; an untouched one is its single stored row.
    rows_touched = np.repeat(touched, sizes)
    merged = combine_sorted(spec, windows.take(pa.array(order[rows_touched])),
                            np.cumsum(np.concatenate([[0], sizes[touched]]))[:-1].astype(np.int64))
    kept = windows.take(pa.array(order[starts[~touched]]))
    placed = np.concatenate([np.flatnonzero(touched), np.flatnonzero(~touched)])
    windows = pa.concat_tables([merged, kept]).take(pa.array(np.argsort(placed)))

    end = as_numpy(windows.column(WINDOW_START)) + spec.window_us
    reached = end <= watermark_us if watermark_us is not None else np.zeros(len(end), bool)
    written = touched | (reached & ~was_final)
    gap = None
    if gaps_before is not None:
        old = np.logical_or.reduceat(gaps_before[order], starts)
        gap = _marked(spec, windows, old, marks or Marks())
        written |= gap != old
    kind = _kind(was_final, reached)
    revision = revision + written
    final = was_final | reached
    rows = _rows(spec, windows, written, kind, revision, BY_WATERMARK, gap)
    evict = final & (end + spec.correct_for_us <= watermark_us) if watermark_us is not None \
        else np.zeros(len(end), bool)
    new_state = _state(windows, revision, final, gap).filter(pa.array(~evict))
    return Advanced(new_state, rows, int(evict.sum()), corrected)


def fill(spec: RollupSpec, state: pa.Table | None, partials: pa.Table | None,
         watermark_us: int | None = None) -> pa.Table:
    """``fill: true``: a window table of the empty windows (no events: ``_events`` and the counts 0,
    the other accumulators null) between each key's first and last window in ``state`` and
    ``partials`` that neither holds; folded in by :func:`advance` with the batch's partials, they
    are written as any window is (provisional, then final). Only windows within the correction
    horizon are filled: those whose end plus ``correct_for`` is past ``watermark_us``, and without a
    watermark those within ``correct_for`` before the key's last window; so one event with a
    timestamp far in the past fills at most ``correct_for / window`` windows of its key."""
    wschema = spec.window_schema()
    parts = [t.select(wschema.names).cast(wschema) for t in (state, partials) if t is not None and t.num_rows]
    if not parts:
        return wschema.empty_table()
    windows = pa.concat_tables(parts)
    keys = [f"k{i}" for i in range(len(spec.by))]  # names of their own: a by column may be called anything
    t = pa.Table.from_arrays([*(windows.column(b) for b in spec.by), windows.column(WINDOW_START)],
                             names=[*keys, "start"])
    grouped = t.group_by(keys, use_threads=False).aggregate([("start", "list")])
    missing: list[int] = []
    at: list[int] = []
    w = spec.window_us
    for i, starts in enumerate(grouped.column("start_list").to_pylist()):
        have = set(starts)
        last = max(have)
        if watermark_us is not None:  # the first window still correctable: end + correct_for > watermark
            first = ((watermark_us - spec.correct_for_us - w) // w + 1) * w
        else:  # the first within correct_for before the key's last
            first = -((spec.correct_for_us - last) // w) * w
        first = max(min(have), first)
        gaps = [s for s in range(first, last, w) if s not in have]
        missing += gaps
        at += [i] * len(gaps)
    if not missing:
        return wschema.empty_table()
    take = pa.array(at, pa.int64())
    keyed = pa.Table.from_arrays([grouped.column(k).take(take) for k in keys], names=list(spec.by))
    return empty_windows(spec, keyed, pa.array(missing, pa.int64()))


def empty_windows(spec: RollupSpec, keys: pa.Table, starts: pa.Array) -> pa.Table:
    """A window table of empty windows: ``keys`` (the ``by`` columns) at ``starts`` (µs), row by row;
    ``_events`` and the counts 0, the other accumulators null."""
    wschema = spec.window_schema()
    n = keys.num_rows
    columns: dict[str, pa.Array | pa.ChunkedArray] = {b: keys.column(b) for b in spec.by}
    columns[WINDOW_START] = starts
    for f in wschema:
        if f.name in columns:
            continue
        if f.name == EVENTS or f.name.endswith(".n"):
            columns[f.name] = pa.array(np.zeros(n, np.int64))
        elif f.name.endswith(".set"):
            columns[f.name] = pa.array([[]] * n, f.type)
        else:
            columns[f.name] = pa.nulls(n, f.type)
    return pa.Table.from_arrays([pc.cast(columns[f.name], f.type) for f in wschema], schema=wschema)


def finalize_idle(spec: RollupSpec, state: pa.Table | None) -> Advanced:
    """Write every window of the bucket that is not final yet ``final`` (``_finalized_by: idle``),
    its revision + 1; nothing is dropped (there is no watermark to drop by)."""
    sschema = state_schema(spec)
    state = sschema.empty_table() if state is None else state.cast(sschema)
    was_final = as_numpy(state.column(FINAL)).astype(bool)
    written = ~was_final
    revision = as_numpy(state.column(REVISION)) + written
    windows = state.select(spec.window_schema().names)
    kind = np.full(state.num_rows, FINAL_KIND)
    gap = as_numpy(state.column(GAP)).astype(bool) if spec.gaps else None
    rows = _rows(spec, windows, written, kind, revision, BY_IDLE, gap)
    return Advanced(_state(windows, revision, np.ones(state.num_rows, bool), gap), rows, 0)


def beyond_horizon(spec: RollupSpec, ts_us: np.ndarray, watermark_us: int | None) -> np.ndarray:
    """Per event time (µs), whether its window is beyond the correction horizon: ``window_end +
    correct_for_us <= watermark``. Such events are to be left out (their window's state is gone);
    all False without a watermark."""
    ts = np.asarray(ts_us, dtype=np.int64)
    if watermark_us is None:
        return np.zeros(ts.shape, dtype=bool)
    end = np.floor_divide(ts, spec.window_us) * spec.window_us + spec.window_us
    return np.asarray(end + spec.correct_for_us <= watermark_us)


def state_to_ipc(table: pa.Table) -> bytes:
    """A bucket's state table as bytes (Arrow IPC stream), the value kept in Spark's state store."""
    return to_ipc(table)


def state_from_ipc(data: bytes, spec: RollupSpec) -> pa.Table:
    """The inverse of :func:`state_to_ipc`; a table of another schema (other rollup settings) is refused."""
    table = from_ipc(data)
    if table.schema != state_schema(spec):
        raise ValueError(f"stored state of rollup {spec.name!r} has schema {table.schema}, "
                         f"expected {state_schema(spec)}")
    return table


def _kind(was_final: np.ndarray, reached: np.ndarray) -> np.ndarray:
    """A written window's kind: a final one (by the watermark or idle) only ever gets corrections
    after its final row; another is final once the watermark has reached its end (at once when it
    was first written after that), else provisional."""
    return np.where(was_final, CORRECTION_KIND, np.where(reached, FINAL_KIND, PROVISIONAL_KIND))


def _state(windows: pa.Table, revision: np.ndarray, final: np.ndarray, gap: np.ndarray | None = None) -> pa.Table:
    out = (windows.append_column(pa.field(REVISION, pa.int64(), False), pa.array(revision, pa.int64()))
           .append_column(pa.field(FINAL, pa.bool_(), False), pa.array(final, pa.bool_())))
    return out if gap is None else out.append_column(pa.field(GAP, pa.bool_(), False), pa.array(gap, pa.bool_()))


def _rows(spec: RollupSpec, windows: pa.Table, written: np.ndarray, kind: np.ndarray, revision: np.ndarray,
          finalized_by: str, gap: np.ndarray | None = None) -> pa.Table:
    """The output rows of the ``written`` windows: their metrics, and ``kind`` and ``revision`` per
    window; ``finalized_by`` is what a final row says made it final; ``gap`` (a rollup marking
    gaps) whether each window lies in a gap of its device."""
    schema = spec.output_schema()
    pick = pa.array(np.flatnonzero(written))
    t = windows.take(pick)
    kind, revision = kind[written], revision[written]
    start = pa.array(as_numpy(t.column(WINDOW_START)), pa.int64())
    out: dict[str, pa.Array] = {b: t.column(b).combine_chunks() for b in spec.by}
    out[WINDOW_START] = start.cast(TIMESTAMP)
    out[WINDOW_END] = pc.add(start, spec.window_us).cast(TIMESTAMP)
    for column, metrics, _typ in spec.metrics:
        def acc(name: str, column: str = column) -> pa.Array:
            return t.column(f"{column}.{name}").combine_chunks()

        wanted = [m for m in metrics if m in QUANTILES]
        percentiles = _percentiles(acc("kll"), [QUANTILES[m] for m in wanted]) if wanted else []
        for m in metrics:
            name = f"{column}_{m}"
            if m == "count":
                out[name] = acc("n")
            elif m in ("sum", "min", "max", "last"):
                out[name] = acc(m)
            elif m == "mean":
                count = acc("n")
                mean = pc.divide(acc("sum"), pc.cast(count, pa.float64()))
                out[name] = pc.if_else(pc.greater(count, 0), mean, pa.scalar(None, pa.float64()))
            elif m == "count_distinct":
                out[name] = pc.list_value_length(acc("set"))
            else:
                out[name] = percentiles[wanted.index(m)]
    out[KIND] = pa.array(kind, pa.string())
    out[REVISION] = pa.array(revision, pa.int64())
    out[EVENTS] = t.column(EVENTS).combine_chunks()
    out[FINALIZED_BY] = pa.array(np.full(len(kind), finalized_by), pa.string(), mask=kind != FINAL_KIND)
    out[CAUSE] = pa.array(np.full(len(kind), LATE_EVENT), pa.string(), mask=kind != CORRECTION_KIND)
    if spec.gaps:
        out[GAP] = pa.array(gap[written] if gap is not None else np.zeros(len(kind), bool), pa.bool_())
    return pa.Table.from_arrays([out[f.name].cast(f.type) for f in schema], schema=schema)


def _percentiles(sketches: pa.Array, ranks: list[float]) -> list[pa.Array]:
    """Per rank, each window's quantile from its serialized sketch (null for none)."""
    return sketch.quantile_arrays(sketches, ranks)


# ------------------------------------------------------------------------------------------ moves
#
# A rollup whose rows hold a column a late reference version corrects (``RollupSpec.moves``) keeps,
# beside its windows, each window's *parts*: the partial of each state bucket (``SOURCE``) that fed
# it. A correcting state bucket recomputes its parts of every window in the span of its corrected
# events from the events it kept (as they are now), and :func:`move` replaces its parts there and
# combines each window whose part changed again from its parts: min, max, the sketches and the
# distinct sets do not subtract, so a window is rebuilt rather than adjusted.

#: A part's state bucket (its grouping key).
SOURCE = "__source"


def parts_schema(spec: RollupSpec) -> pa.Schema:
    """The parts of a rollup's windows: a window table with each part's source."""
    return pa.schema([*spec.window_schema(), pa.field(SOURCE, pa.int32(), False)])


def idents(table: pa.Table, columns: Sequence[str]) -> np.ndarray:
    """Each row's values of ``columns`` as one string, nulls apart and no two value lists alike."""
    parts = []
    for c in columns:
        text = pc.cast(table.column(c), pa.string())
        sized = pc.binary_join_element_wise(pc.cast(pc.utf8_length(text), pa.string()), text, ":")
        parts.append(pc.fill_null(sized, "n"))
    if not parts:
        return np.zeros(table.num_rows, dtype=object)
    joined = parts[0] if len(parts) == 1 else pc.binary_join_element_wise(*parts, "|")
    return np.asarray(joined.to_numpy(zero_copy_only=False), dtype=object)


def add_parts(spec: RollupSpec, parts: pa.Table | None, partials: Sequence[tuple[int, pa.Table]]) -> pa.Table:
    """``parts`` with each source's window table of a batch (``(source, partials)``) folded into that
    source's part of each window."""
    pschema = parts_schema(spec)
    tables = [parts.cast(pschema)] if parts is not None and parts.num_rows else []
    for source, t in partials:
        if t.num_rows:
            src = pa.array(np.full(t.num_rows, source, np.int32), pa.int32())
            tables.append(t.cast(spec.window_schema()).append_column(pschema.field(SOURCE), src))
    if not tables:
        return pschema.empty_table()
    table = pa.concat_tables(tables)
    order, starts = sort_groups(table, [*spec.by, WINDOW_START, SOURCE])
    ordered = table.take(pa.array(order))
    merged = combine_sorted(spec, ordered.drop_columns([SOURCE]), starts)
    return merged.append_column(pschema.field(SOURCE), ordered.column(SOURCE).take(pa.array(starts)))


def evict_parts(spec: RollupSpec, parts: pa.Table, watermark_us: int | None) -> pa.Table:
    """``parts`` without those of windows the watermark has taken past the correction horizon (their
    window left the state: :func:`advance`)."""
    if watermark_us is None or not parts.num_rows:
        return parts
    end = as_numpy(parts.column(WINDOW_START)) + spec.window_us
    return parts.filter(pa.array(end + spec.correct_for_us > watermark_us))


#: A move's schema metadata: the window starts it covers (``lo`` to ``hi``, µs, end exclusive) and
#: its cause (the late version, JSON text).
MOVE_LO, MOVE_HI, MOVE_CAUSE_KEY = b"lo", b"hi", b"cause"


def move_table(spec: RollupSpec, partials: pa.Table, lo: int, hi: int, cause: str) -> pa.Table:
    """A state bucket's move: its new parts (``partials``, a window table) of every window starting
    from ``lo`` to ``hi``, which replace all its parts there (:func:`move`)."""
    table = partials.cast(spec.window_schema())
    return table.replace_schema_metadata({MOVE_LO: str(lo).encode(), MOVE_HI: str(hi).encode(),
                                          MOVE_CAUSE_KEY: cause.encode()})


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two parts of one window hold the same aggregates. A bucket's part was merged batch by
    batch and its new one is built at once: float sums may differ in their last bits and the
    sketches' bytes with the order they saw their values, so those compare by value (a sketch by its
    count and quantiles)."""
    for k, x in a.items():
        y = b.get(k)
        if isinstance(x, float) and isinstance(y, float):
            if not (x == y or (x != x and y != y) or abs(x - y) <= 1e-9 * max(abs(x), abs(y))):
                return False
        elif isinstance(x, bytes) and isinstance(y, bytes) and k.endswith(".kll"):
            if x != y:
                qx, qy = (np.asarray(sketch.quantiles(v, _RANKS), dtype=np.float64) for v in (x, y))
                if not np.allclose(qx, qy, rtol=1e-9, equal_nan=True):
                    return False
        elif x != y:
            return False
    return True


_RANKS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0]


@dataclass(frozen=True)
class Moved:
    """:func:`move`'s result: the state and the rows written (:class:`Advanced`) and the new parts."""

    advanced: Advanced
    parts: pa.Table


def move(spec: RollupSpec, state: pa.Table | None, parts: pa.Table | None, moves: Sequence[tuple[int, pa.Table]],
         watermark_us: int | None) -> Moved:
    """Each move ``(source, table)`` (:func:`move_table`, in source order) replaces all the parts of
    ``source`` in the windows starting within its range with its table's; every window whose part
    changed is written again, combined from its parts: a ``correction`` with the move's cause once
    the window is final, else ``final`` when the watermark has reached it, else ``provisional``. A
    window the state no longer holds (beyond the horizon) is left alone. Replacing the range rather
    than the windows named keeps the parts right whatever the bucket sent before (an event corrected
    twice leaves the window of its first correction too)."""
    sschema, wschema, pschema = state_schema(spec), spec.window_schema(), parts_schema(spec)
    state = sschema.empty_table() if state is None else state.cast(sschema)
    parts = pschema.empty_table() if parts is None else parts.cast(pschema)
    win = [*spec.by, WINDOW_START]
    changed: dict[str, tuple[pa.Table, str]] = {}  # window -> its keys and start (one row), the cause
    for source, table in moves:
        meta = table.schema.metadata or {}
        lo, hi, cause = int(meta[MOVE_LO]), int(meta[MOVE_HI]), meta[MOVE_CAUSE_KEY].decode()
        if watermark_us is not None:  # windows gone from the state: nothing to move
            lo = max(lo, ((watermark_us - spec.correct_for_us) // spec.window_us) * spec.window_us)
        new = table.cast(wschema)
        n_start = as_numpy(new.column(WINDOW_START))
        new = new.filter(pa.array((as_numpy(new.column(EVENTS)) > 0) & (n_start >= lo) & (n_start < hi)))
        p_start = as_numpy(parts.column(WINDOW_START)) if parts.num_rows else np.zeros(0, np.int64)
        p_src = as_numpy(parts.column(SOURCE)) if parts.num_rows else np.zeros(0, np.int32)
        old_at = (p_src == source) & (p_start >= lo) & (p_start < hi)
        old = parts.filter(pa.array(old_at)).drop_columns([SOURCE])
        o_win, n_win = idents(old, win).tolist(), idents(new, win).tolist()
        before = dict(zip(o_win, old.to_pylist(), strict=True))
        after = dict(zip(n_win, new.to_pylist(), strict=True))
        at_new, at_old = {k: i for i, k in enumerate(n_win)}, {k: i for i, k in enumerate(o_win)}
        for k in before.keys() | after.keys():
            x, y = before.get(k), after.get(k)
            if x is None or y is None or not _same(x, y):  # an unchanged part rewrites nothing
                src, row = (new, at_new[k]) if k in at_new else (old, at_old[k])
                changed.setdefault(k, (src.select(win).slice(row, 1), cause))
        src_col = pa.array(np.full(new.num_rows, source, np.int32), pa.int32())
        parts = pa.concat_tables([parts.filter(pa.array(~old_at)), new.append_column(pschema.field(SOURCE), src_col)])
    if not changed:
        return Moved(Advanced(state, spec.output_schema().empty_table(), 0), parts)

    affected = np.asarray(sorted(changed), dtype=object)
    mine = parts.filter(pa.array(np.isin(idents(parts, win), affected)))
    order, starts = sort_groups(mine, win, [SOURCE])  # each window's parts in source order: replays alike
    merged = combine_sorted(spec, mine.take(pa.array(order)).drop_columns([SOURCE]), starts) if mine.num_rows \
        else wschema.empty_table()
    have = set(idents(merged, win).tolist())
    gone = [k for k in affected.tolist() if k not in have]
    if gone:  # every part of it moved away: the window is empty now
        keys = pa.concat_tables([changed[k][0] for k in gone]).cast(pa.schema([*[wschema.field(b) for b in spec.by],
                                                                                wschema.field(WINDOW_START)]))
        merged = pa.concat_tables([merged, empty_windows(spec, keys.select(list(spec.by)), keys.column(WINDOW_START))])

    s_win = idents(state, win)
    hit = np.isin(s_win, affected)
    at_state = {k: i for i, k in enumerate(s_win.tolist()) if hit[i]}
    w_win = idents(merged, win).tolist()
    at = np.asarray([at_state.get(k, -1) for k in w_win], np.int64)
    known, pick = at >= 0, np.maximum(at, 0)

    def stored(column: str, default: Any, typ: Any) -> np.ndarray:
        if not state.num_rows:
            return np.full(len(at), default, typ)
        return np.where(known, as_numpy(state.column(column))[pick], default).astype(typ)

    revision = stored(REVISION, 0, np.int64) + 1
    was_final = stored(FINAL, False, bool)
    gap = stored(GAP, False, bool) if spec.gaps else None
    end = as_numpy(merged.column(WINDOW_START)) + spec.window_us
    reached = end <= watermark_us if watermark_us is not None else np.zeros(len(end), bool)
    kind = _kind(was_final, reached)
    updated = _state(merged, revision, was_final | reached, gap)
    table = pa.concat_tables([state.filter(pa.array(~hit)), updated])
    order, _ = sort_groups(table, win)
    rows = _rows(spec, merged, np.ones(merged.num_rows, bool), kind, revision, BY_WATERMARK, gap)
    # As on every row, only a correction says why (a window first written or not final yet does not).
    rows = rows.set_column(rows.schema.get_field_index(CAUSE), rows.schema.field(CAUSE),
                           pa.array([changed[k][1] for k in w_win], pa.string(), mask=kind != CORRECTION_KIND))
    order_rows, _ = sort_groups(rows, win)
    return Moved(Advanced(table.take(pa.array(order)), rows.take(pa.array(order_rows)), 0), parts)

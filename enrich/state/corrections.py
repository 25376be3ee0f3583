"""Corrections in the state step's buckets: what a bucket keeps of the events it wrote, and which of
them a batch's late versions correct (a broadcast join's versions found by the driver:
:mod:`enrich.dimension.corrections`; a partitioned join's by its buckets: :func:`bucket_changes`).

A bucket keeps its written events (the step's output rows, whatever the plan put in them) with
their event time (:data:`TS`) and their last revision (:data:`REVISION`, 0: as first written) for
as long as they are within the horizon: :func:`keep` appends a batch's and drops those older
than the horizon's start. :func:`match` finds, for each corrected join's changes, the kept events
of the change's key with a time in its span, and gives each such event its next revision and the
change as its cause (one row per event and change: two datasets changing one event in one batch
give two revisions, in join order). Pure: Arrow and numpy, no Spark.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from enrich.columns import (
    BUCKET,
    CAUSE,
    ERROR,
    KEY_BYTES,
    KIND,
    KIND_CORRECTION,
    KIND_EVENT,
    RETRACTED,
    REVISION,
)
from enrich.dimension.corrections import NO_BOUND_END, NO_BOUND_START, QUIET, Entry, changes, changes_file
from enrich.ipc import from_ipc, to_ipc
from enrich.joins import JoinSpec, event_keys, row_keys
from enrich.joins.partitioned import valid_from_micros
from enrich.state.layout import BucketLayout
from enrich.state.stored import WRITTEN
from refstream import contract

__all__ = ["ACC", "CAUSE_TYPE", "MERGE_AT", "REFOLDED", "SEQ", "VALUE", "mark_refolded", "put", "NO_BOUND_END", "NO_BOUND_START", "REVISIONS_SCHEMA", "SMALL_ROWS", "TS",
           "Corrects", "Matched", "Prepared", "as_events", "bucket_changes", "join_again",
           "read_tallies", "tally", "emitted", "horizon_start", "initial_written", "keep", "match", "prepare",
           "read_changes", "revisions", "saved_chunks", "with_revisions"]

#: A bucket's kept events are chunks, one per batch that wrote some; this many small ones (fewer
#: rows than :data:`SMALL_ROWS`) are merged into one, so that a bucket holds few chunks whatever
#: its horizon, and a chunk goes whole once its newest event is behind the horizon.
MERGE_AT, SMALL_ROWS = 16, 50_000


@dataclass(frozen=True)
class Corrects:
    """A join whose late versions correct the events written before them (``joins[].corrections``),
    as the plan resolves it: its spec (in the join pass, or the partitioned join's in the step), the
    dataset's key columns, the horizon (microseconds behind the watermark) and the joined columns.
    Picklable."""

    spec: JoinSpec
    key: tuple[str, ...]
    horizon_us: int
    columns: tuple[str, ...] = ()
    #: A partitioned join's dimension (its ``PartitionedDim.index``): the buckets find its late
    #: versions themselves (:func:`bucket_changes`); None: a broadcast join's, from the driver's files.
    dim: int | None = None
    #: A broadcast join before the state step (its columns are in what the step wrote): the buckets
    #: join their corrections again (:func:`join_again`).
    before: bool = False

    @property
    def dataset(self) -> str:
        return self.spec.dataset


def join_again(before: Sequence[JoinSpec], corrected: Sequence[str]) -> list[int]:
    """The joins before the state step (``before``, in order) a correction runs again: those of the
    ``corrected`` datasets, and those whose ``on:`` columns come from one run again (a models join on
    the devices join's ``model_id``)."""
    out: list[int] = []
    added: set[str] = set()
    for i, s in enumerate(before):
        if s.dataset in corrected or {e for e, _ in s.pairs} & added:
            out.append(i)
            added |= {o for _, o in s.columns} | {s.matched}
    return out


def horizon_start(corrected: Sequence[Corrects], watermark: int | None) -> int:
    """The earliest event time any of ``corrected`` still corrects at ``watermark`` (microseconds;
    none yet: no bound)."""
    if watermark is None or not corrected:
        return NO_BOUND_START
    return watermark - max(c.horizon_us for c in corrected)


def bucket_changes(c: Corrects, old: pa.Table, new: pa.Table, records: pa.Table, horizon_start: int,
                   kept_until: int | None) -> pa.Table:
    """A partitioned join's changes (:func:`enrich.dimension.corrections.changes`) from its bucket's
    own changelog ``records`` of a batch (``partition``, ``offset``, ``key``, ``value``, the
    ``valid_from`` columns): the bucket's versions ``old`` before the batch and ``new`` after it
    (the dimension's stored rows). A key's records, versions and events are all in its bucket (the
    dimension is hashed by the state key, as the events are), so the bucket's newest kept event
    time (``kept_until``; None: it keeps none) says which changes are ``timely``: a change is
    judged against what this bucket wrote, not the whole job's watermark."""
    # Nothing kept: no event to correct. A change before the horizon is still beyond it (events
    # older than the horizon may have been written): counted as such.
    seen = max(kept_until, horizon_start) if kept_until is not None else horizon_start
    records = records.take(pc.sort_indices(records, [("partition", "ascending"), ("offset", "ascending")]))
    keys = records.column("key").to_pylist()
    gone = records.column("value").is_null().to_numpy(zero_copy_only=False)
    times = valid_from_micros(records)
    parts = records.column("partition").to_pylist()
    offsets = records.column("offset").to_pylist()
    entries = [Entry(k, int(times[i]), bool(gone[i]), int(parts[i]), int(offsets[i]))
               for i, k in enumerate(keys) if k is not None and k not in (contract.SCHEMA_KEY, contract.HEARTBEAT_KEY)]
    mine = pa.array(sorted({e.key for e in entries}), pa.binary())

    def of(t: pa.Table) -> pa.Table:
        return t.filter(pc.is_in(t.column(KEY_BYTES), value_set=mine))

    table = changes(entries, of(new), of(old), c.key, c.columns, horizon_start, seen)
    if kept_until is None:  # a key's first version (no lower bound) corrects nothing here either
        result = table.column("result")
        table = table.set_column(table.schema.get_field_index("result"), "result",
                                 pc.if_else(pc.equal(result, "corrected"), "timely", result))
    return table


def tally(found: Sequence[tuple[Corrects, pa.Table, int]]) -> dict[str, Any]:
    """A bucket's report of its partitioned joins' changes (:func:`bucket_changes`, each with its
    horizon's start) for the driver: ``counts``, versions by ``"<dataset> <result>"`` (``timely``
    left out), and ``beyond``, per dataset, the first version that reached before the horizon
    (its key's text, ``valid_from`` and the horizon's start, microseconds)."""
    counts: dict[str, int] = {}
    beyond: dict[str, list[Any]] = {}
    for c, table, start in found:
        results = table.column("result").to_pylist()
        for r in results:
            if r != "timely":
                counts[f"{c.dataset} {r}"] = counts.get(f"{c.dataset} {r}", 0) + 1
        if "beyond_horizon" in results and c.dataset not in beyond:
            at = results.index("beyond_horizon")
            key = table.column(KEY_BYTES)[at].as_py().decode("utf-8", "replace")
            beyond[c.dataset] = [key, int(table.column("valid_from")[at].as_py()), start]
    return {"counts": counts, "beyond": beyond}


def read_tallies(reported: Mapping[int, Mapping[str, Any]]) -> tuple[dict[tuple[str, str], int],
                                                                       dict[str, tuple[str, int, int]]]:
    """The buckets' :func:`tally` reports summed: versions by (dataset, result), and per dataset one
    version before the horizon (key, valid_from, the horizon's start)."""
    counts: dict[tuple[str, str], int] = {}
    beyond: dict[str, tuple[str, int, int]] = {}
    for _, report in sorted(reported.items()):
        for label, n in report["counts"].items():
            dataset, result = label.rsplit(" ", 1)
            counts[(dataset, result)] = counts.get((dataset, result), 0) + int(n)
        for dataset, (key, vf, start) in report["beyond"].items():
            beyond.setdefault(dataset, (key, int(vf), int(start)))
    return counts, beyond


def read_changes(directory: str | Path, batch_id: int, dataset: str) -> pa.Table:
    """The changes the driver wrote for the batch (``enrich.dimension.corrections.changes``), the
    ones that correct something (``unchanged`` and ``timely`` left out)."""
    return _correcting(from_ipc(changes_file(directory, batch_id, dataset).read_bytes()))


def _correcting(changes: pa.Table) -> pa.Table:
    """The ``changes`` that correct something (``unchanged`` and ``timely`` left out)."""
    return changes.filter(pc.invert(pc.is_in(changes.column("result"), value_set=pa.array(QUIET))))


def as_events(out: pa.Table) -> pa.Table:
    """The step's output rows ``out`` as first written: ``_kind`` event, ``_revision`` 0, no cause,
    not retracted."""
    n = out.num_rows
    return (out.append_column(KIND, pa.array([KIND_EVENT] * n, pa.string()))
            .append_column(REVISION, pa.array(np.zeros(n, np.int32), pa.int32()))
            .append_column(CAUSE, pa.nulls(n, CAUSE_TYPE))
            .append_column(RETRACTED, pa.array(np.zeros(n, bool), pa.bool_())))


def emitted(rows: pa.Table) -> pa.Table:
    """:class:`Matched` rows as the step's output rows: ``_kind`` correction, then their revision and
    cause, not retracted (an inner join of the join pass that finds no row retracts it:
    :func:`enrich.joins.join_table`)."""
    tail = [rows.column(REVISION), rows.column(CAUSE)]
    body = rows.drop_columns([TS, REVISION, CAUSE, *[n for n in rows.column_names
                                                     if n in (SEQ, REFOLDED) or n.startswith(ACC)]])
    return (body.append_column(KIND, pa.array([KIND_CORRECTION] * rows.num_rows, pa.string()))
            .append_column(REVISION, tail[0]).append_column(CAUSE, tail[1])
            .append_column(RETRACTED, pa.array(np.zeros(rows.num_rows, bool), pa.bool_())))

#: A kept event's time (UTC microseconds); it keeps its last revision in :data:`REVISION`.
TS = "__c_ts"
#: With state aggregates over a corrected join's columns, a kept event's chunk number when first
#: kept (:data:`SEQ`: its batch's place in the bucket's application order) and, per accumulator
#: ``a`` of those aggregates, ``ACC + a``: the device's accumulator before the event (null: a
#: fresh state), which a correction refolds the device's aggregates from
#: (:func:`enrich.state.engine.refold`).
SEQ, ACC = "__c_seq", "__c_acc:"
#: In a chunk's revisions table, a corrected row's value of a corrected join's column ``c`` as its
#: last correction wrote it is ``VALUE + c``: read back, a kept row says what was last written of it.
VALUE = "__c_value:"
#: A correction's cause (:data:`CAUSE`): the dataset, the changelog key (its JSON text), the
#: version's valid_from, and where the changelog record is.
CAUSE_TYPE = pa.struct([("dataset", pa.string()), ("key", pa.string()),
                        ("valid_from", pa.timestamp("us", tz="UTC")), ("partition", pa.int32()),
                        ("offset", pa.int64())])


def keep(log: pa.Table | None, written: pa.Table | None, ts: pa.Array | np.ndarray | None,
         horizon_start: int) -> pa.Table | None:
    """``log`` with the events ``written`` (their times ``ts``, UTC microseconds) appended at revision
    0, and those older than ``horizon_start`` dropped; None when none is left."""
    parts = []
    if log is not None and log.num_rows:
        parts.append(log)
    if written is not None and written.num_rows:
        new = written.append_column(TS, pa.array(np.asarray(ts, dtype=np.int64), pa.int64()))
        parts.append(new.append_column(REVISION, pa.array(np.zeros(written.num_rows, np.int32), pa.int32())))
    if not parts:
        return None
    both = pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]
    both = both.filter(pc.greater_equal(both.column(TS), pa.scalar(horizon_start, pa.int64())))
    return both if both.num_rows else None


#: A chunk's revisions (:func:`revisions`): kept apart from its rows, so that correcting some of
#: its events rewrites a few bytes, not the chunk. With state aggregates folded again, the revised
#: rows' accumulators (:data:`ACC` columns) come with them.
REVISIONS_SCHEMA = pa.schema([("row", pa.int32()), ("revision", pa.int32())])
#: A kept row whose accumulators a fold set (:func:`with_revisions` marks the rows it revises).
REFOLDED = "__c_refolded"


def revisions(log: pa.Table, columns: Sequence[str] = ()) -> pa.Table:
    """The rows of a chunk ``log`` corrected at least once or refolded (:data:`REFOLDED`), with their
    revision, their accumulators (the :data:`ACC` columns ``log`` has) and their values of
    ``columns`` (as :data:`VALUE` + name: what their last correction wrote of a corrected join's
    columns)."""
    rev = log.column(REVISION).to_numpy(zero_copy_only=False)
    listed = rev > 0
    if REFOLDED in log.column_names:
        listed |= log.column(REFOLDED).fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    rows = np.flatnonzero(listed)
    out = pa.table([pa.array(rows.astype(np.int32), pa.int32()), pa.array(rev[rows].astype(np.int32), pa.int32())],
                   schema=REVISIONS_SCHEMA)
    for name in log.column_names:
        if name.startswith(ACC):
            out = out.append_column(name, log.column(name).take(pa.array(rows)))
    for name in columns:
        if name in log.column_names:
            out = out.append_column(VALUE + name, log.column(name).take(pa.array(rows)))
    return out


def with_revisions(chunk: pa.Table, revised: pa.Table | None) -> pa.Table:
    """``chunk`` (a chunk's rows as kept) with the revisions of :func:`revisions` ``revised`` (None:
    none): each listed row's revision, and its accumulators where ``revised`` has them (the row
    then marked :data:`REFOLDED`)."""
    if revised is None or revised.num_rows == 0:
        return chunk
    rev = chunk.column(REVISION).to_numpy(zero_copy_only=False).astype(np.int32).copy()
    rows = revised.column("row").to_numpy(zero_copy_only=False)
    rev[rows] = np.maximum(rev[rows], revised.column("revision").to_numpy(zero_copy_only=False))
    chunk = chunk.set_column(chunk.schema.get_field_index(REVISION), REVISION, pa.array(rev, pa.int32()))
    for side in revised.column_names:  # the values a correction wrote of the corrected joins' columns
        name = side[len(VALUE):]
        if side.startswith(VALUE) and name in chunk.column_names:
            chunk = put(chunk, name, rows, revised.column(side))
    accs = [n for n in revised.column_names if n.startswith(ACC) and n in chunk.column_names]
    for name in accs:
        chunk = put(chunk, name, rows, revised.column(name))
    return mark_refolded(chunk, rows) if accs else chunk


def put(table: pa.Table, name: str, at: np.ndarray, values: pa.Array | pa.ChunkedArray) -> pa.Table:
    """``table`` with its column ``name``'s values at rows ``at`` replaced by ``values`` (cast to the
    column's type; of a row given twice, the last)."""
    i = table.schema.get_field_index(name)
    src = np.arange(table.num_rows)
    src[at] = table.num_rows + np.arange(len(at))
    new = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    both = pa.concat_arrays([table.column(i).combine_chunks(), new.cast(table.schema.field(i).type)])
    return table.set_column(i, name, both.take(pa.array(src)))


def mark_refolded(chunk: pa.Table, rows: np.ndarray) -> pa.Table:
    """``chunk`` with its rows ``rows`` marked :data:`REFOLDED`, beside those marked before."""
    marked = np.zeros(chunk.num_rows, bool)
    if REFOLDED in chunk.column_names:
        marked = chunk.column(REFOLDED).fill_null(False).to_numpy(zero_copy_only=False).astype(bool).copy()
        chunk = chunk.drop_columns([REFOLDED])
    marked[rows] = True
    return chunk.append_column(REFOLDED, pa.array(marked, pa.bool_()))


def saved_chunks(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` for a savepoint: kept chunks (``rows``, their Arrow IPC) and their revisions
    (``revisions``, null: none) as one ``table`` each, the revisions applied; a row per output
    batch, whatever the chunks' sizes."""
    for batch in batches:
        for rows, revs in zip(batch.column("rows").to_pylist(), batch.column("revisions").to_pylist(), strict=True):
            table = with_revisions(from_ipc(rows), from_ipc(revs) if revs is not None else None)
            yield pa.RecordBatch.from_arrays([pa.array([to_ipc(table)], pa.binary())], names=["table"])


def initial_written(batches: Iterator[pa.RecordBatch], *, ids: tuple[int, ...], key: str) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` for a fork: a savepoint's kept chunks (``table``, see :func:`saved_chunks`) as
    the state step's initial state (:data:`enrich.state.stream.INITIAL` rows of kind
    :data:`enrich.state.stored.WRITTEN`): each event in the bucket its device (the ``key`` column)
    routes to under the new checkpoint's grouping keys ``ids``, as events are hashed
    (:meth:`enrich.state.layout.BucketLayout.of`); a row per piece."""
    layout = BucketLayout(ids)
    for batch in batches:
        for value in batch.column("table").to_pylist():
            chunk = from_ipc(value)
            if key not in chunk.column_names:
                raise ValueError(f"a savepoint's written events have no column {key!r} (state.key) to route them by")
            routed = layout.of(chunk.column(key))
            for b in np.unique(routed).tolist():
                yield pa.RecordBatch.from_arrays(
                    [pa.array([b], pa.int32()), pa.array([WRITTEN], pa.string()),
                     pa.array([to_ipc(chunk.filter(pa.array(routed == b)))], pa.binary()), pa.nulls(1, pa.binary())],
                    names=[BUCKET, "kind", "table", "schema"])


@dataclass(frozen=True)
class Matched:
    """What :func:`match` found: ``rows``, the corrected events (the kept columns, :data:`REVISION` the
    new one, :data:`CAUSE`), in kept order per change; ``log``, the kept events with their revisions."""

    rows: pa.Table
    log: pa.Table
    #: Each of ``rows``' place in ``log``.
    at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _codes(keys: pd.Index, values: np.ndarray, nulls: np.ndarray, null: int) -> np.ndarray:
    """Each of ``values``' place in ``keys`` (-1: not there; ``null`` where ``nulls``)."""
    return np.where(nulls, null, keys.get_indexer(pd.Index(np.asarray(values, dtype=object), dtype=object)))


@dataclass(frozen=True)
class _ByKey:
    """A batch's changes grouped by key code (:func:`_by_key`): ``order`` lists them by (code,
    start); a code's changes are ``order[lo[code]:hi[code]]``; ``most``: the most one code has."""

    order: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    most: int


def _by_key(c_code: np.ndarray, start: np.ndarray, keys: int) -> _ByKey:
    """``keys`` key codes' changes (``c_code``: each change's code, negative: a null key), by key."""
    real = np.flatnonzero(c_code >= 0)
    order = real[np.lexsort((start[real], c_code[real]))]
    sorted_codes = c_code[order]
    every = np.arange(keys)
    lo = np.searchsorted(sorted_codes, every, "left")
    hi = np.searchsorted(sorted_codes, every, "right")
    return _ByKey(order, lo, hi, int((hi - lo).max(initial=0)))


#: A batch whose keys have at most this many changes each is matched by a scan of each row's key's
#: changes (a few passes over the rows); one with more, by one search over (key, time) pairs.
SCAN_MOST = 8


def _pairs(r_code: np.ndarray, ts: np.ndarray, c_code: np.ndarray, start: np.ndarray,
           end: np.ndarray, by_key: _ByKey, scan_most: int = SCAN_MOST) -> tuple[np.ndarray, np.ndarray]:
    """(kept row, change row) pairs: the change of the row's key whose span holds the row's time (the
    spans of one key's changes never overlap), given the rows' and the changes' key codes
    (:func:`_codes`: a row's equals a change's only when their keys are equal). ``by_key``: the
    changes grouped once for every chunk a batch matches (:func:`_by_key`)."""
    if by_key.most > scan_most:
        return _pairs_searched(r_code, ts, c_code, start, end)
    known = (r_code >= 0) & (r_code < len(by_key.lo))
    cand = np.flatnonzero(known)
    code = r_code[cand]
    lo, hi = by_key.lo[code], by_key.hi[code]
    has = lo < hi
    cand, lo, hi = cand[has], lo[has], hi[has]
    t = ts[cand]
    # A key's changes by start: the last one starting at or before the row's time.
    best = np.full(len(cand), -1, np.int64)
    starts = start[by_key.order]
    for j in range(by_key.most):
        at = lo + j
        inside = at < hi
        at = np.where(inside, at, 0)
        best = np.where(inside & (starts[at] <= t), at, best)
    ok = best >= 0
    cand, ch = cand[ok], by_key.order[best[ok]]
    ok = t[ok] < end[ch]
    return cand[ok].astype(np.int64), ch[ok].astype(np.int64)


def _pairs_searched(r_code: np.ndarray, ts: np.ndarray, c_code: np.ndarray, start: np.ndarray,
                    end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_pairs` by one search over every key at once (for keys with many changes)."""
    cand = np.flatnonzero(np.isin(r_code, c_code))
    if not len(cand):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # Per kept row: the last change of its key starting at or before its time, found with one
    # search over (key code, time rank) pairs made single integers: times ranked among the changes'
    # starts and the rows' times, so both fit beside a code in 64 bits.
    times, rank = np.unique(np.concatenate([start, ts[cand]]), return_inverse=True)
    width = np.int64(len(times) + 1)
    c_rank, r_rank = rank[:len(start)], rank[len(start):]
    c_pair = c_code.astype(np.int64) * width + c_rank
    order = np.argsort(c_pair, kind="stable")
    at = np.searchsorted(c_pair[order], r_code[cand].astype(np.int64) * width + r_rank, "right") - 1
    ok = at >= 0
    ch = order[np.maximum(at, 0)]
    ok &= c_code[ch] == r_code[cand]  # a change of the row's own key, not the key before it
    ok &= ts[cand] < end[ch]
    return cand[ok].astype(np.int64), ch[ok].astype(np.int64)


@dataclass(frozen=True)
class _Change:
    """One corrected join's changes of a batch, made ready once for every chunk :func:`match` reads."""

    corrects: Corrects
    table: pa.Table           # the changes that correct (``unchanged`` ones left out)
    keys: pd.Index            # their distinct keys
    code: np.ndarray          # each change's key's place in ``keys`` (-2: a null key)
    start: np.ndarray
    end: np.ndarray
    by_key: _ByKey


@dataclass(frozen=True)
class Prepared:
    """A batch's changes (:func:`prepare`), as :func:`match` reads them."""

    changes: tuple[_Change, ...]


def prepare(changes: Sequence[tuple[Corrects, pa.Table]]) -> Prepared:
    """``changes`` (per corrected join, in join order, the join and the batch's changes of its dataset:
    :func:`enrich.dimension.corrections.changes`) made ready to match against many chunks."""
    out = []
    for c, ch in changes:
        ch = _correcting(ch)
        if ch.num_rows == 0:
            continue
        ch_keys, ch_nulls = row_keys(ch, c.key)
        keys = pd.Index(pd.unique(np.asarray(ch_keys, dtype=object)), dtype=object)
        code = _codes(keys, ch_keys, ch_nulls, -2)
        start = ch.column("start").to_numpy(zero_copy_only=False)
        out.append(_Change(c, ch, keys, code, start, ch.column("end").to_numpy(zero_copy_only=False),
                           _by_key(code, start, len(keys))))
    return Prepared(tuple(out))


def match(log: pa.Table | None, changes: Prepared | Sequence[tuple[Corrects, pa.Table]],
          watermark: int | None = None) -> Matched | None:
    """The kept events ``changes`` correct (see the module doc); None when none. ``changes``: per
    corrected join, in join order, the join and the batch's changes of its dataset
    (:func:`enrich.dimension.corrections.changes`; ``unchanged`` ones are left out here), or those
    :func:`prepare` made ready once for many chunks; each corrects the kept events within its
    horizon of ``watermark`` (None: all)."""
    if log is None or log.num_rows == 0:
        return None
    if not isinstance(changes, Prepared):
        changes = prepare(changes)
    ts = log.column(TS).to_numpy(zero_copy_only=False)
    revision = log.column(REVISION).to_numpy(zero_copy_only=False).astype(np.int32).copy()
    picked: list[pa.Table] = []
    places: list[np.ndarray] = []
    for change in changes.changes:
        spec, ch = change.corrects.spec, change.table
        log_keys, log_nulls = event_keys(log, spec)
        if ERROR in log.column_names:  # a dead letter (a call failed) kept for the state's fold only
            log_nulls = log_nulls | pc.is_valid(log.column(ERROR)).to_numpy(zero_copy_only=False).astype(bool)
        if watermark is not None:  # older than this join's horizon: not corrected
            log_nulls = log_nulls | (ts < watermark - change.corrects.horizon_us)
        r_code = _codes(change.keys, log_keys, log_nulls, -3)
        rows, found = _pairs(r_code, ts, change.code, change.start, change.end, change.by_key)
        if not len(rows):
            continue
        rows_order = np.argsort(rows, kind="stable")
        rows, found = rows[rows_order], found[rows_order]
        revision[rows] += 1
        take = pa.array(found)
        cause = pa.StructArray.from_arrays(
            [pa.array([spec.dataset] * len(rows), pa.string()),
             pc.cast(ch.column(KEY_BYTES).combine_chunks().take(take), pa.string()),
             pc.cast(ch.column("valid_from").combine_chunks().take(take), pa.timestamp("us", tz="UTC")),
             ch.column("partition").combine_chunks().take(take),
             ch.column("offset").combine_chunks().take(take)],
            fields=list(CAUSE_TYPE))
        got = log.take(pa.array(rows)).drop_columns([REVISION])
        picked.append(got.append_column(REVISION, pa.array(revision[rows], pa.int32())).append_column(CAUSE, cause))
        places.append(rows)
    if not picked:
        return None
    log = log.set_column(log.schema.get_field_index(REVISION), REVISION, pa.array(revision, pa.int32()))
    return Matched(pa.concat_tables(picked), log, np.concatenate(places).astype(np.int64))

"""The rollups in the running query: the state step feeds them, a second keyed step keeps their
windows (semantics: docs/rollups.md; the pure engine: :mod:`enrich.rollups`).

::

    state step (per device bucket)      the batch's events, each rollup's partial aggregates of the
                                        events within its horizon (:func:`feed`), a dead letter per
                                        event beyond the horizon of one or more rollups, counts
    rollup step (per rollup bucket)     the events passed on; each rollup's windows of the bucket
                                        folded with the partials (:class:`RollupProcessor`) and
                                        written provisional, final or as a correction; timers at
                                        window ends make windows final when the watermark passes

Both steps emit packed values (:mod:`enrich.packed`) with their kind beside them (``PACK_KIND``:
:mod:`enrich.rollups.packs`); the job's batch
splits the rollup step's output by kind. A rollup's partials go to the rollup bucket of their
``by`` values, so each (keys, window) lives in one bucket; the events go on in the bucket of their
device bucket. Spark's watermark reaches the rollup step through the state step's output time
column (``ROLLUP_TIME``): the batch's watermark plus 1 ms, which Spark accepts as not late.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructField, StructType

from enrich.checkpoint import CheckpointLayout
from enrich.columns import ERROR, PACK_KIND, RBUCKET, ROWS, TS_US
from enrich.ipc import from_ipc, to_ipc
from enrich.joins import JoinSpec, Lookup, PlanEnricher, join_table
from enrich.joins.asof import CLIPPED
from enrich.rollups import config, engine, partial
from enrich.rollups.packs import (
    BEYOND,
    COUNTS,
    COUNTS_SCHEMA,
    IDLE_PROPERTY,
    TICK,
    move_kind,
    partial_kind,
    rows_kind,
)
from enrich.rollups.spec import EVENTS as EVENT_COUNT
from enrich.rollups.spec import FINAL, WINDOW_START, RollupSpec
from enrich.state.hashing import buckets_of
from enrich.state.stored import VALUE_SCHEMA
from enrich.state.timers import keep_one_timer, watermark_us
from enrich.worker import settle
from refstream.atomic import write_json_atomic
from refstream.compat import spark_state_server_timeout

__all__ = ["FINALS", "INITIAL", "OUTPUT", "ROLLUP_PREFIX", "SAVED", "Fed", "RollupProcessor", "feed", "idle_facts",
           "initial_windows", "state_name", "state_name_of"]

#: The rollup step's output: what each packed value holds, and the value.
OUTPUT = StructType([StructField(PACK_KIND, StringType(), False), StructField(ROWS, BinaryType(), False)])


def _counts(counts: Sequence[tuple[str, str, int]]) -> bytes:
    """(rollup, result, events)s as a packed :data:`COUNTS` value."""
    return to_ipc(pa.Table.from_pylist([{"rollup": r, "result": k, "events": n} for r, k, n in counts],
                                       schema=COUNTS_SCHEMA))


def _dead(events: pa.Table, reasons: list[str]) -> pa.Table:
    """Dead letters (``DEAD_COLUMNS``) of good ``events`` inside the step, where their Kafka bytes
    are no longer kept: the value is the event as parsed, as JSON (its own columns and those the
    joins before the step added; times in ISO 8601), the key as read when it was kept."""
    own = [c for c in events.column_names if not c.startswith("_")]
    values = [json.dumps(row, default=_text, separators=(",", ":")).encode() for row in events.select(own).to_pylist()]
    n = events.num_rows
    key = events.column("_key") if "_key" in events.column_names else pa.nulls(n, pa.binary())
    return pa.table({ERROR: pa.array(reasons, pa.string()), "_key": key.cast(pa.binary()),
                     "_value": pa.array(values, pa.binary()), "_topic": events.column("_topic"),
                     "_partition": events.column("_partition"), "_offset": events.column("_offset")})


def _text(value: object) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


@dataclass(frozen=True)
class Fed:
    """What the state step hands the rollup step for one bucket and batch besides its events:
    ``parts`` (rollup bucket, kind, packed value), and the dead letters of the events beyond a
    rollup's horizon (``DEAD_COLUMNS``; None: none)."""

    parts: list[tuple[int, str, bytes]]
    dead: pa.Table | None


def _route(table: pa.Table, by: Sequence[str], ids: Sequence[int]) -> np.ndarray:
    """The rollup bucket (one of ``ids``) of every row's ``by`` values: a hash of their text (a null
    apart from any text)."""
    texts = [pc.fill_null(pc.cast(table.column(b), pa.string()), "\x00") for b in by]
    key = texts[0] if len(texts) == 1 else pc.binary_join_element_wise(*texts, "\x1f")
    return np.asarray(ids, np.int32)[buckets_of(key, len(ids))]


def feed(specs: Sequence[RollupSpec], events: pa.Table, watermark_us: int | None, ids: Sequence[int],
         source: int) -> Fed:
    """The state step's part for state bucket ``source``: ``events`` (the batch's good events, with
    ``_ts_us``, ``_partition``, ``_offset`` and the dead-letter columns) to each rollup's partials per
    rollup bucket (``ids``: the buckets' grouping keys, the state step's, spread evenly over the state
    partitions: enrich.state.layout), leaving out the events beyond its horizon as of
    ``watermark_us``, and the counts of both."""
    ts = partial.as_numpy(events.column(TS_US)) if events.num_rows else np.zeros(0, np.int64)
    parts: list[tuple[int, str, bytes]] = []
    beyond_any = np.zeros(len(ts), bool)
    names: list[list[str]] = [[] for _ in range(len(ts))]
    counts: list[tuple[str, str, int]] = []
    for i, spec in enumerate(specs):
        beyond = engine.beyond_horizon(spec, ts, watermark_us)
        within = events.filter(pa.array(~beyond)) if beyond.any() else events
        if beyond.any():
            beyond_any |= beyond
            for j in np.flatnonzero(beyond).tolist():
                names[j].append(spec.name)
            counts.append((spec.name, "beyond_horizon", int(beyond.sum())))
        if within.num_rows == 0:
            continue
        windows = partial.partials(spec, within)
        rb = _route(windows, spec.by, ids)
        order = np.argsort(rb, kind="stable")
        keys = rb[order]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(keys)) + 1])
        ordered = windows.take(pa.array(order))
        for s, e in zip(starts.tolist(), [*starts[1:].tolist(), len(keys)], strict=True):
            parts.append((int(keys[s]), partial_kind(i, source), to_ipc(ordered.slice(s, e - s))))
    dead = None
    if beyond_any.any():
        dead = _dead(events.filter(pa.array(beyond_any)),
                     [f"{BEYOND}: {', '.join(n)}" for n, b in zip(names, beyond_any.tolist(), strict=True) if b])
    if counts:
        parts.append((source, COUNTS, _counts(counts)))
    return Fed(parts, dead)


def moves(specs: Sequence[RollupSpec], moving: Sequence[int], corrected_us: np.ndarray, cause: str,
          kept: pa.Table, complete_from: int, watermark_us: int | None, ids: Sequence[int],
          source: int, was: pa.Table) -> list[tuple[int, str, bytes]]:
    """State bucket ``source``'s moves (:func:`enrich.rollups.engine.move`) of the ``moving`` rollups
    after a batch corrected events at times ``corrected_us`` (``cause``: the first one's version,
    JSON): per rollup, its new parts of every window from the first corrected event's to the last's,
    from ``kept`` (every event the bucket keeps that a rollup counts, as corrected now, with
    ``_ts_us``; it keeps them all from ``complete_from`` on, so no window starting before that is
    moved). A move goes to each rollup bucket that holds one of those windows now and to each that
    held the window a corrected event leaves (``was``: the corrected events as last written before
    this batch, with the rollups' ``by`` columns), even with no part left for it there; the other
    rollup buckets' parts from this bucket cannot change (the events they were made of did not)."""
    out: list[tuple[int, str, bytes]] = []
    if not len(corrected_us):
        return out
    kts = partial.as_numpy(kept.column(TS_US)) if kept.num_rows else np.zeros(0, np.int64)
    for i in moving:
        spec = specs[i]
        w = spec.window_us
        lo = max(int(corrected_us.min()) // w * w, -(-complete_from // w) * w)
        hi = int(corrected_us.max()) // w * w + w
        if watermark_us is not None:  # gone from the rollup step: windows beyond its horizon
            lo = max(lo, ((watermark_us - spec.correct_for_us) // w) * w)
        if lo >= hi:
            continue
        table = engine.move_table(spec, partial.partials(spec, kept.filter(pa.array((kts >= lo) & (kts < hi)))),
                                  lo, hi, cause)
        rb = _route(table, spec.by, ids)
        # A column missing from rows kept under an earlier plan is null there, as in ``kept``.
        was_by = pa.table({b: was.column(b) if b in was.column_names else pa.nulls(was.num_rows, t)
                           for b, t in zip(spec.by, spec.by_types, strict=True)})
        for b in np.union1d(rb, _route(was_by, spec.by, ids)).tolist():  # each bucket once
            out.append((int(b), move_kind(i, source), to_ipc(table.filter(pa.array(rb == b)))))
    return out


def gap_marks(specs: Sequence[RollupSpec], records: pa.Table, key: str, ids: Sequence[int],
              source: int) -> list[tuple[int, str, bytes]]:
    """The gaps state bucket ``source`` closed and withdrew this batch (its gap ``records``,
    :mod:`enrich.gaps.engine`), for each rollup that marks them (``gaps``), in the rollup bucket of
    each device (``key``: the state key, the rollup's one ``by`` column)."""
    pick = pc.is_in(records.column("kind"), value_set=pa.array(["closed", "retracted"]))
    got = records.filter(pick)
    if not got.num_rows:
        return []
    marks = pa.table({"key": got.column(key), "start": pc.cast(got.column("start"), pa.int64()),
                      "end": pc.cast(got.column("end"), pa.int64()),
                      "closed": pc.equal(got.column("kind"), "closed")})
    parts = []
    for i, spec in enumerate(specs):
        if not spec.gaps:
            continue
        rb = _route(pa.table({spec.by[0]: marks.column("key")}), spec.by, ids)
        for b in sorted(set(rb.tolist())):
            parts.append((int(b), gap_kind(i, source), to_ipc(marks.filter(pa.array(rb == b)))))
    return parts


def gap_kind(i: int, source: int) -> str:
    """Rollup ``i``'s gap marks (:func:`gap_marks`) from state bucket ``source``."""
    return f"gaps:{i}:{source}"


class RollupProcessor(StatefulProcessor):
    """The rollup step: one call per rollup bucket and micro-batch. Passes every packed value but a
    rollup's partials on; folds each rollup's partials into the bucket's windows of it
    (:func:`enrich.rollups.engine.advance`) and emits the rows written (``rollup:<i>``) and the
    batch's counts (``counted``: events into windows not yet final; ``corrected``: into final ones).
    One event-time timer per bucket, at the next window end (or horizon) the watermark must reach,
    makes windows final (and drops them) in batches that bring the bucket nothing.

    A rollup's windows of the bucket are kept in two parts (:class:`_Held`): the open ones (not
    final) in a value read and written on every call, beside the first and last window start of the
    final ones, which are kept apart, appended as they become final and read only when a call needs
    them: a batch that reaches a final window (a late event), a window leaving the horizon, a fill,
    gap marks. A batch of events on time so costs its open windows, not the horizon's."""

    def __init__(self, specs: tuple[RollupSpec, ...], *, server_timeout_s: float = 120.0,
                 dropped: tuple[str, ...] = (), joins: Mapping[str, JoinSpec] | None = None,
                 ids: tuple[int, ...] = (), floor_us: int | None = None) -> None:
        """``dropped``: the names of rollups removed from the checkpoint, whose windows are deleted;
        ``joins``: the in-plan joins of the rollups that fill by a dimension's keys (``fill_keys``),
        by dataset; ``ids``: the rollup buckets' grouping keys (the state layout's); ``floor_us``: a
        fork's watermark floor (its savepoint's watermark), as the state step has it: the fork's
        first batches judge windows final against it, not against a watermark Spark has yet to make."""
        self.specs, self.server_timeout_s, self.dropped = specs, server_timeout_s, dropped
        self.joins, self.ids, self.floor_us = dict(joins or {}), ids, floor_us

    def init(self, handle: StatefulProcessorHandle) -> None:
        spark_state_server_timeout(handle, self.server_timeout_s)
        self.handle = handle
        for name in self.dropped:  # Spark keeps a state variable no processor names until it is deleted
            handle.deleteIfExists(state_name_of(name))
            handle.deleteIfExists(state_name_of(name) + FILLED)
            handle.deleteIfExists(state_name_of(name) + FINALS)
            handle.deleteIfExists(state_name_of(name) + PARTS)
        self.values = [handle.getValueState(state_name(s), OPEN_SCHEMA) for s in self.specs]
        self.finals = [handle.getListState(state_name(s) + FINALS, VALUE_SCHEMA) for s in self.specs]
        # Per rollup filled by a dimension's keys: the last window end the bucket filled to.
        self.filled = {i: handle.getValueState(state_name(s) + FILLED, FILLED_SCHEMA)
                       for i, s in enumerate(self.specs) if s.fill_keys is not None}
        # Per rollup a late reference version moves events of: each window's part per state bucket.
        self.parts = {i: handle.getValueState(state_name(s) + PARTS, VALUE_SCHEMA)
                      for i, s in enumerate(self.specs) if s.moves}
        self._watermark: int | None = None
        self._bucket = -1  # the call's rollup bucket (its grouping key)
        # The states this call read or wrote (a call is one bucket): the steps after advance, the
        # idle finalization and the timer read them again.
        self._held: dict[int, _Held] = {}
        self._parts: dict[int, pa.Table | None] = {}  # the moving rollups' parts this call read or wrote

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],  # type: ignore[override]
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        settle()
        self._held, self._parts = {}, {}
        self._bucket = int(key[0])
        kinds: list[str] = []
        values: list[bytes] = []
        got: dict[int, list[tuple[int, bytes]]] = {}
        marked: dict[int, list[tuple[int, bytes]]] = {}
        moved: dict[int, list[tuple[int, bytes]]] = {}
        for pdf in rows:
            for kind, value in zip(pdf.iloc[:, -2], pdf.iloc[:, -1], strict=True):
                if kind.startswith("partial:"):
                    _, i, source = kind.split(":")
                    got.setdefault(int(i), []).append((int(source), value))
                elif kind.startswith("move:"):
                    _, i, source = kind.split(":")
                    moved.setdefault(int(i), []).append((int(source), value))
                elif kind.startswith("gaps:"):
                    _, i, source = kind.split(":")
                    marked.setdefault(int(i), []).append((int(source), value))
                elif kind != TICK:
                    kinds.append(kind)
                    values.append(value)
        # In the order of their source buckets, not the shuffle's: a replay merges them alike.
        partials = {i: [from_ipc(v) for _, v in sorted(parts, key=lambda p: p[0])] for i, parts in got.items()}
        marks = {i: engine.Marks.of(pa.concat_tables([from_ipc(v) for _, v in sorted(parts, key=lambda p: p[0])]))
                 for i, parts in marked.items()}
        watermark = self._watermark = self._floored(timerValues)
        # A late reference version's moves come before the batch's events: they replace what the
        # state buckets sent before this batch, to which the batch's partials then add.
        for i in sorted(moved):
            self._move(i, [(s, from_ipc(v)) for s, v in sorted(moved[i], key=lambda p: p[0])], watermark, kinds, values)
        for i, sent in got.items():
            if self.specs[i].moves:
                self._add_parts(i, [(s, from_ipc(v)) for s, v in sorted(sent, key=lambda p: p[0])])
        for i, empty in self._key_fill(watermark).items():
            partials.setdefault(i, []).append(empty)
        for i in marks:  # a withdrawn gap rewrites windows even in a batch with no partials for them
            partials.setdefault(i, []).append(self.specs[i].window_schema().empty_table())
        counts = []
        for i in sorted(partials):
            spec, parts = self.specs[i], partials[i]
            schema = spec.window_schema()  # a cast per part only where its schema differs: a bucket gets one per source
            batch = pa.concat_tables([p if p.schema == schema else p.cast(schema) for p in parts]) \
                if len(parts) > 1 else parts[0]
            if spec.fill:  # between each key's first and last window, the final ones too
                batch = pa.concat_tables([batch.cast(schema),
                                          engine.fill(spec, self._load(i, full=True), batch, watermark)])
            adv = self._advance(i, batch, watermark, kinds, values, marks.get(i))
            events = int(pc.sum(batch.column(EVENT_COUNT)).as_py() or 0)
            counts += [(spec.name, "counted", events - adv.corrected), (spec.name, "corrected", adv.corrected)]
        self._advance_rest(set(partials), watermark, kinds, values)
        self._finalize_idle(set(partials), kinds, values)
        if counts:
            kinds.append(COUNTS)
            values.append(_counts([c for c in counts if c[2]]))
        self._timer()
        if kinds:
            yield pd.DataFrame({PACK_KIND: kinds, ROWS: values})

    def handleInitialState(self, key: Any, initialState: pd.DataFrame,  # type: ignore[override]
                           timerValues: TimerValues) -> None:
        """A fork's first batch: the bucket's windows of each rollup from the savepoint
        (:func:`initial_windows`), their timer set."""
        self._held, self._parts = {}, {}
        self._watermark = self._floored(timerValues)
        got: dict[str, list[pa.Table]] = {}
        for name, value in zip(initialState.iloc[:, -2], initialState.iloc[:, -1], strict=True):  # as INITIAL ends
            got.setdefault(name, []).append(from_ipc(value))
        for i, spec in enumerate(self.specs):
            if spec.name in got:
                # PySpark hands a bucket's rows over in chunks, a call each: added to what earlier calls stored.
                held = self._load(i, full=True)
                saved = pa.concat_tables(got[spec.name]).cast(engine.state_schema(spec))
                self._store(i, pa.concat_tables([held, saved]) if held is not None else saved)
            if spec.moves and spec.name + PARTS in got:
                held_parts = self._load_parts(i)
                saved_parts = pa.concat_tables(got[spec.name + PARTS]).cast(engine.parts_schema(spec))
                self._store_parts(i, pa.concat_tables([held_parts.cast(saved_parts.schema), saved_parts])
                                  if held_parts is not None else saved_parts)
        self._timer()

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        self._held, self._parts = {}, {}
        self._bucket = int(key[0])
        kinds: list[str] = []
        values: list[bytes] = []
        watermark = self._watermark = self._floored(timerValues)
        filled = self._key_fill(watermark)
        for i, empty in filled.items():
            self._advance(i, empty, watermark, kinds, values)
        self._advance_rest(set(filled), watermark, kinds, values)
        self._timer()
        if kinds:
            yield pd.DataFrame({PACK_KIND: kinds, ROWS: values})

    def _floored(self, timer_values: TimerValues) -> int | None:
        """The batch's watermark (microseconds; None: none yet), never below the floor."""
        us = watermark_us(timer_values)
        if self.floor_us is None:
            return us
        return self.floor_us if us is None else max(us, self.floor_us)

    def _advance_rest(self, done: set[int], watermark: int | None, kinds: list[str], values: list[bytes]) -> None:
        """The rollups of the bucket the batch brought no partials for: windows the watermark has
        reached written final, those past the horizon dropped."""
        if watermark is None:
            return
        for i in range(len(self.specs)):
            if i in done:
                continue
            due = self._due(i)
            if due is None or due > watermark:
                continue
            self._advance(i, None, watermark, kinds, values)

    def _advance(self, i: int, batch: pa.Table | None, watermark: int | None, kinds: list[str],
                 values: list[bytes], marks: engine.Marks | None = None) -> engine.Advanced:
        """Rollup ``i``'s windows of the bucket folded with ``batch`` (:func:`enrich.rollups.engine.advance`,
        with the batch's gap ``marks``), stored, and the rows written appended to ``kinds``/``values``."""
        adv = engine.advance(self.specs[i], self._load(i, full=self._needs_finals(i, batch, watermark, marks)),
                             batch, watermark, marks)
        self._store(i, adv.state)
        if adv.rows.num_rows:
            kinds.append(rows_kind(i))
            values.append(to_ipc(adv.rows))
        if adv.evicted and self.specs[i].moves:  # the parts of the windows that left go too
            self._store_parts(i, engine.evict_parts(self.specs[i], self._load_parts(i), watermark))
        return adv

    def _move(self, i: int, moves: list[tuple[int, pa.Table]], watermark: int | None, kinds: list[str],
              values: list[bytes]) -> None:
        """Rollup ``i``'s windows the state buckets' ``moves`` (``(source, table)``, in source order)
        change, rebuilt from their parts (:func:`enrich.rollups.engine.move`) and written again."""
        spec = self.specs[i]
        got = engine.move(spec, self._load(i, full=True), self._load_parts(i), moves, watermark)
        self._store(i, got.advanced.state)
        self._store_parts(i, got.parts)
        if got.advanced.rows.num_rows:
            kinds.append(rows_kind(i))
            values.append(to_ipc(got.advanced.rows))

    def _add_parts(self, i: int, partials: list[tuple[int, pa.Table]]) -> None:
        self._store_parts(i, engine.add_parts(self.specs[i], self._load_parts(i), partials))

    def _load_parts(self, i: int) -> pa.Table | None:
        """Rollup ``i``'s parts of the bucket: read once per call, then as this call stored them."""
        if i not in self._parts:
            got = self.parts[i].get()
            self._parts[i] = from_ipc(bytes(got[0])) if got is not None else None
        return self._parts[i]

    def _store_parts(self, i: int, parts: pa.Table) -> None:
        if parts.num_rows:
            self.parts[i].update((to_ipc(parts),))
        else:
            self.parts[i].clear()
        self._parts[i] = parts if parts.num_rows else None

    def _key_fill(self, watermark: int | None) -> dict[int, pa.Table]:
        """Per rollup that fills by a dimension's keys (``fill_keys``): the empty windows of the
        dimension's keys routed to this bucket that the bucket's state does not hold, for every window
        the watermark passed since the last call (the first call with a watermark marks where filling
        starts: every bucket has it in the same batch, called by the tick source or its timer),
        within the correction horizon."""
        out: dict[int, pa.Table] = {}
        if watermark is None or not self.joins:
            return out
        lookups = None
        for i, spec in enumerate(self.specs):
            if spec.fill_keys is None:
                continue
            w = spec.window_us
            last = (watermark // w) * w  # the last window end the watermark has reached
            got = self.filled[i].get()
            if got is None or got[0] < last:
                self.filled[i].update((last,))
            if got is None:
                continue
            starts = [e - w for e in range(int(got[0]) + w, last + 1, w) if e + spec.correct_for_us > watermark]
            if not starts:
                continue
            join = self.joins[spec.fill_keys]
            if lookups is None:  # the batch's pinned versions, as the in-plan joins read them
                lookups = PlanEnricher(tuple(self.joins.values()), None).lookups()
            base, overlay = lookups[spec.fill_keys]
            tables = []
            for s in starts:
                keys = dimension_keys(spec, join, base, overlay, s)
                mine = keys.filter(pa.array(_route(keys, spec.by, self.ids) == self._bucket))
                tables.append(mine.append_column(WINDOW_START, pa.array(np.full(mine.num_rows, s), pa.int64())))
            wanted = pa.concat_tables(tables)
            state = self._load(i, full=True)
            if state is not None and state.num_rows and wanted.num_rows:
                wanted = wanted.join(state.select([*spec.by, WINDOW_START]), [*spec.by, WINDOW_START],
                                     join_type="left anti", use_threads=False)
            if wanted.num_rows:
                out[i] = engine.empty_windows(spec, wanted.select(list(spec.by)), wanted.column(WINDOW_START))
        return out

    def _finalize_idle(self, done: set[int], kinds: list[str], values: list[bytes]) -> None:
        """In a batch the job read no event in for ``idle_finalize`` (wall clock, downtime included),
        the bucket's open windows of that rollup written final (``_finalized_by: idle``); not those
        of a rollup the call brought partials (events held for completeness, released now): one row
        per window and batch."""
        for i, spec in enumerate(self.specs):
            if i in done or not _idle_for(spec):
                continue
            state = self._load(i)
            if state is None or bool(pc.all(state.column(FINAL)).as_py()):
                continue
            adv = engine.finalize_idle(spec, state)
            self._store(i, adv.state)
            kinds.append(rows_kind(i))
            values.append(to_ipc(adv.rows))

    def _load(self, i: int, full: bool = False) -> pa.Table | None:
        """Rollup ``i``'s open windows of the bucket (``full``: every window, the final ones too),
        None for none: read once per call (``_held``), then as stored."""
        held = self._held.get(i)
        if held is None:
            got = self.values[i].get()
            table = engine.state_from_ipc(got[0], self.specs[i]) if got is not None and got[0] else None
            span = (int(got[1]), int(got[2])) if got is not None and got[1] is not None else None
            held = self._held[i] = _Held(table, span is None, span)
        if full and not held.full:
            parts = [engine.state_from_ipc(bytes(v[0]), self.specs[i]) for v in self.finals[i].get()]
            if held.table is not None:
                parts.insert(0, held.table)
            held.table, held.full = (pa.concat_tables(parts) if parts else None), True
        return held.table

    def _needs_finals(self, i: int, batch: pa.Table | None, watermark: int | None,
                      marks: engine.Marks | None) -> bool:
        """Whether folding ``batch`` into rollup ``i``'s windows needs its final ones: the batch
        reaches back to them (a window at or before the last final one), one leaves the horizon, or
        gap marks may rewrite them."""
        self._load(i)
        span = self._held[i].span
        if span is None or self._held[i].full:
            return False
        if marks is not None and (marks.closed or marks.withdrawn):
            return True
        spec = self.specs[i]
        if watermark is not None and span[0] + spec.window_us + spec.correct_for_us <= watermark:
            return True
        return batch is not None and batch.num_rows > 0 and \
            int(pc.min(batch.column(WINDOW_START)).as_py()) <= span[1]

    def _store(self, i: int, state: pa.Table) -> None:
        """Store rollup ``i``'s windows after a call (every window the call loaded, changed): the
        open ones as the bucket's value; the final ones in place of those stored when the call had
        loaded them, else appended (the windows that became final in this call)."""
        held = self._held.get(i) or _Held(None, True, None)
        final = partial.as_numpy(state.column(FINAL)).astype(bool)
        finals, open_ = state.filter(pa.array(final)), state.filter(pa.array(~final))
        span = held.span if not held.full else None
        if held.full:
            if finals.num_rows:
                self.finals[i].put([(engine.state_to_ipc(finals),)])
            elif held.span is not None:
                self.finals[i].clear()
        elif finals.num_rows:
            self.finals[i].appendValue((engine.state_to_ipc(finals),))
        if finals.num_rows:
            starts = finals.column(WINDOW_START)
            first, last = int(pc.min(starts).as_py()), int(pc.max(starts).as_py())
            span = (min(first, span[0]), max(last, span[1])) if span is not None else (first, last)
        if open_.num_rows or span is not None:
            self.values[i].update((engine.state_to_ipc(open_) if open_.num_rows else b"",
                                   *(span if span is not None else (None, None))))
        else:
            self.values[i].clear()
        self._held[i] = _Held(open_ if open_.num_rows else None, span is None, span)

    def _due(self, i: int) -> int | None:
        """The earliest watermark (µs) at which a window of rollup ``i`` in the bucket becomes final
        or leaves the state."""
        spec, table = self.specs[i], self._load(i)
        held = self._held[i]
        due = [d] if table is not None and (d := _next_due(spec, table)) is not None else []
        if not held.full and held.span is not None:
            due.append(held.span[0] + spec.window_us + spec.correct_for_us)
        return min(due) if due else None

    def _timer(self) -> None:
        """One timer at the earliest time any rollup of the bucket needs the watermark to reach: a
        window of it final or out of the horizon, the next window end of a rollup filled by a
        dimension's keys (which keeps every bucket called as the watermark moves)."""
        due = [d for i in range(len(self.specs)) if (d := self._due(i)) is not None]
        wm = self._watermark
        # Before the first watermark: a timer at its first moment, so every bucket has it alike.
        due += [(wm // s.window_us + 1) * s.window_us if wm is not None else 1
                for s in self.specs if s.fill_keys is not None]
        keep_one_timer(self.handle, min(due) if due else None)

    def close(self) -> None:
        pass


def idle_facts(layout: CheckpointLayout, batch_id: int, topic: str) -> dict[str, int | None]:
    """The driver's :data:`IDLE_PROPERTY` for ``batch_id`` (planned: in Spark's offset log): its
    time, and the time of the last batch that read events from ``topic`` (this one when its end
    offsets differ from the batch before's), kept in the checkpoint (``idle.json``) so that downtime
    counts as idle time. Decided from the offset log, a replay gets the same."""
    entry = layout.offset_entry(batch_id, missing_ok=False)
    assert entry is not None
    time_ms = int(entry.meta.get("batchTimestampMs", 0))
    before = layout.offset_entry(batch_id - 1) if batch_id > 0 else None
    now = next((src for src in entry.sources if topic in src), None)
    read = before is None or now != next((src for src in before.sources if topic in src), None)
    path = layout.idle
    if read:
        if not path.exists() or json.loads(path.read_text(encoding="utf-8")).get("batch") != batch_id:
            write_json_atomic(path, {"batch": batch_id, "read_ms": time_ms})
        return {"time_ms": time_ms, "read_ms": time_ms}
    kept = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    read_ms = kept.get("read_ms") if isinstance(kept.get("batch"), int) and kept["batch"] < batch_id else None
    return {"time_ms": time_ms, "read_ms": read_ms if isinstance(read_ms, int) else None}


# A reused Python worker keeps the keys of the dimension versions it saw: the buckets of a batch
# (and later batches, while the versions stay) read them once. Keyed by the lookups themselves, kept.
_KEYS: OrderedDict[tuple[int, int, int | None, tuple[str, ...]], tuple[object, object, pa.Table]] = OrderedDict()


def dimension_keys(spec: RollupSpec, join: JoinSpec, base: Lookup, overlay: Lookup | None, start_us: int) -> pa.Table:
    """The distinct ``by`` values (none null) of every key of ``join``'s dimension, as the join gives
    them (an ``as_of`` join: valid at ``start_us``; a key deleted by then, or whose first version is
    later, has none)."""
    ident = (id(base), id(overlay), start_us if join.time is not None else None, spec.by)
    hit = _KEYS.get(ident)
    if hit is not None:
        return hit[2]
    names = [k for _, k in join.pairs]
    parts = [base.table.select(names)] + ([overlay.table.select(names)] if overlay is not None else [])
    keys = pa.concat_tables([p.cast(parts[0].schema) for p in parts]).group_by(names, use_threads=False).aggregate([])
    events = pa.table({e: keys.column(k) for e, k in join.pairs})
    if join.time is not None:
        events = events.append_column(join.time, pa.array(np.full(events.num_rows, start_us), pa.timestamp("us", "UTC")))
    joined = join_table(events, dataclasses.replace(join, inner=True), base, overlay)
    if CLIPPED in joined.column_names:  # a key whose first version is later: not there yet
        joined = joined.filter(pc.invert(pc.fill_null(joined.column(CLIPPED), False)))
    by = list(spec.by)
    got = joined.select(by).cast(pa.schema([pa.field(b, t) for b, t in zip(by, spec.by_types, strict=True)]))
    valid = functools.reduce(pc.and_, [pc.is_valid(got.column(b)) for b in by])
    got = got.filter(valid).group_by(by, use_threads=False).aggregate([])
    _KEYS[ident] = (base, overlay, got)
    while len(_KEYS) > 16:
        _KEYS.popitem(last=False)
    return got


def _idle_for(spec: RollupSpec) -> bool:
    """Whether this batch makes ``spec``'s open windows final by idleness (:data:`IDLE_PROPERTY`)."""
    if spec.idle_finalize_us is None:
        return False
    from pyspark import TaskContext

    ctx = TaskContext.get()
    raw = ctx.getLocalProperty(IDLE_PROPERTY) if ctx is not None else None
    if raw is None:
        return False
    facts = json.loads(raw)
    if facts.get("read_ms") is None:
        return False
    return (int(facts["time_ms"]) - int(facts["read_ms"])) * 1000 >= spec.idle_finalize_us


def state_name(spec: RollupSpec) -> str:
    """The rollup's state variable in the rollup step: its windows of the bucket."""
    return state_name_of(spec.name)


#: The rollups' state variables' names begin so.
ROLLUP_PREFIX = "rollup_"


def state_name_of(name: str) -> str:
    """The state variable of the rollup named ``name``."""
    return ROLLUP_PREFIX + name


#: The state variable (after the rollup's own name) of the last window end a bucket filled by keys to.
FILLED = config.FILLED
FILLED_SCHEMA = StructType([StructField("end_us", LongType(), False)])
#: The state variable (after the rollup's own name) of a moving rollup's parts (Arrow IPC, the
#: windows' parts by state bucket: :func:`enrich.rollups.engine.parts_schema`).
PARTS = config.PARTS
#: The state variable (a list, after the rollup's own name) of the bucket's final windows: chunks of
#: state tables, in the order they became final (or one, rewritten by a call that read them).
FINALS = config.FINALS
#: The rollup's own state variable: its open windows of the bucket (a state table as Arrow IPC; empty
#: bytes for none) and the first and last window start of its final ones (null: none).
OPEN_SCHEMA = StructType([StructField("table", BinaryType(), False), StructField("final_first", LongType(), True),
                          StructField("final_last", LongType(), True)])


@dataclass
class _Held:
    """What a call of the rollup step holds of one rollup's windows: ``table`` the open ones, or
    every one when ``full`` (the final ones read, or none kept apart); ``span`` the first and last
    window start of the final ones kept apart (None: none)."""

    table: pa.Table | None
    full: bool
    span: tuple[int, int] | None


#: A savepoint's rollup windows (:mod:`enrich.ops.savepoint`): the rollup's name, and one bucket's
#: state table of it (Arrow IPC).
SAVED = StructType([StructField("rollup", StringType(), False), StructField("windows", BinaryType(), False)])
#: The rollup step's initial state: a rollup bucket, the rollup's name, its windows of that bucket.
INITIAL = StructType([StructField(RBUCKET, IntegerType(), False), StructField(PACK_KIND, StringType(), False),
                      StructField(ROWS, BinaryType(), False)])


def initial_windows(batches: Iterator[pa.RecordBatch], *, specs: tuple[RollupSpec, ...],
                    ids: tuple[int, ...], sources: Mapping[int, int] | None = None) -> Iterator[pa.RecordBatch]:
    """``mapInArrow``: a savepoint's windows (:data:`SAVED`) as the rollup step's initial state
    (:data:`INITIAL`): each window in the rollup bucket its keys route to under the new checkpoint's
    grouping keys ``ids``; a rollup the job no longer has is left out. A moving rollup's parts (rows
    named ``<rollup>_parts``) go with their windows, each part's state bucket as the new layout
    names it (``sources``: the savepoint's grouping key to the fork's; a fork keeps the bucket count
    of a savepoint with parts: :meth:`enrich.ops.savepoint.Savepoint.check`)."""
    by_name = {s.name: s for s in specs}
    by_name.update({s.name + PARTS: s for s in specs if s.moves})
    for batch in batches:
        out: tuple[list[int], list[str], list[bytes]] = ([], [], [])
        for name, value in zip(batch.column("rollup").to_pylist(), batch.column("windows").to_pylist(), strict=True):
            spec = by_name.get(name)
            if spec is None:
                continue
            if name != spec.name:
                table = from_ipc(value).cast(engine.parts_schema(spec))
                if sources is None:
                    raise ValueError(f"rollup {spec.name}: a savepoint's parts without the fork's bucket of each")
                now = [sources[s] for s in partial.as_numpy(table.column(engine.SOURCE)).tolist()]
                table = table.set_column(table.schema.get_field_index(engine.SOURCE), engine.parts_schema(spec).field(
                    engine.SOURCE), pa.array(now, pa.int32()))
            else:
                table = engine.state_from_ipc(value, spec)
            rb = _route(table, spec.by, ids)
            for b in np.unique(rb).tolist():
                out[0].append(int(b))
                out[1].append(name)
                out[2].append(to_ipc(table.filter(pa.array(rb == b))))
        if out[0]:
            yield pa.RecordBatch.from_arrays([pa.array(out[0], pa.int32()), pa.array(out[1], pa.string()),
                                              pa.array(out[2], pa.binary())], names=INITIAL.fieldNames())


def _next_due(spec: RollupSpec, state: pa.Table) -> int | None:
    """The earliest watermark (µs) at which a window of ``state`` becomes final or leaves the state."""
    if state.num_rows == 0:
        return None
    end = partial.as_numpy(state.column(WINDOW_START)) + spec.window_us
    final = partial.as_numpy(state.column(FINAL)).astype(bool)
    return int(np.min(np.where(final, end + spec.correct_for_us, end)))



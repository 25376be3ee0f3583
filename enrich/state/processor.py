"""The stateful processor of the keyed state step (``transformWithStateInPandas``), on the executors.

The step is keyed by a hash bucket of the device key, not by the device: a Python call costs about a
millisecond, so one call per bucket per micro-batch handles all of its devices at once through
:mod:`enrich.state.engine`. A bucket's device states are the engine's state table, kept in Spark's
state store as Arrow IPC bytes: a base value and the changes stored since (each call appends the
rows it changed and the keys it dropped; a new base once those outnumber it), with a copy on the
executor that stored it last (:mod:`enrich.state.cache`). One event-time timer per bucket, at the
time its next device expires, drops expired devices from buckets that get no more events.

Rows travel to and from the processor *packed* (:mod:`enrich.packed`): one row per bucket and
input chunk, holding the chunk's events as Arrow IPC bytes. PySpark hands a
``transformWithStateInPandas`` processor its input row by row (``itertuples``, then
``pandas.DataFrame(rows)``): unpacked, that hand-over took half of the step's Python time
(docs/benchmarks.md). Packed, the processor works on Arrow tables end to end, and every event
column keeps its exact Arrow type (no integer through float64, no timestamp through nanoseconds).

Unpacked input columns: the parsed events (``enrich.events.parse``) plus ``_ts_us`` (the event time
in microseconds). Unpacked output columns: the event columns passed through, then the flat state
fields (``_state_<field>``, times in microseconds) and ``_late``; the streaming plan
(:mod:`enrich.state.stream`) folds the flat fields into the ``state`` struct.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.accumulators import Accumulator
from pyspark.sql.streaming.stateful_processor import (
    ExpiredTimerInfo,
    StatefulProcessor,
    StatefulProcessorHandle,
    TimerValues,
)

from enrich import packed
from enrich.calls.step import KEY, BucketCalls, CallStep
from enrich.columns import (
    CAUSE,
    ERROR,
    FLAT,
    LATE,
    LATE_AT_READ,
    PACK_KIND,
    PROVISIONAL,
    RBUCKET,
    RETRACTED,
    REVISION,
    ROLLUP_TIME,
    ROWS,
    TS_US,
)
from enrich.dimension.corrections import QUIET
from enrich.gaps import engine as gap_engine
from enrich.ipc import from_ipc, to_ipc
from enrich.joins import PINNED_PROPERTY, JoinSpec, PlanEnricher, join_table
from enrich.joins.asof import CLIPPED
from enrich.joins.partitioned import (
    CACHE,
    PartitionedDim,
    Version,
    apply_changes,
    cache_limit,
    conform,
    lookup,
)
from enrich.rollups import engine as rollup_engine
from enrich.rollups import packs
from enrich.rollups.spec import RollupSpec
from enrich.state import corrections, engine, rollups, wait
from enrich.state.cache import TableCache
from enrich.state.corrections import NO_BOUND_START
from enrich.state.engine import StateSpec
from enrich.state.stored import (
    CALLS_NAME,
    CHUNK_KEY_SCHEMA,
    CHUNK_SCHEMA,
    DELTA_SCHEMA,
    DELTAS,
    DIM_SCHEMA,
    GAPS,
    GAPS_CLOSED,
    HELD,
    SIZES_SCHEMA,
    STATE_NAME,
    TOKEN_SCHEMA,
    VALUE_SCHEMA,
    WRITTEN,
    WRITTEN_INDEX_SCHEMA,
    bucket_table,
    revisions_key,
)
from enrich.state.timers import keep_one_timer, watermark_us
from enrich.worker import settle
from refstream import contract
from refstream.compat import spark_state_server_timeout
from refstream.contract import DatasetSchema

log = logging.getLogger(__name__)


#: A kept chunk of at least this many bytes (in memory) is stored compressed.
COMPRESS_FROM = 16 * 1024


class DeviceStateProcessor(StatefulProcessor):
    """One call per bucket and micro-batch: apply its events to its devices' state (see module doc).

    ``spec`` is the engine's spec with ``_ts_us`` as the timestamp; ``columns`` the event columns
    passed through, in output order; ``devices`` an accumulator of :class:`enrich.accumulators.KeyedCounts` each call
    reports its bucket's device count to; ``dims`` the partitioned dimensions, whose joins add their
    columns after ``columns`` (:mod:`enrich.joins.partitioned`); ``cache`` where the executors keep a
    copy of each bucket table they stored (None: every call reads it from the state store);
    ``waits``: the datasets events wait for (:mod:`enrich.state.wait`; held events are kept in the
    bucket's ``held`` state variable, and every event gets ``_provisional``); ``floor_us``: a watermark
    floor (event time, microseconds): a job forked from a savepoint (:mod:`enrich.ops.savepoint`)
    judges late events and expiry against the savepoint job's watermark until its own passes it.
    ``rollups``: the rollups the step feeds (:mod:`enrich.state.rollups`), over the rollup step's
    buckets ``rollup_ids`` (grouping keys); with them the step's rows are the rollup step's input,
    and the events the in-plan inner joins did not match (their ``matched`` columns: ``inner``)
    count in no rollup. ``corrected``: the corrected joins (:mod:`enrich.state.corrections`): the
    bucket keeps what it writes within their horizon and writes corrections of it, as rows of
    ``out_schema`` (the step's output rows); a corrected partitioned join's late versions are found
    in the bucket, which holds its versions and events, and counted in ``correction_counts`` (an
    accumulator of ``enrich.accumulators.KeyedTallies``, :func:`enrich.state.corrections.tally`);
    ``before``: the joins before the step (their specs, inner off), which a correction of one of
    them runs again with the batch's pinned versions. ``server_timeout_s``: how long a request to the task's state server may go unanswered before it
    fails the task (``state.server_timeout``; a state server thread that died would otherwise leave
    the task, its batch and the query waiting for good)."""

    def __init__(self, spec: StateSpec, columns: tuple[str, ...],
                 devices: Accumulator[dict[int, int]] | None = None, dims: tuple[PartitionedDim, ...] = (),
                 cache: TableCache | None = None, waits: wait.WaitSpec | None = None,
                 floor_us: int | None = None, calls: CallStep | None = None,
                 call_counts: Accumulator[dict[int, dict[str, Any]]] | None = None,
                 *, server_timeout_s: float = 120.0, rollups: tuple[RollupSpec, ...] = (),
                 rollup_ids: tuple[int, ...] = (), inner: tuple[str, ...] = (),
                 gaps: gap_engine.GapSpec | None = None,
                 gap_records: Accumulator[dict[int, dict[str, Any]]] | None = None,
                 corrected: tuple[corrections.Corrects, ...] = (), out_schema: pa.Schema | None = None,
                 correction_counts: Accumulator[dict[int, dict[str, Any]]] | None = None,
                 before: tuple[JoinSpec, ...] = ()) -> None:
        self.spec, self.columns, self.devices, self.dims, self.cache = spec, columns, devices, dims, cache
        self.corrected, self.out_schema = corrected, out_schema
        self.correction_counts, self.before = correction_counts, before
        # The joins before the step a correction runs again (enrich.state.corrections.join_again).
        self._rerun = corrections.join_again(before, [c.dataset for c in corrected if c.before])
        # A corrected partitioned join's dimension: the old and new versions and the records of the call's batch.
        self._dim_changes: dict[int, tuple[pa.Table, pa.Table, pa.Table]] = {}
        # The rollups whose windows a correction moves events between, and this call's moves.
        self._moving = tuple(i for i, r in enumerate(rollups) if r.moves)
        # Kept a moving rollup's widest window longer than the horizon: a window the horizon's start
        # falls in has all its events kept, so a correction within the horizon moves it too.
        self._keep_extra = max((rollups[i].window_us for i in self._moving), default=0)
        self._moves_out: list[tuple[int, str, bytes]] = []
        self.waits, self.floor_us = waits, floor_us
        self.calls, self.call_counts = calls, call_counts
        self.server_timeout_s = server_timeout_s
        self.rollups, self.rollup_ids, self.inner = rollups, rollup_ids, inner
        self.gaps, self.gap_records = gaps, gap_records
        self._gap_done: pa.Table | None = None   # this call's gap records (the rollups' marks)
        self._loaded: str | None = None
        self._sizes = (0, 0)
        self._types = {spec.key: spec.key_type, spec.timestamp: pa.int64(),
                       **{c: t for c, _, t in spec.aggregates}}
        # The state's aggregates over a corrected join's columns: a correction folds them again.
        changing = {o for k in self._rerun for o in (*[o for _, o in before[k].columns], before[k].matched)}
        for d in dims:
            if any(c.dim == d.index for c in corrected):
                changing |= {o for _, o in d.join.columns} | {d.join.matched}
        refolded = tuple(a for a in spec.aggregates if a[0] in changing)
        self._refold = dataclasses.replace(spec, aggregates=refolded) if refolded else None
        # The columns a correction rewrites in the kept rows (through their revisions table: a kept row
        # says what was last written of it, what the state and the rollups counted): those of the
        # corrected joins before or in the step, and of the joins before it on their columns.
        revisable = {CLIPPED} if corrected else set()
        for c in corrected:
            if c.dim is not None:
                d = next(d for d in dims if d.index == c.dim)
                revisable |= {o for _, o in d.join.columns} | {d.join.matched}
            elif c.before:
                chain = [before[k] for k in corrections.join_again(before, [c.dataset])]
                revisable |= {o for b in chain for o in (*[o for _, o in b.columns], b.matched)}
        self._revisable = tuple(sorted(revisable))
        self._accs = engine.accumulators(self._refold) if self._refold is not None else ()
        # What a kept row's revisions table holds of it as last written: the corrected columns and the
        # refolded state fields.
        self._rewritten = self._revisable + tuple(FLAT + f"{c}_{a}" for c, aggs, _ in refolded for a in aggs)
        self._chunks: dict[int, pa.Table] = {}  # a call's kept chunks as read (and revised)
        self._warned_unknown = False

    def init(self, handle: StatefulProcessorHandle) -> None:
        spark_state_server_timeout(handle, self.server_timeout_s)  # before the first request
        self.handle = handle
        self.value = handle.getValueState(STATE_NAME, VALUE_SCHEMA)
        self.token = handle.getValueState(STATE_NAME + "v", TOKEN_SCHEMA)
        self.deltas = handle.getListState(DELTAS, DELTA_SCHEMA)
        self.sizes = handle.getValueState(STATE_NAME + "n", SIZES_SCHEMA)
        self.dim_values = [handle.getValueState(d.state_name, DIM_SCHEMA) for d in self.dims]
        self.dim_tokens = [handle.getValueState(d.state_name + "v", TOKEN_SCHEMA) for d in self.dims]
        # The calls' results per device (enrich.calls.step), beside the device table.
        self.call_value = handle.getValueState(CALLS_NAME, VALUE_SCHEMA) if self.calls is not None else None
        if self.dims:  # within this worker's share of spark.executor.pyspark.memory
            CACHE.resize(cache_limit())
        if self.waits is not None:  # only then: a checkpoint without waiting keeps its state variables
            self.held = handle.getValueState(HELD, VALUE_SCHEMA)
        if self.gaps is not None:
            self.gap_table = handle.getValueState(GAPS, VALUE_SCHEMA)
            self.gap_closed = handle.getValueState(GAPS_CLOSED, VALUE_SCHEMA)
        if self.corrected:  # what the bucket wrote within the horizon (enrich.state.corrections)
            self.written = handle.getMapState(WRITTEN, CHUNK_KEY_SCHEMA, CHUNK_SCHEMA)
            self.written_index = handle.getValueState(WRITTEN + "n", WRITTEN_INDEX_SCHEMA)

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame],  # type: ignore[override]
                        timerValues: TimerValues) -> Iterator[pd.DataFrame]:
        settle()
        self._gap_done = None
        self._chunks = {}
        self._written_index: dict[str, Any] | None = None
        self._dim_changes, self._moves_out = {}, []
        kinds = packed.unpack_kinds(rows)
        # A batch's changelog records come first: its events see the dimension as of their end.
        versions = [self._dimension(i, kinds.get(d.kind)) for i, d in enumerate(self.dims)]
        table = kinds.get(packed.EVENTS)
        # Before this batch's events are kept: they were joined with the versions that correct the others.
        fixed = self._correct(int(key[0]), self._watermark(timerValues), versions) if self.corrected else None
        if self.waits is not None:  # a tick row (enrich.source.tick) calls every bucket each trigger
            table = self._wait(table, self._watermark(timerValues))
        if table is None:
            if self.gaps is not None:  # a tick: silent devices' gaps open against the partitions' times
                self._gaps(int(key[0]), None, self._watermark(timerValues))
            if any(r.needs_ticks for r in self.rollups):  # a tick: the rollup step decides idleness, fills
                yield self._rollup_frame([(int(key[0]), packs.TICK, b"")], timerValues)
            if fixed is not None or self._moves_out:
                yield self._corrections_out(int(key[0]), fixed, timerValues)
            return
        # Shuffle order is not stable: rows leave in source order, so a replay gives the same output.
        table = table.take(pc.sort_indices(table, [("_partition", "ascending"), ("_offset", "ascending")]))
        names = list(self.columns)
        for dim, version in zip(self.dims, versions, strict=True):
            table = lookup(dim, table, version, ERROR)
            names += [out for _, out in dim.join.columns] + [dim.join.matched]
            if dim.join.time is not None and CLIPPED not in names:
                names.append(CLIPPED)
        ok = pc.is_null(table.column(ERROR)).to_numpy(zero_copy_only=False)
        good = table.filter(pa.array(ok))
        if self.gaps is not None:
            self._gaps(int(key[0]), good, self._watermark(timerValues))
        events = self._events(good)
        late_at_read = None
        if self.waits is not None:
            names.append(PROVISIONAL)
            late_at_read = good.column(LATE_AT_READ).to_numpy(zero_copy_only=False).astype(bool)
        applied = engine.apply(self.spec, self._load(), events, self._watermark(timerValues), late_at_read,
                               before=self._accs)
        self._store(key, applied.state, applied.touched, applied.removed)
        at = np.full(table.num_rows, -1, dtype=np.int64)
        at[ok] = np.arange(int(ok.sum()))
        pick = pa.array(at, mask=at < 0)
        arrays = [table.column(c) for c in names]
        for field, child in zip(applied.column.type, applied.column.flatten(), strict=True):
            arrays.append(child.take(pick))
            names.append(FLAT + field.name)
        if self.calls is not None:
            state_col = applied.column.take(pick)
            done = self._calls(int(key[0]), table, state_col, applied.state, applied.removed)
            for name, values in done.columns.items():
                arrays.append(values)
                names.append(FLAT + name)
            if any(r is not None for r in done.reasons):
                err = names.index(ERROR)
                arrays[err] = pc.coalesce(arrays[err], pa.array(done.reasons, pa.string()))
        arrays.append(applied.late.take(pick).fill_null(False))
        names.append(LATE)
        out = pa.Table.from_arrays(arrays, names=names)
        # An inner join drops its unmatched events after the state counted them, as with broadcast
        # (where the join runs after the step); dead letters always go on.
        keep = None
        for dim in self.dims:
            if dim.inner:
                matched = pc.fill_null(out.column(dim.join.matched), False)
                keep = matched if keep is None else pc.and_(keep, matched)
        if self.corrected:  # before the inner filter: a late version may match what it drops
            out = self._keep_written(out, table, applied.before, ok)
        if keep is not None:
            kept = pc.or_(keep, pa.array(~ok))
            out, table = out.filter(kept), table.filter(kept)
        if not self.rollups:
            yield packed.pack_output(out)
        else:
            yield self._with_rollups(int(key[0]), out.append_column(TS_US, table.column(TS_US)), timerValues)
        if fixed is not None or self._moves_out:  # after the events: the rollups count none of them
            yield self._corrections_out(int(key[0]), fixed, timerValues)

    def _corrections_out(self, bucket: int, fixed: pa.Table | None, timer_values: TimerValues) -> pd.DataFrame:
        """The corrections ``fixed`` as the step's output. With rollups they pass the rollup step as
        events do, but feed none: a corrected join runs in the join pass, after the rollup step, so
        no rollup holds a column it corrects."""
        if not self.rollups:
            assert fixed is not None  # moves need rollups
            return packed.pack_output(fixed)
        events = [(bucket, packs.EVENTS, v) for v in packed.pack_output(fixed)[ROWS]] if fixed is not None else []
        return self._rollup_frame(events + self._moves_out, timer_values)

    def _correct(self, bucket: int, watermark: int | None, versions: list[Version]) -> pa.Table | None:
        """The corrections this batch's late versions make of the events the bucket kept (as the
        step's output rows: ``_kind`` correction, their revision and cause), or None; the chunks
        behind the horizon dropped. Only the chunks a change can concern are read (by the index's
        times), and only those it corrected are written back. ``versions``: the partitioned
        dimensions' after the batch's records, which a corrected one's columns are looked up in again."""
        index = self._index()
        start = corrections.horizon_start(self.corrected, watermark)
        if start != NO_BOUND_START:
            start -= self._keep_extra
        gone = [c for c in index["chunks"] if c[3] < start]
        for c in gone:
            self._drop_chunk(c[0])
        chunks = [c for c in index["chunks"] if c[3] >= start]
        changes = self._changes(bucket, watermark, chunks)
        starts = [int(pc.min(t.column("start")).as_py()) for _, t in changes if t.num_rows]
        fixed: list[pa.Table] = []
        now: list[pa.Table] = []  # the corrected events looked up again
        if starts:
            first = min(starts)
            ready = corrections.prepare(changes)
            hits: list[tuple[int, corrections.Matched]] = []
            for c in chunks:
                if c[3] < first:  # every event of it is older than every change's span
                    continue
                got = self._read_chunk(c[0])
                if got is None:
                    continue
                found = corrections.match(got, ready, watermark)
                if found is not None:
                    hits.append((c[0], found))
            # Looked up again at once per set of kept columns (chunks kept under another plan may lack
            # one, and what is looked up again depends on them), then each chunk's revisions written
            # back, not its rows.
            alike: dict[tuple[str, ...], list[int]] = {}
            for i, (_, found) in enumerate(hits):
                alike.setdefault(tuple(found.rows.column_names), []).append(i)
            looked_of: dict[int, pa.Table] = {}
            for those in alike.values():
                every, _ = self._look_again(pa.concat_tables([hits[i][1].rows for i in those], promote_options="permissive"),
                                             versions)
                at = 0
                for i in those:
                    looked_of[i] = every.slice(at, hits[i][1].rows.num_rows)
                    at += hits[i][1].rows.num_rows
            for i, (chunk, found) in enumerate(hits):
                log = self._with_values(found.log, looked_of[i], found.at)  # what is written of them now
                self.written.updateValue((revisions_key(chunk),),
                                         (to_ipc(corrections.revisions(log, self._rewritten)),))
                self._chunks[chunk] = log
                fixed.append(found.rows)
                now.append(looked_of[i])
        if gone:
            self._store_index(index["next"], chunks)
        self._written_index = {"next": index["next"], "chunks": chunks}  # this call's: no second read
        if not fixed:
            return None
        written = pa.concat_tables(fixed, promote_options="permissive")
        rows = pa.concat_tables(now, promote_options="permissive")
        lost = ~self._counted(rows)
        if self._moving and self._moves_needed(written, rows):  # the rollups' windows in their span, rebuilt
            self._moves_out = self._moves(bucket, written, rows, watermark, chunks, start)
        if self.calls is not None and self.call_value is not None:  # made again at the device's next event
            self._stale_calls(written, rows)
        if self._refold is not None:  # the devices' aggregates over the corrected columns, folded again
            rows, more_written, more, restated = self._refold_state(bucket, written, rows, chunks)
            if self.calls is not None and self.call_value is not None and len(restated):
                self._stale_state_calls(restated)
            if more.num_rows:
                written = pa.concat_tables([written, more_written], promote_options="permissive")
                rows = pa.concat_tables([rows, more], promote_options="permissive")
                lost = np.concatenate([lost, ~self._counted(more)])
        # An event an inner join before or in the step dropped (never written) that it still does not
        # match: no correction (a fresh job would not write it, and no consumer has it to retract).
        seen = self._counted(written) | (rows.column(REVISION).to_numpy(zero_copy_only=False) > 1)
        if (lost & ~seen).any():
            rows, lost = rows.filter(pa.array(~(lost & ~seen))), lost[~(lost & ~seen)]
            if not rows.num_rows:
                return None
        if self.waits is not None and PROVISIONAL in rows.column_names:
            # As a fresh job would write the event now: provisional while a dataset it waits for is
            # not complete past it, final once it is (a late version usually comes with completeness).
            ts = rows.column(corrections.TS).to_numpy(zero_copy_only=False)
            rows = rows.set_column(rows.schema.get_field_index(PROVISIONAL), PROVISIONAL,
                                   pa.array(wait.incomplete(self.waits, _batch_facts(), ts), pa.bool_()))
        out = corrections.emitted(rows)
        if lost.any():  # a corrected inner partitioned join lost its match: a fresh job would not write it
            out = out.set_column(out.schema.get_field_index(RETRACTED), RETRACTED, pa.array(lost, pa.bool_()))
        # Rows kept under an earlier plan (other columns, a dataset's types changed) as this plan's rows.
        return _conform(out, self.out_schema, ())

    def _changes(self, bucket: int, watermark: int | None,
                 chunks: list[list[int]]) -> list[tuple[corrections.Corrects, pa.Table]]:
        """Per corrected join, in join order, this batch's changes: a broadcast join's from the
        driver's file, a partitioned join's from its records in this bucket (counted here)."""
        shipped = iter(_batch_changes(tuple(c for c in self.corrected if c.dim is None))
                       if any(c.dim is None for c in self.corrected) else ())
        out, found = [], []
        for c in self.corrected:
            if c.dim is None:
                out.append(next(shipped))
                continue
            got = self._dim_changes.get(c.dim)
            if got is None:
                continue
            start = watermark - c.horizon_us if watermark is not None else NO_BOUND_START
            # What the bucket wrote within this join's horizon (it keeps some before it for the moves).
            kept_until = max((k[3] for k in chunks if k[3] >= start), default=None)
            table = corrections.bucket_changes(c, *got, start, kept_until)
            found.append((c, table, start))
            out.append((c, table.filter(pc.invert(pc.is_in(table.column("result"), value_set=pa.array(QUIET))))))
        if self.correction_counts is not None and any(c.dim is not None for c in self.corrected):
            self.correction_counts.add({bucket: corrections.tally(found)})
        return out

    def _moves(self, bucket: int, written: pa.Table, rows: pa.Table, watermark: int | None, chunks: list[list[int]],
               complete_from: int) -> list[tuple[int, str, bytes]]:
        """The moves (:func:`enrich.state.rollups.moves`) of the corrected events ``rows`` (``written``:
        as last written before this batch): the bucket's new parts of the rollup windows in their
        span, from every event it kept there, as last written (this batch's corrections included)."""
        ts = rows.column(corrections.TS).to_numpy(zero_copy_only=False).astype(np.int64)
        widest = max(self.rollups[i].window_us for i in self._moving)
        lo = min(int(ts.min()) // self.rollups[i].window_us * self.rollups[i].window_us for i in self._moving)
        hi = int(ts.max()) + widest
        read = [t for c in chunks if c[3] >= lo and c[2] < hi and (t := self._read_chunk(c[0])) is not None]
        kept = pa.concat_tables(read, promote_options="permissive") if read else rows.slice(0, 0)
        kts = kept.column(corrections.TS).to_numpy(zero_copy_only=False)
        # As last written: this batch's corrections are in the chunks as read (their values rewritten).
        # The events the rollups count: in the span, matched by the inner joins, not a call's dead letter.
        ok = (kts >= lo) & (kts < hi) & self._counted(kept)
        if ERROR in kept.column_names:
            ok &= pc.is_null(kept.column(ERROR)).to_numpy(zero_copy_only=False)
        kept = kept.filter(pa.array(ok))
        kept = kept.rename_columns([TS_US if n == corrections.TS else n for n in kept.column_names])
        cause = _cause_text(rows.column(CAUSE)[0].as_py())
        return rollups.moves(self.rollups, self._moving, ts, cause, kept, complete_from, watermark,
                             self.rollup_ids, bucket, written)

    def _with_values(self, log: pa.Table, looked: pa.Table, at: np.ndarray) -> pa.Table:
        """The kept rows ``log`` with the corrected values (``looked``, of its rows ``at``) of the
        columns a correction rewrites."""
        for name in self._revisable:  # of an event corrected twice in the batch: its last
            if name in log.column_names and name in looked.column_names:
                log = corrections.put(log, name, at, looked.column(name))
        return log

    def _refold_state(self, bucket: int, written: pa.Table, rows: pa.Table,
                      chunks: list[list[int]]) -> tuple[pa.Table, pa.Table, pa.Table, pa.Array]:
        """The state's aggregates over the corrected columns folded again for the devices of the
        corrected events ``rows`` (``written``: as kept) whose values of those columns changed: from
        the accumulators kept before each device's first kept event, over every event it kept, as
        last written (this batch's corrections included). Returns ``rows`` with their refolded
        ``state`` fields, then the corrections of the devices' later events whose ``state`` changed
        from what was last written of it, as kept and as corrected (their next revision, the cause
        of the device's first corrected event); and the devices some event's ``state`` changed of. The kept events' accumulators and
        revisions, and the devices' stored state, are written back. A device with events kept before
        its aggregates were folded (corrections added to a checkpoint that had run) keeps its state as
        first computed until they leave the horizon."""
        spec, key = self._refold, self.spec.key
        assert spec is not None
        cols = {c for c, _, _ in spec.aggregates}
        none = rows.slice(0, 0)
        changed = _changed(written, rows, cols)
        if not changed.any():
            return rows, none, none, pa.array([], self.spec.key_type)
        devices = pc.unique(rows.column(key).filter(pa.array(changed)))
        got_chunks = [(c[0], got) for c in chunks if (got := self._read_chunk(c[0])) is not None]
        need = [corrections.SEQ, *[corrections.ACC + n for n in self._accs]]
        # Rows kept before the fold began: a chunk without its columns, or rows merged into one that
        # has them (their chunk number null).
        unknown = [got.column(key).filter(pc.and_(pc.is_in(got.column(key), value_set=devices),
                                                  pc.is_null(got.column(corrections.SEQ))))
                   if all(n in got.column_names for n in need)
                   else got.column(key).filter(pc.is_in(got.column(key), value_set=devices)) for _, got in got_chunks]
        if unknown and sum(len(u) for u in unknown):
            gone = pc.unique(pa.chunked_array(unknown).combine_chunks())
            if not self._warned_unknown:
                self._warned_unknown = True
                log.warning("corrections: %d device(s) of bucket %d have events kept before their state's aggregates "
                            "were folded again (corrections added to a checkpoint that had run); their state stays as "
                            "first computed until those events leave the horizon", len(gone), bucket)
            devices = devices.filter(pc.invert(pc.is_in(devices, value_set=gone)))
        where: list[tuple[int, pa.Table, np.ndarray]] = []
        for chunk, got in got_chunks:
            if (at := np.flatnonzero(pc.is_in(got.column(key), value_set=devices)
                                     .to_numpy(zero_copy_only=False))).size:
                where.append((chunk, got, at))
        if not where:
            return rows, none, none, pa.array([], self.spec.key_type)
        kept = pa.concat_tables([g.take(pa.array(at)) for _, g, at in where], promote_options="permissive")
        events = kept.column(FLAT + "events")
        applied = np.flatnonzero(events.is_valid().to_numpy(zero_copy_only=False))
        part = kept.column("_partition").to_numpy(zero_copy_only=False)
        offs = kept.column("_offset").to_numpy(zero_copy_only=False)
        ts = kept.column(corrections.TS).to_numpy(zero_copy_only=False)
        seq = kept.column(corrections.SEQ).to_numpy(zero_copy_only=False)
        dev = pd.factorize(kept.column(key).to_pandas())[0]
        # Application order: per device, batch by batch, within one by time, partition and offset.
        order = applied[np.lexsort((offs[applied], part[applied], ts[applied], seq[applied], dev[applied]))]
        if not len(order):  # none applied (all late): no state to fold
            return rows, none, none, pa.array([], self.spec.key_type)
        count = events.to_numpy(zero_copy_only=False)[order].astype(np.int64)
        d = dev[order]
        # A run starts at a device's first kept event, and where its count does not follow on: a fresh
        # state, or an event left behind the horizon (the run starts from what it was applied to).
        start = np.ones(len(order), bool)
        start[1:] = (d[1:] != d[:-1]) | (count[1:] != count[:-1] + 1)
        starts = np.flatnonzero(start)
        ordered = kept.take(pa.array(order))  # as last written: this batch's corrections are in the chunks as read
        seeds = pa.table({n: ordered.column(corrections.ACC + n).take(pa.array(starts)) for n in self._accs})
        folded = engine.refold(spec, ordered.select(sorted(cols)), starts, seeds)

        ident = pd.MultiIndex.from_arrays([part[order], offs[order]])
        once = np.flatnonzero(~ident.duplicated())  # an event kept twice (offsets read again): its first
        fixed = ident[once].get_indexer(pd.MultiIndex.from_arrays([
            rows.column("_partition").to_numpy(zero_copy_only=False), rows.column("_offset").to_numpy(zero_copy_only=False)]))
        fixed = np.where(fixed >= 0, once[np.maximum(fixed, 0)], -1)
        hit = fixed >= 0
        # Per device, its first corrected event (application order): the later ones' state may change.
        first = np.full(int(d.max()) + 1, len(order), np.int64)
        np.minimum.at(first, d[fixed[hit]], fixed[hit])
        later = np.arange(len(order)) > first[d]
        later[fixed[hit]] = False
        differs = np.zeros(len(order), bool)
        for label, values in folded.fields.items():
            differs |= ~_same_values(ordered.column(FLAT + label).combine_chunks(), values)
        revision = ordered.column(REVISION).to_numpy(zero_copy_only=False).astype(np.int32)
        letter = pc.is_valid(ordered.column(ERROR)).to_numpy(zero_copy_only=False).astype(bool)  # a call's: no event
        more = np.flatnonzero(later & differs & ~letter)  # against the state last written of each

        def with_fields(t: pa.Table, at: np.ndarray) -> pa.Table:
            """``t`` with the refolded fields of the events ``at`` (-1: its own kept)."""
            mine = np.flatnonzero(at >= 0)
            for label, values in folded.fields.items():
                t = corrections.put(t, FLAT + label, mine, values.take(pa.array(at[mine])))
            return t

        rows = with_fields(rows, fixed)  # the corrected events' own state (a late one, never applied, has none)
        bumped = revision.copy()
        bumped[more] += 1
        # Per kept event, the first of ``rows`` correcting it: a later event's cause is its device's first's.
        first_row = np.zeros(len(order), np.int64)
        by = np.flatnonzero(hit)[::-1]
        first_row[fixed[by]] = by
        cause = rows.column(CAUSE).combine_chunks() if rows.num_rows else pa.nulls(0, corrections.CAUSE_TYPE)
        cause_rows = first_row[first[d[more]]]

        def as_corrections(t: pa.Table) -> pa.Table:
            t = t.take(pa.array(more)).drop_columns([REVISION])
            t = t.append_column(REVISION, pa.array(bumped[more], pa.int32()))
            return t.append_column(CAUSE, cause.take(pa.array(cause_rows)).cast(corrections.CAUSE_TYPE))

        extra_written = as_corrections(ordered)
        extra = with_fields(extra_written, more)
        hit_rows = np.zeros(len(order), bool)
        hit_rows[fixed[hit]] = True
        written_state = differs & hit_rows
        written_state[more] = True  # the state each correction writes, kept as last written
        self._write_back(where, order, folded.before, bumped, folded.fields, written_state)
        self._store_refolded(bucket, ordered.column(key).take(pa.array(np.append(starts[1:], len(order)) - 1)),
                             count[np.append(starts[1:], len(order)) - 1], folded.final)
        restated = pc.unique(ordered.column(key).filter(pa.array(differs & (later | hit_rows))))
        return rows, extra_written, extra, restated.combine_chunks() if isinstance(restated, pa.ChunkedArray) else restated

    def _write_back(self, where: list[tuple[int, pa.Table, np.ndarray]], order: np.ndarray, before: pa.Table,
                    revision: np.ndarray, fields: dict[str, pa.Array], written_state: np.ndarray) -> None:
        """The refolded devices' kept events (``where``: chunk, its rows, the devices' rows in it;
        ``order``: their application order over those rows) with their new accumulators ``before``
        and revisions, and the refolded ``state`` ``fields`` of the events a correction writes it of
        (``written_state``): each chunk's revisions table written again with the rows whose
        accumulators, revision or state changed (:func:`enrich.state.corrections.revisions`), not its rows."""
        sizes = np.array([len(at) for _, _, at in where])
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        rank = np.full(int(offsets[-1]), -1, np.int64)
        rank[order] = np.arange(len(order))
        for k, (chunk, got, at) in enumerate(where):
            mine = rank[offsets[k]:offsets[k + 1]]
            ok = mine >= 0
            if not ok.any():
                continue
            rows_at, ranks = at[ok], mine[ok]
            differs = np.zeros(len(rows_at), bool)
            t = got
            for n in self._accs:
                name = corrections.ACC + n
                new = before.column(n).combine_chunks().take(pa.array(ranks)).cast(t.schema.field(name).type)
                differs |= ~_same_values(t.column(name).combine_chunks().take(pa.array(rows_at)), new)
                t = corrections.put(t, name, rows_at, new)
            restate = written_state[ranks]
            if restate.any():
                differs |= restate
                for label, values in fields.items():
                    t = corrections.put(t, FLAT + label, rows_at[restate], values.take(pa.array(ranks[restate])))
            rev = t.column(REVISION).to_numpy(zero_copy_only=False).astype(np.int32).copy()
            bumped = revision[ranks] > rev[rows_at]
            if not (differs | bumped).any():
                continue
            rev[rows_at] = np.maximum(rev[rows_at], revision[ranks])
            t = t.set_column(t.schema.get_field_index(REVISION), REVISION, pa.array(rev, pa.int32()))
            t = corrections.mark_refolded(t, rows_at[differs])
            self.written.updateValue((revisions_key(chunk),), (to_ipc(corrections.revisions(t, self._rewritten)),))
            self._chunks[chunk] = t

    def _store_refolded(self, bucket: int, keys: pa.Array, counts: np.ndarray, final: pa.Table) -> None:
        """The devices' stored accumulators replaced by a refold's ``final`` ones (per run: its
        device ``keys`` and its last event's count), where the device's state is the one the run
        ends in (its event count the run's last: no event since, no fresh state)."""
        state = self._load()
        if not state.num_rows:
            return
        last = np.append(pc.not_equal(keys[1:], keys[:-1]).to_numpy(zero_copy_only=False), True) if len(keys) > 1 \
            else np.ones(len(keys), bool)  # a device's last run
        runs = np.flatnonzero(last)
        found = pc.index_in(keys.take(pa.array(runs)), value_set=state.column(engine.KEY)).fill_null(-1)
        at = found.to_numpy(zero_copy_only=False).astype(np.int64)
        stored_n = state.column(engine.EVENTS).to_numpy(zero_copy_only=False)
        same = (at >= 0) & (stored_n[np.maximum(at, 0)] == counts[runs])
        if not same.any():
            return
        rows_at, runs = at[same], runs[same]
        touched = state.take(pa.array(rows_at))
        for n in self._accs:
            i = touched.schema.get_field_index(n)
            touched = touched.set_column(i, n, final.column(n).take(pa.array(runs)).cast(touched.schema.field(i).type))
        rest = np.ones(state.num_rows, bool)
        rest[rows_at] = False
        self._store((bucket,), pa.concat_tables([state.filter(pa.array(rest)), touched]).combine_chunks(),
                    touched.num_rows, None)

    def _stale_calls(self, written: pa.Table, rows: pa.Table) -> None:
        """The stored results of the calls whose template reads a column a correction changed (from
        what the event was written with, or corrected before), for the corrected events' devices,
        taken as not made (:meth:`enrich.calls.step.CallStep.stale`)."""
        assert self.calls is not None
        stored = self._stored_calls()
        if stored is None or not rows.num_rows:
            return
        devices = {}
        for c in self.calls.calls:
            cols = {r.name for r in c.body.refs() if r.scope is None}
            if c.every_event or not cols & set(rows.column_names):
                continue
            changed = _changed(written, rows, cols)
            if changed.any():
                devices[c.name] = rows.column(self.spec.key).filter(pa.array(changed))
        if devices:
            self._store_calls(self.calls.stale(stored, devices))

    def _stale_state_calls(self, devices: pa.Array) -> None:
        """The stored results of the calls whose template reads a ``state`` field a fold changed, for
        the ``devices`` whose state it changed, taken as not made: made again at each one's next
        event, as :meth:`_stale_calls` does for the corrected columns."""
        assert self.calls is not None and self._refold is not None
        stored = self._stored_calls()
        if stored is None:
            return
        fields = {f"{c}_{a}" for c, aggs, _ in self._refold.aggregates for a in aggs}
        stale = {c.name: devices for c in self.calls.calls
                 if not c.every_event and {r.name for r in c.body.refs() if r.scope == "state"} & fields}
        if stale:
            self._store_calls(self.calls.stale(stored, stale))

    def _moves_needed(self, written: pa.Table, rows: pa.Table) -> bool:
        """Whether a correction may move events between a moving rollup's windows: some corrected
        event has another value of a column the rollup reads (or match) than it was written with, or
        was corrected before (the rollup holds its last correction's values, not the written ones)."""
        cols = {c for i in self._moving for c in (*self.rollups[i].by, *(m for m, _, _ in self.rollups[i].metrics))}
        return bool((_changed(written, rows, cols) | (self._counted(written) != self._counted(rows))).any())

    def _counted(self, t: pa.Table) -> np.ndarray:
        """Whether the rollups count each of the rows ``t`` (an inner join of the plan matched it)."""
        ok = np.ones(t.num_rows, bool)
        for matched in (*self.inner, *(d.join.matched for d in self.dims if d.inner)):
            if matched in t.column_names:  # null: kept under an earlier plan without the join
                ok &= pc.fill_null(t.column(matched), True).to_numpy(zero_copy_only=False).astype(bool)
        return ok

    def _look_again(self, rows: pa.Table, versions: list[Version]) -> tuple[pa.Table, np.ndarray]:
        """Correction ``rows`` with the columns of each corrected join before or in the step (and of
        the joins before it on them) joined again: the joins before the step with the batch's pinned
        versions, a partitioned one in the bucket's versions after the batch (as a fresh job would
        join them now); and the rows an inner join before or in the step does not match (a
        correction of them retracts the event)."""
        again = {i for i, d in enumerate(self.dims) if any(c.dim == d.index for c in self.corrected)}
        names = rows.column_names
        if again or self._rerun:
            rows = self._join_again(rows, names, again, versions)
        return rows, ~self._counted(rows)

    def _join_again(self, rows: pa.Table, names: list[str], again: set[int], versions: list[Version]) -> pa.Table:
        """:meth:`_look_again`'s joins; ``_clipped`` found again when every as-of join before the step
        that sets it runs again (else the written flag stays, with the corrected joins' ORed in)."""
        fresh_clip = CLIPPED in names and all(i in self._rerun for i, s in enumerate(self.before) if s.time is not None)
        if fresh_clip:  # found again below from every as-of join that sets it
            rows = rows.set_column(names.index(CLIPPED), CLIPPED, pa.array(np.zeros(rows.num_rows, bool)))
        if self._rerun:
            lookups = PlanEnricher(self.before, None).lookups()  # the batch's pinned versions
            for k in self._rerun:
                spec = self.before[k]
                mine = [n for n in [o for _, o in spec.columns] + [spec.matched] if n in rows.column_names]
                base, overlay = lookups[spec.dataset]
                looked = join_table(rows.drop_columns(mine), spec, base, overlay)
                rows = looked.select([*names, *[n for n in looked.column_names if n not in names]])
        for i, dim in enumerate(self.dims):
            corrected = i in again
            if not corrected and not (fresh_clip and dim.join.time is not None):
                continue
            # Rows kept under an earlier plan may lack a column: looked up, and conformed later.
            mine = [n for n in [out for _, out in dim.join.columns] + [dim.join.matched] if n in names]
            looked = lookup(dim, rows.drop_columns(mine), versions[i], None)
            if corrected:
                rows = looked.select([*names, *[n for n in looked.column_names if n not in names]])
            else:  # its columns stay as written (not corrected): the flag only
                rows = rows.set_column(names.index(CLIPPED), CLIPPED, looked.column(CLIPPED))
        return rows

    def _read_chunk(self, chunk: int) -> pa.Table | None:
        """A kept chunk's rows with their revisions (:func:`enrich.state.corrections.revisions`), read
        once per call."""
        hit = self._chunks.get(chunk)
        if hit is not None:
            return hit
        got = self.written.getValue((chunk,))
        if got is None:
            return None
        revised = self.written.getValue((revisions_key(chunk),))
        table = corrections.with_revisions(from_ipc(bytes(got[0])), from_ipc(bytes(revised[0])) if revised else None)
        self._chunks[chunk] = table
        return table

    def _drop_chunk(self, chunk: int) -> None:
        self._chunks.pop(chunk, None)
        self.written.removeKey((chunk,))
        self.written.removeKey((revisions_key(chunk),))

    def _index(self) -> dict[str, Any]:
        got = self.written_index.get()
        return json.loads(got[0]) if got is not None else {"next": 0, "chunks": []}

    def _store_index(self, next_id: int, chunks: list[list[int]]) -> None:
        if chunks:
            self.written_index.update((json.dumps({"next": next_id, "chunks": chunks}),))
        else:
            self.written_index.clear()

    def _add_chunk(self, kept: pa.Table, chunks: list[list[int]], next_id: int) -> None:
        """``kept`` (written events with their times and revisions) stored as chunk ``next_id``, after
        the index's ``chunks``."""
        times = kept.column(corrections.TS)
        # Compressed: a correcting batch reads every chunk a change can concern through the state
        # server, whose transfer of the bytes is what such a read costs (docs/benchmarks.md). Not a
        # small one: each of its buffers would carry a frame of its own, more than it saves.
        self.written.updateValue((next_id,), (to_ipc(kept, "lz4" if kept.nbytes >= COMPRESS_FROM else None),))
        chunks = [*chunks, [next_id, kept.num_rows, int(pc.min(times).as_py()), int(pc.max(times).as_py())]]
        self._store_index(next_id + 1, chunks)

    def _keep_written(self, out: pa.Table, table: pa.Table, before: pa.Table | None, ok: np.ndarray) -> pa.Table:
        """``out`` (this batch's output rows; ``table`` their input rows) kept for corrections (the
        good ones, with their times, a chunk of their own; the small chunks merged once there are
        :data:`~enrich.state.corrections.MERGE_AT` of them), then with ``_kind``, ``_revision``,
        ``_cause`` and ``_retracted``."""
        # The events the state applied (``ok``), a call's dead letters among them: the fold needs each
        # (they count in the state), the corrections none (no consumer has them as events).
        good = pa.array(ok)
        ts = table.filter(good).column(TS_US).to_numpy(zero_copy_only=False)
        index = self._written_index if self._written_index is not None else self._index()
        chunks, next_id = list(index["chunks"]), index["next"]
        mine = out.filter(good)
        if self._refold is not None and mine.num_rows:  # what a refold of the device's aggregates starts from
            assert before is not None
            mine = mine.append_column(corrections.SEQ, pa.array(np.full(mine.num_rows, next_id, np.int64)))
            for name in self._accs:
                mine = mine.append_column(corrections.ACC + name, before.column(name))
        kept = corrections.keep(None, mine, ts, NO_BOUND_START)
        if kept is not None:
            small = [c for c in chunks if c[1] < corrections.SMALL_ROWS]
            if len(small) + 1 >= corrections.MERGE_AT:
                parts = []
                for c in small:
                    got = self._read_chunk(c[0])
                    if got is not None:
                        parts.append(got)
                    self._drop_chunk(c[0])
                kept = pa.concat_tables([*parts, kept], promote_options="permissive")
                chunks = [c for c in chunks if c[1] >= corrections.SMALL_ROWS]
            self._add_chunk(kept, chunks, next_id)
        return corrections.as_events(out)

    def _with_rollups(self, bucket: int, out: pa.Table, timer_values: TimerValues) -> pd.DataFrame:
        """The step's output for the rollup step (:mod:`enrich.state.rollups`): the events packed as
        without rollups, in the rollup bucket of their bucket, with each rollup's partials and the
        dead letters of events beyond a rollup's horizon."""
        keep = pc.is_null(out.column(ERROR))
        for matched in self.inner:  # an in-plan inner join drops them after the step
            keep = pc.and_(keep, pc.fill_null(out.column(matched), False))
        fed = rollups.feed(self.rollups, out.filter(keep), self._watermark(timer_values), self.rollup_ids, bucket)
        home = bucket  # the events stay with the rollup bucket of the same grouping key
        parts = [(home, packs.EVENTS, v) for v in packed.pack_output(out.drop_columns([TS_US]))[ROWS]]
        parts += fed.parts
        if self.gaps is not None and self._gap_done is not None:  # the rollups that mark their devices' gaps
            parts += rollups.gap_marks(self.rollups, self._gap_done, self.gaps.key, self.rollup_ids, bucket)
        if fed.dead is not None:
            parts.append((home, packs.DEAD, to_ipc(fed.dead)))
        return self._rollup_frame(parts, timer_values)

    @staticmethod
    def _rollup_frame(parts: list[tuple[int, str, bytes]], timer_values: TimerValues) -> pd.DataFrame:
        """(rollup bucket, kind, packed value)s as the rollup step's input rows."""
        # Just after the batch's watermark: Spark refuses an output time at or behind it.
        at = pd.Timestamp(max(timer_values.getCurrentWatermarkInMs(), 0) + 1, unit="ms", tz="UTC")
        return pd.DataFrame({RBUCKET: np.array([p[0] for p in parts], np.int32), ROLLUP_TIME: [at] * len(parts),
                             PACK_KIND: [p[1] for p in parts], ROWS: [p[2] for p in parts]})

    def _wait(self, table: pa.Table | None, watermark_us: int | None) -> pa.Table | None:
        """This batch's events (``table``; None: a tick alone) and the bucket's held ones decided
        (:func:`enrich.state.wait.split`): the held rows stored back, and the rows to go on returned
        (the released ones and the dead letters, which never wait), with ``_late_at_read`` and
        ``_provisional``; None when there are none."""
        assert self.waits is not None
        got = self.held.get()
        held = from_ipc(got[0]) if got is not None else None
        if table is None and held is None:
            return None
        facts = _batch_facts()
        parts, dead, fresh, before = [], None, 0, held.num_rows if held is not None else 0
        if table is not None:
            ok = pc.is_null(table.column(ERROR))
            dead = table.filter(pc.invert(ok))
            good = table.filter(ok)
            fresh = good.num_rows
            ts = good.column(TS_US).to_numpy(zero_copy_only=False)
            late = ts <= watermark_us if watermark_us is not None else np.zeros(fresh, dtype=bool)
            parts.append(wait.admit(good, facts).append_column(LATE_AT_READ, pa.array(late, pa.bool_())))
        if held is not None:
            parts.insert(0, _conform(held, parts[0].schema if parts else None, self.columns))
        split = wait.split(self.waits, facts, pa.concat_tables(parts), TS_US)
        if split.release[:before].any() or not split.release[before:].all():  # else they stay as stored
            if split.held.num_rows:
                self.held.update((to_ipc(split.held),))
            else:
                self.held.clear()
        out = split.released.append_column(PROVISIONAL, pa.array(split.provisional, pa.bool_()))
        if dead is not None and dead.num_rows:
            n = dead.num_rows
            dead = (dead.append_column(wait.READ_MS, pa.nulls(n, pa.int64()))
                    .append_column(LATE_AT_READ, pa.array([False] * n))
                    .append_column(PROVISIONAL, pa.array([False] * n)))
            out = pa.concat_tables([out, dead.cast(out.schema)])
        return out if out.num_rows else None

    def _gaps(self, bucket: int, good: pa.Table | None, watermark: int | None) -> None:
        """The bucket's gaps after this batch's events (``good``: no dead letter; None: a tick),
        stored; its records, its devices without an interval and its partitions' times reported to
        the driver (``gap_records``: small, the driver writes them)."""
        spec = self.gaps
        assert spec is not None
        events = _gap_events(spec, good) if good is not None else None
        got = [v.get() for v in (self.gap_table, self.gap_closed)]
        stored = [from_ipc(g[0]) if g is not None else None for g in got]
        times, now_us = _gap_times()
        done = gap_engine.advance(spec, stored[0], stored[1],
                                  events if events is not None else spec.event_schema().empty_table(),
                                  times, watermark, now_us)
        self._gap_done = done.records
        moved = (events is not None and events.num_rows > 0) or done.records.num_rows > 0
        for var, t, was in ((self.gap_table, done.table, stored[0]), (self.gap_closed, done.closed, stored[1])):
            if not moved and t.num_rows == (was.num_rows if was is not None else 0):
                continue  # a tick that changed nothing (no event, none opened, none dropped): nothing to store
            if t.num_rows:
                var.update((to_ipc(t),))
            elif was is not None:
                var.clear()
        if self.gap_records is not None:
            self.gap_records.add({bucket: {"records": to_ipc(done.records) if done.records.num_rows else b"",
                                           "no_interval": done.no_interval, "times": done.reached}})

    def _dimension(self, i: int, records: pa.Table | None) -> Version:
        """Dimension ``i``'s rows in this bucket, this batch's changelog ``records`` applied (and
        stored): from this worker's cache when its token names the stored version, so an unchanged
        bucket costs one small state read instead of reading and indexing its rows."""
        dim, value, tokens = self.dims[i], self.dim_values[i], self.dim_tokens[i]
        got = tokens.get()  # None when absent: one round trip, not exists() + get()
        token = str(got[0]) if got is not None else None
        version = CACHE.get(token) if token is not None else None
        if version is None:
            stored, schema = dim.empty(), dim.schema
            if (got := value.get()) is not None:
                stored, schema = from_ipc(got[0]), DatasetSchema.from_json(got[1])
                if stored.schema != dim.stored:  # the job was planned against a newer schema's types
                    stored = conform(dim, stored)
            version = Version(dim, stored, schema)
        if records is not None and records.num_rows:
            stored, schema = apply_changes(dim, version.rows, version.schema, records)
            if any(c.dim == dim.index for c in self.corrected):  # its late versions: enrich.state.corrections
                self._dim_changes[dim.index] = (version.rows, stored, records)
            value.update((to_ipc(stored), schema.to_json()))
            token = uuid.uuid4().hex  # a replay makes another: a cache miss, never a wrong hit
            tokens.update((token,))
            version = Version(dim, stored, schema)
        if token is not None:
            CACHE.put(token, version)
        return version

    def handleExpiredTimer(self, key: Any, timerValues: TimerValues,
                           expiredTimerInfo: ExpiredTimerInfo) -> Iterator[pd.DataFrame]:
        state, removed = engine.evict_keys(self.spec, self._load(), self._watermark(timerValues))
        self._store(key, state, 0, removed)
        if self.calls is not None and self.call_value is not None:
            kept = self.calls.keep(self._stored_calls(), state.column(engine.KEY))
            if kept is not None:
                self._store_calls(kept)
        return iter(())

    def handleInitialState(self, key: Any, initialState: pd.DataFrame,  # type: ignore[override]
                           timerValues: TimerValues) -> None:
        """A forked job's first batch (:func:`enrich.query.initial_state`): the bucket's rows
        of the savepoint, ``kind`` :data:`STATE_NAME` (devices, in the stored layout), a partitioned
        dimension's state name (its rows and published schema), a gap table's (:data:`GAPS`,
        :data:`GAPS_CLOSED`) or written events kept for corrections (:data:`WRITTEN`: a chunk of
        its own), each as Arrow IPC bytes; merged into what the bucket holds (PySpark may hand a
        bucket's rows over in several calls)."""
        settle()
        for kind, data, schema in zip(initialState["kind"], initialState["table"], initialState["schema"],
                                      strict=True):
            rows = from_ipc(bytes(data))
            if kind == STATE_NAME:
                rows = rows.cast(self.spec.state_schema())
                state = engine.merge(self.spec, self._load(), rows, pa.array([], self.spec.key_type))
                self._store(key, state, rows.num_rows, None)
                continue
            if kind in (GAPS, GAPS_CLOSED):
                var = self.gap_table if kind == GAPS else self.gap_closed
                got = var.get()
                if got is not None:
                    rows = pa.concat_tables([from_ipc(got[0]), rows.cast(from_ipc(got[0]).schema)])
                var.update((to_ipc(rows),))
                continue
            if kind == WRITTEN:
                if self.corrected and rows.num_rows:
                    index = self._index()
                    after = index["next"]  # the savepoint's chunk numbers order its events: later ones come after
                    if corrections.SEQ in rows.column_names:
                        after = max(after, int(pc.max(rows.column(corrections.SEQ)).as_py() or 0) + 1)
                    self._add_chunk(rows, index["chunks"], after)
                continue
            i = next(n for n, d in enumerate(self.dims) if d.state_name == kind)
            version = self._dimension(i, None)
            merged = pa.concat_tables([version.rows, rows.cast(version.rows.schema)])
            self.dim_values[i].update((to_ipc(merged), schema if schema else version.schema.to_json()))
            self.dim_tokens[i].update((uuid.uuid4().hex,))

    def _watermark(self, timer_values: TimerValues) -> int | None:
        """The batch's watermark in microseconds, never below the floor (None: none yet)."""
        us = watermark_us(timer_values)
        if self.floor_us is None:
            return us
        return self.floor_us if us is None else max(us, self.floor_us)

    def _stored_calls(self) -> pa.Table | None:
        assert self.call_value is not None and self.calls is not None
        got = self.call_value.get()
        return self.calls.conform(from_ipc(got[0])) if got is not None else None

    def _store_calls(self, table: pa.Table) -> None:
        assert self.call_value is not None
        if table.num_rows:
            self.call_value.update((to_ipc(table),))
        else:
            self.call_value.clear()

    def _calls(self, bucket: int, table: pa.Table, state: pa.StructArray, devices: pa.Table,
               removed: pa.Array | None) -> BucketCalls:
        """The bucket's calls for this batch's events (after the state update), their results stored."""
        assert self.calls is not None
        stored = self._stored_calls()
        kept = self.calls.keep(stored, devices.column(engine.KEY))
        if removed is not None and len(removed) and stored is not None:
            # A device whose state expired and came back in this batch starts without results. The
            # mask is made on what keep() left (it drops the devices expired for good), not on stored.
            left = kept if kept is not None else stored
            gone = pc.is_in(left.column(KEY), value_set=removed.cast(left.schema.field(KEY).type))
            kept = left.filter(pc.invert(gone))
        if kept is not None:
            stored = kept
        ts = np.asarray(table.column(TS_US).fill_null(0).to_numpy(), dtype=np.int64)
        done = self.calls.run(bucket, table, self.spec.key, ts, state, stored)
        if done.table is not None:
            self._store_calls(done.table)
        elif kept is not None:
            self._store_calls(kept)
        if self.call_counts is not None:
            self.call_counts.add({bucket: done.tally()})
        return done

    def close(self) -> None:
        pass

    def _load(self) -> pa.Table:
        """The bucket's device table: from this executor's cache when it has the stored version, else
        the stored base with the changes stored since, in order."""
        self._loaded = None
        sizes = self.sizes.get()
        self._sizes = (int(sizes[0]), int(sizes[1])) if sizes is not None else (0, 0)
        if self.cache is not None:
            got = self.token.get()
            if got is not None:
                self._loaded = str(got[0])
                data = self.cache.get(self._loaded)
                if data is not None:
                    return engine.state_from_ipc(data, self.spec)
        stored = self.value.get()  # None when the bucket has no state: one round trip, not exists() + get()
        return bucket_table(self.spec, None if stored is None else stored[0],
                            self.deltas.get() if self._sizes[0] else ())

    def _store(self, key: Any, state: pa.Table, touched: int, removed: pa.Array | None) -> None:
        """Store the new table: as what changed (the last ``touched`` rows, the ``removed`` keys)
        appended to the changes since the base, or, once those would outweigh it, as a new base."""
        if self.devices is not None:
            self.devices.add({int(key[0]): state.num_rows})
        appended, base = self._sizes
        changed = touched + (len(removed) if removed is not None else 0)
        if state.num_rows and base and not changed:
            pass  # nothing to store: the stored table, and its token, stay as they are
        else:
            whole: bytes | None = None  # the table as IPC bytes: made once for the base and the cache
            if not state.num_rows:
                self.value.clear()
                if appended:
                    self.deltas.clear()
                self.sizes.clear()
            elif base and appended + changed <= base:
                rows = state.slice(state.num_rows - touched)
                gone = pa.table({engine.KEY: removed if removed is not None else pa.array([], self.spec.key_type)})
                self.deltas.appendValue((appended + changed, engine.state_to_ipc(rows), to_ipc(gone)))
                self.sizes.update((appended + changed, base))
            else:  # a new base: the first store, or the changes would outweigh the base
                whole = engine.state_to_ipc(state)
                self.value.update((whole,))
                if appended:
                    self.deltas.clear()
                self.sizes.update((0, state.num_rows))
            if self.cache is not None:
                if state.num_rows:
                    token = uuid.uuid4().hex  # a retried attempt makes another: never a wrong hit
                    self.token.update((token,))
                    self.cache.put(token, whole or engine.state_to_ipc(state), previous=self._loaded)
                else:
                    self.token.clear()
                    if self._loaded is not None:
                        self.cache.drop(self._loaded)
        keep_one_timer(self.handle, engine.next_expiry(self.spec, state))

    def _events(self, table: pa.Table) -> pa.Table:
        """The columns the engine reads, in the engine's types."""
        cols = [self.spec.key, self.spec.timestamp, *self.spec.ties, *[c for c, _, _ in self.spec.aggregates]]
        arrays = []
        for c in cols:
            a = table.column(c)
            want = self._types.get(c)
            arrays.append(a.cast(want) if want is not None and a.type != want else a)
        return pa.Table.from_arrays(arrays, names=cols)


def _conform(held: pa.Table, schema: pa.Schema | None, columns: tuple[str, ...]) -> pa.Table:
    """Rows held or kept under an earlier plan (the job restarted with other event fields, or a
    dataset's types changed) as ``schema`` (None: a tick alone, then the event ``columns`` are made
    sure of): a column they lack is null, a type cast, one ``schema`` lacks left out."""
    if schema is None:
        missing = [c for c in columns if c not in held.column_names]
        for c in missing:
            held = held.append_column(c, pa.nulls(held.num_rows))
        return held
    if held.schema == schema:
        return held
    return pa.Table.from_arrays([held.column(f.name).cast(f.type) if f.name in held.column_names
                                 else pa.nulls(held.num_rows, f.type) for f in schema], schema=schema)


def _gap_events(spec: gap_engine.GapSpec, good: pa.Table) -> pa.Table:
    """The gap engine's events of ``good`` (a key and a time each)."""
    keyed = pc.and_(pc.is_valid(good.column(spec.key)), pc.is_valid(good.column(TS_US)))
    t = good.filter(keyed)
    every = (pa.array([spec.every_us] * t.num_rows, pa.int64()) if spec.every_us is not None
             else gap_engine.every_us(t.column(spec.every_column or "")))
    return pa.table({gap_engine.KEY: t.column(spec.key), gap_engine.TS: t.column(TS_US),
                     gap_engine.PARTITION: t.column("_partition"), gap_engine.EVERY: every,
                     **{n: t.column(n) for n, _ in spec.refs}}).cast(spec.event_schema())


def _gap_times() -> tuple[dict[int, int], int | None]:
    """The partitions' times the driver recorded for this batch and the batch's time
    (:data:`enrich.gaps.engine.TIMES_PROPERTY`)."""
    got = _pinned(gap_engine.TIMES_PROPERTY, "partition times", None)
    now = got.get("now_us")
    return {int(p): int(t) for p, t in got["times"].items()}, int(now) if now is not None else None


# The batch's changes, read once per Python worker and batch (every bucket of the batch asks).
_CHANGES: dict[str, list[tuple[corrections.Corrects, pa.Table]]] = {}


def _batch_changes(corrected: tuple[corrections.Corrects, ...]) -> list[tuple[corrections.Corrects, pa.Table]]:
    """This batch's changes of each corrected join (the ones that correct: unchanged left out),
    from the files the driver wrote before the batch (:data:`enrich.joins.PINNED_PROPERTY`'s
    ``corrections``: their directory and the batch)."""
    got = _pinned(PINNED_PROPERTY, "corrections", "corrections")
    ident = f"{got['dir']}/{got['batch']}"
    hit = _CHANGES.get(ident)
    if hit is None:
        hit = [(c, corrections.read_changes(got["dir"], int(got["batch"]), c.spec.dataset)) for c in corrected]
        _CHANGES.clear()
        _CHANGES[ident] = hit
    return hit


def _changed(written: pa.Table, rows: pa.Table, columns: set[str]) -> np.ndarray:
    """Per corrected event (``written``: as kept, ``rows``: corrected), whether ``columns`` hold other
    values now than it was written with, or it was corrected before (what a rollup or a call holds
    of it is then its last correction's, not the written values)."""
    cols = sorted(columns & set(written.column_names))
    again = rows.column(REVISION).to_numpy(zero_copy_only=False) > 1
    return again | (rollup_engine.idents(written, cols) != rollup_engine.idents(rows, cols)) if cols else again


def _same_values(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Per row, whether ``a`` and ``b`` hold the same value (both null; floats within 1e-9 relative,
    as a refolded mean's last bits may differ from one folded batch by batch)."""
    null_a = a.is_null().to_numpy(zero_copy_only=False)
    null_b = b.is_null().to_numpy(zero_copy_only=False)
    same = null_a & null_b
    both = ~null_a & ~null_b
    if pa.types.is_floating(a.type) or pa.types.is_floating(b.type):
        x = pc.cast(a, pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
        y = pc.cast(b, pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
        return same | (both & np.isclose(x, y, rtol=1e-9, atol=0.0))
    eq = pc.equal(a, b.cast(a.type)).fill_null(False).to_numpy(zero_copy_only=False)
    return same | (both & eq)


def _cause_text(cause: dict[str, Any]) -> str:
    """A correction's ``_cause`` as the rollups' rows name it: its JSON, the time in ISO 8601."""
    vf = cause.get("valid_from")
    text = contract.format_time(vf) if vf is not None else None
    return json.dumps({**cause, "valid_from": text}, separators=(",", ":"))


def _batch_facts() -> wait.BatchFacts:
    """This batch's facts (:class:`enrich.state.wait.BatchFacts`), set by the driver with the
    pinned versions (``enrich.joins.PINNED_PROPERTY``)."""
    return wait.BatchFacts.from_json(_pinned(PINNED_PROPERTY, "batch facts", "wait"))


def _pinned(name: str, what: str, entry: str | None) -> dict[str, Any]:
    """The JSON the driver set in the task's local property ``name`` for the batch (its ``entry``);
    an error naming it when there is none: the state step ran outside a batch the job pinned."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    raw = ctx.getLocalProperty(name) if ctx is not None else None
    got = json.loads(raw) if raw is not None else None
    if got is not None and entry is not None:
        got = got.get(entry)
    if got is None:
        raise RuntimeError(f"no {what} in the {name} local property of this task: the state step ran outside a "
                           "batch the job pinned")
    return dict(got)



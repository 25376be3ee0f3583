"""One refresh of one dataset: read, check, diff, publish, and only then commit.

Order of a run (under the dataset's lock):
    load committed state -> check that the topic still holds what the state says was published
    (otherwise the run republishes everything) -> read the source (retried while the database is
    unreachable) -> normalise and check keys -> compute the change set (a re-key when `key:` changed) and
    each row's valid-from time -> refuse it if it deletes too much (a partial source) -> publish (schema
    record first if the columns changed, the run's completeness record last on every partition) in one
    Kafka transaction, wait for every acknowledgement and the commit -> note the topic's end offsets ->
    commit snapshot (with the rows' valid-from times) + state atomically -> record the run's status.
Any failure before the commit leaves the committed state as it was (an unfinished transaction is aborted:
read_committed readers see nothing of it): the next run computes the same changes again (or more) and
republishes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from refresh import incremental as inc
from refresh.config import DatasetConfig, RefreshConfig
from refresh.diff import ChangeSet, check_keys, diff, normalize, upsert_into, within
from refresh.errors import EmptySnapshot, Refused, Stopped, TooManyDeletes, TopicChanged
from refresh.publish import Publisher, transactional_id
from refresh.sources import open_source
from refresh.sources.abc import IncrementalSource, Source
from refresh.stores.abc import (
    CommittedState,
    RunKind,
    RunRecord,
    RunResult,
    SnapshotRows,
    StagedSnapshot,
    StateStore,
    check_columns,
    split_valid_from,
    with_valid_from,
)
from refresh.stores.files import FileStateStore
from refstream.config import format_duration
from refstream.contract import (
    TIME_TYPE,
    DatasetSchema,
    delete_batches,
    format_time,
    heartbeat_message,
    parse_time,
    schema_message,
    upsert_batches,
)
from refstream.errors import TransientError, one_line
from refstream.kafka import end_offsets
from refstream.retry import call_with_retry

__all__ = [
    "PREFETCH_BYTES",
    "Refresher",
    "RunResult",
    "check_deletes",
    "describe_schema_change",
    "topic_lost",
]

log = logging.getLogger(__name__)

#: A published snapshot up to this size (its Arrow size) is read
#: whole while the source is read, which mostly waits on the database; a larger one is read a column
#: and a row group at a time by the diff, so that two whole snapshots never sit in memory.
PREFETCH_BYTES = 512 << 20


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _not_before_claimed(dataset: str, at: datetime, state: CommittedState) -> datetime:
    """``at``, the clock reading a run's changes are valid from, or the completeness the dataset
    already published if the clock reads earlier (a host or database clock stepped back): a change
    valid before a completeness a consumer was promised would be one it has already judged without."""
    if state.complete_as_of is None:
        return at
    claimed = parse_time(state.complete_as_of)
    if at >= claimed:
        return at
    log.warning("dataset %s: the clock reads %s, before the completeness already published (%s): a clock "
                "stepped back; this run's changes are valid from %s", dataset, format_time(at),
                state.complete_as_of, state.complete_as_of)
    return claimed


@dataclass(frozen=True, kw_only=True)
class _Step:
    """What a read computed: the change set and the state to commit once it is published."""

    kind: RunKind
    rows_read: int
    schema: DatasetSchema
    changes: ChangeSet
    snapshot: pa.Table | None      # the new published rows (None: unchanged)
    snapshot_valid_from: pa.Array | None  # per row of ``snapshot``, the time it is valid from
    total: int
    watermark: Any
    watermark_type: str | None
    last_reconcile: str | None
    observed_at: datetime          # when the read began: what it found gone is gone from then
    complete_as_of: datetime       # every change valid at or before it is in the changelog after this run
    rewrite: bool = False          # the committed snapshot has no valid-from times: store them anyway
    staged: StagedSnapshot | None = None   # ``snapshot`` being written ahead of the commit

    def replaces_snapshot(self, state: CommittedState) -> bool:
        """Whether committing this step writes ``snapshot`` over the committed one: a new snapshot
        that differs in rows or columns, the first one, or one that gains its valid-from times."""
        return self.snapshot is not None and bool(
            self.changes or self.rewrite or not self.schema.same_columns(state.schema) or not state.snapshot)


class _Phases:
    """Seconds spent per step of a run (reported in the run's log line and RunResult.phases)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = round(self.phases.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items())


class Refresher:
    """Runs refreshes of the datasets of one config. Thread-safe: runs of different datasets may go
    in parallel; runs of the same dataset (in any thread or process) are serialised by a lock."""

    def __init__(self, config: RefreshConfig, *, store: StateStore | None = None,
                 publisher_factory: Callable[[dict[str, str]], Publisher] = Publisher,
                 progress: bool | None = None, on_run: Callable[[RunRecord], None] | None = None) -> None:
        self.config = config
        self.store = store or FileStateStore(config.state_dir)
        self.publisher_factory = publisher_factory
        self.progress = sys.stderr.isatty() if progress is None else progress
        #: Called with every recorded run (the daemon's metrics).
        self.on_run = on_run

    # --------------------------------------------------------------------------------- public
    def run(self, dataset: str, *, full: bool = False, reconcile: bool = False, wait: bool = True,
            stop: threading.Event | None = None, allow_deletes: bool = False,
            dry_run: bool = False) -> RunResult:
        """Refresh ``dataset`` now. ``full`` republishes every current row; ``reconcile`` (incremental
        mode) reads the whole source to find hard deletes; ``allow_deletes`` lifts, for this run, the
        refusals of a source that reads empty or deletes more than ``max_delete_fraction``. Records the
        outcome in the dataset's status and re-raises the error of a failed (or refused) run after
        recording it. ``wait=False`` raises :class:`DatasetBusy` instead of waiting for a run that
        holds the dataset.

        ``dry_run`` reads and diffs as a run would (the topic check and the delete guard included) and
        returns the counts it would publish (``published``: the messages, schema records included),
        but publishes, commits and records nothing; the committed state and the topic stay as they
        were (only the dataset's lock file may be created)."""
        ds = self.config.dataset(dataset)
        with self.store.lock(ds.name, wait=wait, stop=stop):
            started = _utcnow()
            t0 = time.monotonic()
            try:
                result = self._run_locked(ds, full=full, reconcile=reconcile, stop=stop, t0=t0,
                                          allow_deletes=allow_deletes, dry_run=dry_run)
            except BaseException as exc:
                if dry_run:
                    raise  # a dry run leaves the status as it was
                # A shutdown that cuts a run short commits nothing and is not the dataset's fault:
                # it is recorded as interrupted, without counting as a failure. A refused change set
                # (a guard against partial sources) is recorded as refused.
                stopped, refused = isinstance(exc, Stopped), isinstance(exc, Refused)
                self._record(ds, started, RunResult(
                    dataset=ds.name, ok=False, version=self.store.load(ds.name).version, rows=0, inserts=0,
                    updates=0, deletes=0, published=0, seconds=round(time.monotonic() - t0, 3),
                    error=one_line(exc), kind="full" if full else ds.mode, interrupted=stopped,
                    refused=refused))
                (log.warning if stopped else log.error)(
                    "dataset %s: refresh %s after %.1fs: %s", ds.name,
                    "interrupted" if stopped else "refused" if refused else "failed",
                    time.monotonic() - t0, one_line(exc))
                raise
            if not dry_run:
                self._record(ds, started, result)
            return result

    # ------------------------------------------------------------------------------- internals
    def _retry(self, fn: Callable[[], Any], what: str, stop: threading.Event | None) -> Any:
        return call_with_retry(fn, what=what, policy=self.config.retry, stop=stop)

    def _read(self, ds: DatasetConfig, what: str, read: Callable[[Callable[[int], None] | None], pa.Table],
              prior: DatasetSchema | None, stop: threading.Event | None, source: Source,
              clock: Callable[[], Any] = _utcnow) -> tuple[pa.Table, Any]:
        """The rows ``read`` returns, normalised, and ``clock``'s reading when the attempt that read
        them began (the database's clock for an incremental dataset, else this host's)."""
        def attempt() -> tuple[pa.Table, Any]:
            with ExitStack() as stack:
                stack.enter_context(_interrupted_by(stop, source))
                bar = None
                if self.progress:
                    from tqdm import tqdm

                    bar = stack.enter_context(tqdm(desc=f"{ds.name}: {what}", unit=" rows", leave=False,
                                                   file=sys.stderr))

                def cb(n: int) -> None:
                    # Called per chunk: a stop request ends a long read between chunks.
                    if stop is not None and stop.is_set():
                        raise Stopped(f"dataset {ds.name}: stopped while reading; nothing published")
                    if bar is not None:
                        bar.update(n - bar.n)

                try:
                    started = clock()
                    table = read(cb)
                except Exception as exc:
                    if stop is not None and stop.is_set() and not isinstance(exc, Stopped):
                        # The read failed because the stop request interrupted it (or did anyway).
                        raise Stopped(f"dataset {ds.name}: stopped while reading ({one_line(exc)}); "
                                      f"nothing published") from exc
                    raise
            if stop is not None and stop.is_set():
                raise Stopped(f"dataset {ds.name}: stopped after reading; nothing published")
            check_columns(ds.name, table)
            return normalize(_fill_null_types(table, prior), ds.name), started

        return self._retry(attempt, f"dataset {ds.name}: read {what}", stop)

    def _run_locked(self, ds: DatasetConfig, *, full: bool, reconcile: bool,
                    stop: threading.Event | None, t0: float, allow_deletes: bool = False,
                    dry_run: bool = False) -> RunResult:
        timer = _Phases()
        state = self.store.load(ds.name)
        if not dry_run:
            Publisher.warm_up(self._publish_settings(ds))  # the producer gets ready while the source is read
        snapshot = self.store.open_snapshot(ds.name, state)
        ends, lost = self._check_topic(ds, state, stop)
        full = full or lost is not None
        timer.mark("load")
        source = open_source(ds)
        log.info("dataset %s: refresh from %s (version %d%s)", ds.name, source.describe(),
                 state.version, ", full republish" if full else "")
        # Above any version a run published without committing (a crash after the acknowledgements).
        version = max(state.version, self.store.reserved(ds.name)) + 1

        old_key = self._rekey_from(ds, state)
        # The new snapshot is written in the background while the run goes on (the rest of the diff,
        # the publish) and committed only after the acknowledgements; every way out discards it. Its
        # valid-from column comes once the diff knows which rows changed: the write waits for it.
        staged: list[StagedSnapshot] = []
        valid_from: Future[pa.Array] = Future()

        def stage(rows: pa.Table) -> None:
            if not staged:
                staged.append(self.store.stage_snapshot(ds.name, version, rows, valid_from))

        try:
            step: _Step | None = None
            if ds.mode == "incremental" and not full and not reconcile and snapshot is not None \
                    and old_key is None and not self._reconcile_due(ds, state):
                assert isinstance(source, IncrementalSource)
                step = self._incremental(ds, state, snapshot, source, stop, timer)
            if step is None:
                kind: RunKind = "republish" if lost is not None else "full" if full else \
                    "reconcile" if ds.mode == "incremental" else "diff"
                # Inserted or deleted keys settle that this run commits a new snapshot: staged then,
                # its write is ready to start the moment the comparison of the matched rows has given
                # every row its valid-from time. (A re-key's snapshot is only known after _rekeyed.)
                step = self._full_read(ds, state, snapshot, source, stop, timer, kind=kind,
                                       allow_empty=ds.allow_empty or allow_deletes, rekey_from=old_key,
                                       on_change=stage if old_key is None and not dry_run else None)
            if old_key is not None:
                step = self._rekeyed(ds, snapshot, step, old_key)
            del snapshot  # the old rows are not needed any more: free them before publishing
            if not dry_run and step.replaces_snapshot(state):
                assert step.snapshot is not None and step.snapshot_valid_from is not None
                stage(step.snapshot)
                valid_from.set_result(step.snapshot_valid_from)
                step = dataclasses.replace(step, staged=staged[0])
            return self._publish_and_commit(ds, state, step, version, ends, lost, old_key, timer, t0,
                                            stop=stop, allow_deletes=allow_deletes, full=full, dry_run=dry_run)
        finally:
            for s in staged:
                s.discard()  # a no-op once committed

    def _publish_and_commit(self, ds: DatasetConfig, state: CommittedState, step: _Step, version: int,
                            ends: dict[int, int] | None, lost: str | None, old_key: tuple[str, ...] | None,
                            timer: _Phases, t0: float, *, stop: threading.Event | None, allow_deletes: bool,
                            full: bool, dry_run: bool) -> RunResult:
        if not allow_deletes:
            # A re-key tombstones every old key by design: what it really deletes is the rows gone.
            deletes = max(0, state.rows - step.rows_read) if old_key is not None else step.changes.delete_count
            check_deletes(ds, state, deletes, step.rows_read)

        schema, changes = step.schema, step.changes
        schema_changed = not schema.same_columns(state.schema)
        if schema_changed and state.schema is not None:
            log.warning("dataset %s: schema change: %s", ds.name, describe_schema_change(state.schema, schema))
        with_schema = schema_changed or full
        schema = dataclasses.replace(schema, version=version) if with_schema else (state.schema or schema)

        # What this run read makes the changelog complete as of its time; never back below what an
        # earlier run published (a claim once true stays true).
        complete = step.complete_as_of
        if state.complete_as_of is not None:
            complete = max(complete, parse_time(state.complete_as_of))
        if dry_run:
            return self._dry_result(ds, state, step, version, with_schema, schema_changed, ends, lost,
                                    timer, t0, complete)
        published = 0
        if changes or with_schema:
            self.store.reserve(ds.name, version)
            published = self._publish(ds, schema, changes, version, with_schema=with_schema, stop=stop,
                                      tombstones_as=state.schema if old_key is not None else None,
                                      deleted_at=step.observed_at, complete=complete, checked=ends)
            ends = self._published_ends(ds, stop, ends)
        elif state.version:
            # Nothing changed: the run's completeness goes out all the same, in a heartbeat (readers
            # also see the dataset is current as of this run: its age is the refresher's health, not
            # how often the data changes). The topic's new end is committed below, so the next run's
            # topic check expects it. ``published`` counts changes; the heartbeat is not one.
            self._heartbeat(ds, state.version, complete, stop, checked=ends)
            ends = self._published_ends(ds, stop, ends)
        timer.mark("publish")
        # The transaction committed: commit even if a stop was requested meanwhile (it is quick,
        # and stopping here would only make the next run publish the same changes again).
        stored: pa.Table | StagedSnapshot | None = None
        if step.replaces_snapshot(state):
            assert step.snapshot is not None and step.snapshot_valid_from is not None
            stored = step.staged or with_valid_from(step.snapshot, step.snapshot_valid_from)
        self.store.commit(ds.name, CommittedState(
            version=version, schema=schema, snapshot=state.snapshot, rows=step.total,
            watermark=step.watermark, watermark_type=step.watermark_type,
            last_reconcile=step.last_reconcile, complete_as_of=format_time(complete), topic=ds.topic,
            offsets=ends), stored)
        timer.mark("commit")
        seconds = round(time.monotonic() - t0, 3)
        result = RunResult(dataset=ds.name, ok=True, version=version, rows=step.rows_read,
                           inserts=changes.inserts, updates=changes.updates, deletes=changes.delete_count,
                           published=published, seconds=seconds, kind=step.kind, watermark=step.watermark,
                           schema_changed=schema_changed, phases=timer.phases, reason=lost,
                           complete_as_of=format_time(complete))
        log.info("dataset %s: version %d (%s): read %d rows, %d inserts, %d updates, %d deletes, "
                 "%d messages published in %.2fs (%s)", ds.name, version, step.kind, result.rows,
                 result.inserts, result.updates, result.deletes, published, seconds, timer)
        return result

    def _dry_result(self, ds: DatasetConfig, state: CommittedState, step: _Step, version: int,
                    with_schema: bool, schema_changed: bool, ends: dict[int, int] | None, lost: str | None,
                    timer: _Phases, t0: float, complete: datetime) -> RunResult:
        """What a run would publish, as a :class:`RunResult` (``published``: deletes, upserts and one
        schema record per partition when the schema goes out); nothing is published or committed."""
        changes = step.changes
        partitions = len(ends) if ends else ds.partitions
        would = changes.messages + (partitions if with_schema else 0)
        seconds = round(time.monotonic() - t0, 3)
        log.info("dataset %s: dry run (%s): read %d rows; would publish version %d: %d inserts, %d updates, "
                 "%d deletes, %d messages; nothing published or committed", ds.name, step.kind, step.rows_read,
                 version, changes.inserts, changes.updates, changes.delete_count, would)
        return RunResult(dataset=ds.name, ok=True, version=state.version, rows=step.rows_read,
                         inserts=changes.inserts, updates=changes.updates, deletes=changes.delete_count,
                         published=would, seconds=seconds, kind=step.kind, watermark=state.watermark,
                         schema_changed=schema_changed, phases=timer.phases, reason=lost,
                         complete_as_of=format_time(complete))

    def _incremental(self, ds: DatasetConfig, state: CommittedState, published: SnapshotRows,
                     source: IncrementalSource, stop: threading.Event | None, timer: _Phases) -> _Step | None:
        """Rows from the watermark (minus the lag) on, compared with the published ones; None when the
        columns changed and a full read must decide instead."""
        assert ds.incremental is not None  # only incremental datasets come here
        col = ds.incremental.column
        snapshot, published_from = published.read(), published.valid_from()
        old_wm = inc.from_json(state.watermark, state.watermark_type)
        low = inc.window_start(old_wm, ds.incremental.lag, ds.incremental.numeric_lag)
        rows, db_now = self._read(ds, f"rows with {col} >= {low}", lambda cb: source.read_since(col, low, cb),
                                  state.schema, stop, source, clock=source.now)
        at = _not_before_claimed(ds.name, inc.utc(db_now), state)
        timer.mark("read")
        if rows.num_rows:
            check_keys(ds.name, rows, ds.key)
            if not DatasetSchema.from_arrow(ds.name, ds.key, rows.schema).same_columns(state.schema):
                log.warning("dataset %s: columns changed since the last run; switching to a full read", ds.name)
                return None
            changes = diff(ds.name, within(snapshot, rows, ds.key), rows, ds.key,
                           fresh=inc.valid_from(rows, col, at))
        else:
            changes = ChangeSet(rows, rows.select(list(ds.key)), 0, 0)
        new_snapshot = new_from = None
        if changes or published_from is None:
            # A snapshot written before valid-from times were kept gets the times this mode gives.
            stored = with_valid_from(snapshot, published_from if published_from is not None
                                     else inc.valid_from(snapshot, col, at))
            if changes:
                assert changes.valid_from is not None
                stored = upsert_into(stored, with_valid_from(changes.upserts, changes.valid_from), ds.key)
            new_snapshot, new_from = split_valid_from(stored)
        watermark = inc.to_json(inc.advance(old_wm, rows, col, db_now))
        wm_type = state.watermark_type or (inc.column_type(rows, col) if rows.num_rows else None)
        timer.mark("diff")
        schema = state.schema or DatasetSchema.from_arrow(ds.name, ds.key, rows.schema)
        total = new_snapshot.num_rows if new_snapshot is not None else snapshot.num_rows
        return _Step(kind="incremental", rows_read=rows.num_rows, schema=schema, changes=changes,
                     snapshot=new_snapshot, snapshot_valid_from=_array(new_from), total=total,
                     watermark=watermark, watermark_type=wm_type, last_reconcile=state.last_reconcile,
                     observed_at=at, rewrite=published_from is None,
                     complete_as_of=inc.complete_as_of(at, inc.column_type(rows, col), ds.incremental.lag))

    def _full_read(self, ds: DatasetConfig, state: CommittedState, snapshot: SnapshotRows | None,
                   source: Source,
                   stop: threading.Event | None, timer: _Phases, *, kind: RunKind,
                   allow_empty: bool = False, rekey_from: tuple[str, ...] | None = None,
                   on_change: Callable[[pa.Table], None] | None = None) -> _Step:
        """Every row, diffed with the published snapshot (``kind`` full also republishes every row;
        ``rekey_from``: the rows were published under that key, and every row goes out again); an
        empty read is refused unless ``allow_empty``."""
        cursor = ds.incremental
        clock: Callable[[], Any] = _utcnow
        if cursor is not None and isinstance(source, IncrementalSource):
            clock = source.now
        by_db = clock is not _utcnow
        if isinstance(snapshot, SnapshotRows) and snapshot.prefetch(PREFETCH_BYTES):
            log.debug("dataset %s: reading the published snapshot during the source read", ds.name)
        rows, started = self._read(ds, "snapshot", source.read, state.schema, stop, source, clock=clock)
        # An incremental dataset's times are the database's; a file's, when its settled set was read.
        at = _not_before_claimed(ds.name, inc.utc(started) if by_db else (source.read_started or started), state)
        timer.mark("read")
        if rows.num_rows == 0 and not allow_empty:
            raise EmptySnapshot(
                f"dataset {ds.name}: {source.describe()} read as empty; refusing to delete "
                f"{snapshot.num_rows if snapshot is not None else 0} published row(s) "
                f"(set allow_empty: true if an empty dataset is legitimate, or force this once with "
                f"`refresh run {ds.name} --allow-deletes`)")
        if rows.num_rows == 0 and rows.num_columns == 0 and snapshot is not None:
            # An allowed empty source without columns (a zero-byte file): empty with the columns last
            # published, so it deletes every row instead of failing on missing key columns.
            rows = normalize(snapshot.schema.empty_table(), ds.name)
        check_keys(ds.name, rows, ds.key)
        schema = DatasetSchema.from_arrow(ds.name, ds.key, rows.schema)
        fresh = inc.valid_from(rows, cursor.column, at) if cursor is not None \
            else pa.repeat(pa.scalar(at, TIME_TYPE), rows.num_rows)
        published_from = snapshot.valid_from() if snapshot is not None else None
        match, old = list(ds.key), snapshot
        if rekey_from is not None:
            # Every row goes out under the new key, yet an unchanged one keeps its time: rows are
            # matched on both keys' columns, on which the old rows and the new are each unique.
            match = list(dict.fromkeys([*rekey_from, *ds.key]))
            if snapshot is None or not all(c in snapshot.schema.names and c in rows.column_names for c in match):
                old = None
        changes = diff(ds.name, old, rows, match,
                       republish_all=kind in ("full", "republish") or rekey_from is not None,
                       on_change=None if on_change is None else lambda: on_change(rows),
                       fresh=fresh, old_valid_from=published_from if old is not None else None)
        watermark, wm_type, last_reconcile = state.watermark, state.watermark_type, state.last_reconcile
        complete = at
        if cursor is not None:
            col = cursor.column
            watermark = inc.to_json(inc.advance(inc.from_json(state.watermark, state.watermark_type), rows,
                                                col, started if by_db else None))
            wm_type = inc.column_type(rows, col)
            complete = inc.complete_as_of(at, wm_type, cursor.lag)
            last_reconcile = _utcnow().isoformat()
            nulls = inc.null_cursors(rows, col)
            if nulls:
                every = cursor.reconcile_every
                log.warning("dataset %s: %d row(s) with %s NULL: incremental runs cannot see them, only "
                            "reconciles (%s) do", ds.name, nulls, col,
                            f"every {format_duration(every)}" if every is not None else "off: only on demand")
        timer.mark("diff")
        return _Step(kind=kind, rows_read=rows.num_rows, schema=schema, changes=changes, snapshot=rows,
                     snapshot_valid_from=changes.snapshot_valid_from, total=rows.num_rows,
                     watermark=watermark, watermark_type=wm_type, last_reconcile=last_reconcile,
                     observed_at=at, complete_as_of=complete,
                     rewrite=snapshot is not None and published_from is None)

    # ---------------------------------------------------------------- the topic as part of the state
    def _check_topic(self, ds: DatasetConfig, state: CommittedState,
                     stop: threading.Event | None) -> tuple[dict[int, int] | None, str | None]:
        """The topic's end offsets now (None: topic missing, or nothing published yet) and why it no
        longer holds what the committed state says was published (None: it does). One metadata and
        one ListOffsets request per run."""
        if not state.version:
            return None, None  # never published: the first run publishes everything anyway
        ends = self._end_offsets(ds, stop)
        reason = topic_lost(ds.topic, state, ends)
        if reason is not None:
            log.warning("dataset %s: topic %s: %s; republishing the whole dataset with its schema record",
                        ds.name, ds.topic, reason)
        return ends, reason

    def _published_ends(self, ds: DatasetConfig, stop: threading.Event | None,
                        before: dict[int, int] | None) -> dict[int, int] | None:
        """The topic's end offsets right after a publish, for the next run's check; if the broker
        cannot say now (the publish itself stands), those found ``before`` it, the run's check: a
        topic only grows, so they still tell the next run of a topic deleted, recreated or emptied,
        where None would let it only record what it finds. Ends below ``before`` mean the run
        published to another topic than the one it checked (recreated meanwhile): the run fails
        uncommitted (:class:`TopicChanged`), and the next run republishes."""
        try:
            ends = self._end_offsets(ds, stop)
        except TransientError as exc:
            log.warning("dataset %s: cannot read the end offsets of %s after publishing (%s); recording "
                        "those from before it", ds.name, ds.topic, exc)
            return before
        if before is not None and (ends is None or any(ends.get(p, -1) < e for p, e in before.items())):
            raise TopicChanged(f"dataset {ds.name}: topic {ds.topic} ends at {ends} after this run "
                               f"published to it, below the {before} it checked (recreated meanwhile?); "
                               f"nothing committed, the next run checks it again")
        return ends

    def _end_offsets(self, ds: DatasetConfig, stop: threading.Event | None) -> dict[int, int] | None:
        return self._retry(lambda: end_offsets(self.config.kafka, ds.topic),
                           f"dataset {ds.name}: end offsets of {ds.topic}", stop)

    def _reconcile_due(self, ds: DatasetConfig, state: CommittedState) -> bool:
        every = ds.incremental.reconcile_every if ds.incremental is not None else None
        if every is None:
            return False
        if not state.last_reconcile:
            return True
        return _utcnow() - datetime.fromisoformat(state.last_reconcile) >= every

    # ------------------------------------------------------------------------------- re-keying
    @staticmethod
    def _rekey_from(ds: DatasetConfig, state: CommittedState) -> tuple[str, ...] | None:
        """The key the topic was published with when the configured ``key:`` differs from it."""
        if state.schema is None or tuple(state.schema.key) == tuple(ds.key):
            return None
        return tuple(state.schema.key)

    @staticmethod
    def _rekeyed(ds: DatasetConfig, published: SnapshotRows | None, step: _Step,
                 old_key: tuple[str, ...]) -> _Step:
        """A re-key's change set: a tombstone for every key published under ``old_key`` and every
        current row under the new key (``step`` read them all, each with its valid-from time),
        published in the run's one transaction, so the compacted topic ends with exactly the
        new-keyed rows."""
        old_keys = published.select(list(old_key)) if published is not None else None
        if old_keys is None:
            # No snapshot of what was published (state written without one): nothing to tombstone.
            log.warning("dataset %s: re-key without a snapshot of the published rows: old keys stay on "
                        "the topic", ds.name)
            old_keys = step.changes.upserts.select(list(ds.key)).slice(0, 0)
        log.warning("dataset %s: re-key %s -> %s: %d tombstone(s) for the old keys, %d row(s) under the new key",
                    ds.name, list(old_key), list(ds.key), old_keys.num_rows, step.changes.upserts.num_rows)
        changes = ChangeSet(step.changes.upserts, old_keys, step.changes.upserts.num_rows, 0,
                            step.changes.valid_from, step.changes.snapshot_valid_from)
        return dataclasses.replace(step, changes=changes)

    # ------------------------------------------------------------------------------- publishing
    def _heartbeat(self, ds: DatasetConfig, version: int, complete: datetime,
                   stop: threading.Event | None, checked: dict[int, int] | None) -> int:
        """A run without changes: its completeness record alone, to every partition, in one
        transaction."""
        def attempt() -> int:
            with self.publisher_factory(self._publish_settings(ds)) as pub:
                parts = pub.prepare(ds.topic, ds.partitions, ds.topic_config)
                _same_partitions(ds, checked, parts)
                beat = heartbeat_message(ds.name, version, _utcnow(), complete)
                return pub.publish(ds.topic, [], last_to_every_partition=[beat], partitions=parts, stop=stop)

        return self._retry(attempt, f"dataset {ds.name}: heartbeat to {ds.topic}", stop)

    def _publish_settings(self, ds: DatasetConfig) -> dict[str, str]:
        """Producer settings of ``ds``: a transactional.id stable across restarts, so a new run fences
        a crashed predecessor's producer and aborts its unfinished transaction."""
        return {**self.config.kafka, "transactional.id": transactional_id(self.config.refresher_id, ds.name)}

    def _publish(self, ds: DatasetConfig, schema: DatasetSchema, changes: ChangeSet, version: int, *,
                 with_schema: bool, stop: threading.Event | None, deleted_at: datetime, complete: datetime,
                 checked: dict[int, int] | None, tombstones_as: DatasetSchema | None = None) -> int:
        """The run's transaction: schema records, tombstones (valid from ``deleted_at``), upserts (each
        from its own time), the completeness record last on every partition. Returns the messages
        published, completeness records left out (they change nothing). ``checked``: the topic's
        ends when the run checked it (None: it had none)."""
        # Tombstones carry the key bytes the rows were published with (the old key on a re-key).
        tomb_schema = tombstones_as or schema

        def messages() -> Iterator[Any]:
            yield from delete_batches(tomb_schema, changes.deletes, version, valid_from=deleted_at)
            yield from upsert_batches(schema, changes.upserts, version, valid_from=changes.valid_from)

        def attempt() -> int:
            with self.publisher_factory(self._publish_settings(ds)) as pub:
                parts = pub.prepare(ds.topic, ds.partitions, ds.topic_config)
                _same_partitions(ds, checked, parts)
                beat = heartbeat_message(ds.name, version, _utcnow(), complete)
                sent = pub.publish(ds.topic, messages(),
                                   to_every_partition=[schema_message(schema)] if with_schema else [],
                                   last_to_every_partition=[beat], partitions=parts, stop=stop)
                return sent - len(parts)

        return self._retry(attempt, f"dataset {ds.name}: publish to {ds.topic}", stop)

    def _record(self, ds: DatasetConfig, started: datetime, result: RunResult) -> None:
        run = RunRecord(started=started.isoformat(), finished=_utcnow().isoformat(), result=result)
        try:
            self.store.write_status(ds.name, self.store.read_status(ds.name).after(run))
            self.store.append_run(ds.name, run)
        except OSError as exc:  # the run's outcome stands; only its report is lost
            log.error("dataset %s: cannot write status: %s", ds.name, exc)
        if self.on_run is not None:
            try:
                self.on_run(run)
            except Exception:  # metrics must never fail a run
                log.exception("dataset %s: recording the run's metrics failed", ds.name)


def check_deletes(ds: DatasetConfig, state: CommittedState, deletes: int, rows_read: int) -> None:
    """Refuse a change set deleting more than ``max_delete_fraction`` of the committed rows: a CSV cut
    mid-write, a glob missing a file or a table being reloaded reads short, and publishing the
    difference would tombstone rows that still exist. An empty read of a dataset with ``allow_empty``
    is declared legitimate and deletes everything; ``--allow-deletes`` skips this check for one run."""
    if deletes == 0 or (rows_read == 0 and ds.allow_empty):
        return
    limit = ds.max_delete_fraction
    if deletes > limit * state.rows:
        raise TooManyDeletes(
            f"dataset {ds.name}: would delete {deletes} of {state.rows} rows (limit {limit:g}, "
            f"max_delete_fraction); refused, nothing published: a partial source? If the deletes are "
            f"meant, run `refresh run {ds.name} --allow-deletes`")


def topic_lost(topic: str, state: CommittedState, ends: dict[int, int] | None) -> str | None:
    """Why ``topic`` (with end offsets ``ends``, None when it does not exist) no longer holds what
    ``state`` says was published, or None. A topic only grows: an end offset below the one recorded
    after the last publish means it was deleted and recreated (a new topic starts at offset 0) or
    emptied."""
    if state.topic is not None and state.topic != topic:
        return f"topic changed from {state.topic} to {topic} in the config"
    if ends is None:
        return "topic does not exist (deleted?)"
    for part, recorded in sorted((state.offsets or {}).items()):
        end = ends.get(part)
        if end is None:
            return f"partition {part} is gone (recreated with fewer partitions?)"
        if end < recorded:
            return (f"partition {part} ends at offset {end}, below the {recorded} recorded after version "
                    f"{state.version} (deleted and recreated, or emptied)")
    return None


def describe_schema_change(old: DatasetSchema, new: DatasetSchema) -> str:
    o, n = {c.name: c.type for c in old.columns}, {c.name: c.type for c in new.columns}
    parts = [f"added {k} {n[k]}" for k in n if k not in o]
    parts += [f"dropped {k}" for k in o if k not in n]
    parts += [f"retyped {k} {o[k]} -> {n[k]}" for k in n if k in o and o[k] != n[k]]
    if old.key != new.key:
        parts.append(f"key {list(old.key)} -> {list(new.key)}")
    if not parts and old.names != new.names:
        parts.append("columns reordered")
    return ", ".join(parts) or "no visible change"


@contextlib.contextmanager
def _interrupted_by(stop: threading.Event | None, source: Source) -> Iterator[None]:
    """While the body reads ``source``, a stop request interrupts the read: a query blocked on the
    server (a locked table) never looks at ``stop`` by itself."""
    if stop is None:
        yield
        return
    done, interrupting = threading.Event(), threading.Event()

    def watch() -> None:
        # Again and again until the read ends: a stop may land before the read has its connection.
        while not done.wait(0.2):
            if stop.is_set():
                if not interrupting.is_set():
                    interrupting.set()
                    log.info("dataset %s: stop requested; interrupting the read", source.dataset)
                source.interrupt()

    watcher = threading.Thread(target=watch, name=f"interrupt-{source.dataset}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        if interrupting.is_set():
            # Let the server-side cancel finish before the process may exit (bounded: a stop is due).
            watcher.join(5)


def _same_partitions(ds: DatasetConfig, checked: dict[int, int] | None, parts: list[int]) -> None:
    """Refuse to publish to a topic whose partitions are not those the run checked: it was recreated
    (or repartitioned) since, and this run's changes and completeness were made for the other one."""
    if checked is not None and sorted(checked) != parts:
        raise TopicChanged(f"dataset {ds.name}: topic {ds.topic} has partitions {parts}, not the "
                           f"{sorted(checked)} this run checked (recreated meanwhile?); nothing published, "
                           f"the next run checks it again")


def _array(values: pa.ChunkedArray | pa.Array | None) -> pa.Array | None:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def _fill_null_types(table: pa.Table, prior: DatasetSchema | None) -> pa.Table:
    """Columns a source could not type (all NULL, untyped driver) take the type last published."""
    if prior is None or not any(pa.types.is_null(f.type) for f in table.schema):
        return table
    known = {c.name: c for c in prior.columns}
    for i, f in enumerate(table.schema):
        if pa.types.is_null(f.type) and f.name in known:
            t = prior.arrow_schema().field(f.name).type
            table = table.set_column(i, pa.field(f.name, t), pa.nulls(table.num_rows, t))
    return table


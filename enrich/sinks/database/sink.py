"""The database output on the driver (:class:`DatabaseSink`) and in the tasks (:class:`DatabaseTaskWriter`).

The driver selects the batch's rows as the table's columns (and the dead letters' columns) and runs
:class:`DatabaseTaskWriter` over them in a ``mapInArrow``; each task writes its slot by
:func:`enrich.sinks.database.slots.write_slot` and its dead letters (events that failed to parse, and
rows the database would refuse: :mod:`enrich.sinks.database.refuse`) to their topic itself, in a
Kafka transaction of its slot that commits just after the slot's database transaction (the Kafka
sink's protocol and ledger): the driver gets one row of counts per task, never an event, and the
batch is computed once, never cached. The plan has no shuffle after the state step, so a device's events
all reach the task of its state partition: ``write: state`` keeps, per device, the row of the event
the state step applied last (the greatest ``events`` count), whose ``state`` is the device's state
after the batch. After the tasks, the driver deletes the rows of devices whose state expired
(:meth:`DatabaseSink.expire`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from enrich.checkpoint import CheckpointLayout
from enrich.columns import ERROR, KIND, KIND_CORRECTION, KIND_EVENT, LATE, REVISION, STATE, TAIL
from enrich.config import DatabaseOutput, EnrichConfig
from enrich.events import SOURCE_TYPES
from enrich.failures import transient_cause
from enrich.origin import Origin
from enrich.sinks.abc import Counted, EnrichedBatch
from enrich.sinks.database.connect import classified, connect, quote
from enrich.sinks.database.refuse import refused
from enrich.sinks.database.slots import write_slot
from enrich.sinks.database.tables import TableSpec, check_keys, ensure_tables, table_spec
from enrich.sinks.deadletter import COLUMNS as DEAD_COLUMNS
from enrich.sinks.kafka.ledger import ensure_ledger
from enrich.sinks.kafka.tasks import TaskWriter
from refstream.atomic import write_json_atomic
from refstream.errors import ConfigError, RefstreamError

log = logging.getLogger(__name__)

__all__ = ["DatabaseSink", "DatabaseTaskWriter", "RowPlan", "row_plan"]

#: The topic's incarnation: the broker's id of the events topic when the batch's offsets were taken
#: (Spark's offset log, ``@topic_ids``), the same on a replay; empty where the broker gives none.
TOPIC_ID = "_topic_id"
#: The event's position: the primary key of ``write: events``. With the topic's id, a topic deleted
#: and recreated (offsets from 0 again) gives new rows instead of overwriting the old topic's.
POSITION = ("_topic", TOPIC_ID, "_partition", "_offset")
#: The state field that orders a device's events within a batch (the count after each event).
COUNT = "events"
#: The prefix of the dead-letter columns in the rows the tasks get (``__dead_error`` set: the event
#: failed before the sink; the others are every row's, for a row the database would refuse).
DEAD = "__dead"
#: What a task returns to the driver: one row of counts, never an event.
RESULT_DDL = "slot INT, events BIGINT, late BIGINT, rows BIGINT, skipped BOOLEAN, seconds DOUBLE, dead_letters BIGINT"
RESULT_SCHEMA = pa.schema([("slot", pa.int32()), ("events", pa.int64()), ("late", pa.int64()), ("rows", pa.int64()),
                           ("skipped", pa.bool_()), ("seconds", pa.float64()), ("dead_letters", pa.int64())])


@dataclass(frozen=True)
class RowPlan:
    """How a batch's good events become the table's rows: ``fields`` (the table's columns, in order),
    each taken by ``select`` (name -> Spark expression over the batch) and keyed by ``key``."""

    db: DatabaseOutput
    fields: tuple[StructField, ...]
    key: tuple[str, ...]
    exprs: tuple[tuple[str, str], ...]   # column -> the batch column it comes from (``a.b``: a struct field; ``'x'``: the string x)
    #: write: state with corrections: the columns naming the event a row holds (TableSpec.identity).
    identity: tuple[str, ...] = ()

    def select(self, prefix: str = "") -> list[Column]:
        return [_col(src).alias(prefix + name) for name, src in self.exprs]

    def spec(self) -> TableSpec:
        return table_spec(self.db, self.fields, self.key, self.identity)


def _col(src: str) -> Column:
    if src.startswith("'"):  # a constant
        return F.lit(src[1:-1])
    if "." in src:
        struct, field = src.split(".", 1)
        return F.col(f"`{struct}`").getField(field)
    return F.col(f"`{src}`")


def row_plan(cfg: EnrichConfig, schema: StructType, columns: Sequence[str], event_fields: Sequence[str]) -> RowPlan:
    """The rows of ``write: events`` (every output column, ``state``'s fields as ``state_<field>``,
    then the event's position and ``_kind``) or ``write: state`` (``state.key``, ``state``'s fields - the calls'
    results among them - then the columns the joins added) from the join pass's ``schema`` and
    output ``columns``."""
    db = cfg.output.database
    assert db is not None
    state_type = schema[STATE].dataType if STATE in schema.fieldNames() else None
    state_fields = list(state_type.fields) if isinstance(state_type, StructType) else []
    exprs: list[tuple[str, str]] = []
    fields: list[StructField] = []
    if db.write == "events":
        for c in columns:
            if c == STATE:
                for f in state_fields:
                    exprs.append((f"state_{f.name}", f"{STATE}.{f.name}"))
                    fields.append(StructField(f"state_{f.name}", f.dataType))
            else:
                exprs.append((c, c))
                fields.append(schema[c])
        tail = _position_and_tail(schema, exprs, fields)  # with corrections: a correction replaces its event's row
        if not tail:
            exprs.append((KIND, f"'{KIND_EVENT}'"))
            fields.append(StructField(KIND, StringType(), False))
        return RowPlan(db, tuple(fields), POSITION, tuple(exprs))
    assert cfg.state is not None
    key = cfg.state.key
    exprs.append((key, key))
    fields.append(schema[key])
    for f in state_fields:
        exprs.append((f.name, f"{STATE}.{f.name}"))
        fields.append(StructField(f.name, f.dataType))
    # The calls' results are state fields already (``state.risk_score``); the output repeats them.
    skip = {*event_fields, STATE, LATE, *(c for call in cfg.calls for c in call.columns)}
    for c in columns:
        if c not in skip:
            exprs.append((c, c))
            fields.append(schema[c])
    if not any(c in schema.fieldNames() for c in TAIL):
        return RowPlan(db, tuple(fields), (key,), tuple(exprs))
    # With corrections: the event the row holds, as write: events keys its rows (the topic's id:
    # a recreated topic's offsets start again), then what the row is. A correction of that event
    # replaces the row; one of another event leaves it.
    _position_and_tail(schema, exprs, fields)
    return RowPlan(db, tuple(fields), (key,), tuple(exprs), POSITION)


def _position_and_tail(schema: StructType, exprs: list[tuple[str, str]], fields: list[StructField]) -> list[str]:
    """Append the event's position (:data:`POSITION`) and the tail columns ``schema`` has (with
    corrections) to ``exprs`` and ``fields``; the tail's names."""
    for c in POSITION:
        if c == TOPIC_ID:  # not a column of the batch: the tasks add it (SlotRows.complete)
            fields.append(StructField(c, StringType()))
            continue
        exprs.append((c, c))
        fields.append(StructField(c, schema[c].dataType if c in schema.fieldNames() else SOURCE_TYPES[c]))
    tail = [c for c in TAIL if c in schema.fieldNames()]
    exprs += [(c, c) for c in tail]
    fields += [schema[c] for c in tail]
    return tail


def latest_per_key(table: pa.Table, key: Sequence[str], order: str) -> pa.Table:
    """One row per ``key`` (its columns' values; a null never equals another): the one with the
    greatest ``order``."""
    if table.num_rows <= 1:
        return table
    table = table.take(pc.sort_indices(table, [*((k, "ascending") for k in key), (order, "descending")]))
    new = None
    for k in key:
        col = table.column(k).combine_chunks()
        differs = pc.not_equal(col.slice(1), col.slice(0, len(col) - 1)).fill_null(True)
        new = differs if new is None else pc.or_(new, differs)
    assert new is not None
    return table.filter(pa.concat_arrays([pa.array([True]), new]))


# One connection per Python worker and database: a worker runs many tasks (PySpark reuses it).
_CONNECTIONS: dict[str, Any] = {}


def task_connection(spec: TableSpec) -> Any:
    conn = _CONNECTIONS.get(spec.url)
    if conn is None:
        conn = _CONNECTIONS[spec.url] = connect(spec.url, spec.dialect, spec.timeout)
    return conn


def drop_connection(spec: TableSpec) -> None:
    conn = _CONNECTIONS.pop(spec.url, None)
    if conn is not None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass


@dataclass(frozen=True)
class SlotRows:
    """A task's rows for the table: the good events' columns (:class:`RowPlan`), the state ones cut
    to the latest per device, with the events and late events counted. Built in the task."""

    spec: TableSpec
    state_key: str | None          # write: state: the key column (rows cut to one per device)
    late: bool                     # the rows carry ``_late`` (counted, and left out of write: state)
    topic_ids: tuple[tuple[str, str], ...] = ()   # write: events: the batch's topic -> id (TOPIC_ID)

    def complete(self, rows: pa.Table) -> pa.Table:
        """``rows`` with :data:`TOPIC_ID` when the table has it (from ``_topic``)."""
        if TOPIC_ID not in self.spec.names or TOPIC_ID in rows.column_names:
            return rows
        ids = dict(self.topic_ids)
        topics = rows.column("_topic").to_pylist()
        return rows.append_column(TOPIC_ID, pa.array([ids.get(t or "", "") for t in topics], pa.string()))

    def refusals(self, rows: pa.Table) -> pa.Array:
        """Per row of ``rows`` (holding the table's columns): why the database would refuse it, or null."""
        return refused(self.complete(rows).select(list(self.spec.names)), self.spec.dialect, self.spec.key)

    def table(self, parts: Sequence[pa.RecordBatch | pa.Table]) -> tuple[pa.Table, int, int]:
        """(rows to write, events, late events) of the task's ``parts``."""
        names = list(self.spec.names)
        tables = [self.complete(pa.Table.from_batches([p]) if isinstance(p, pa.RecordBatch) else p) for p in parts]
        if not tables:
            return pa.table({}), 0, 0
        t = pa.concat_tables(tables)
        event = (pc.not_equal(t.column(KIND), KIND_CORRECTION) if REVISION in t.column_names
                 else pa.array([True] * t.num_rows))  # corrections are counted apart (enrich.state.corrections)
        events, late = int(pc.sum(pc.cast(event, pa.int64())).as_py() or 0), 0
        if self.late:
            flag = pc.and_(pc.fill_null(t.column(LATE), False), event)
            late = int(pc.sum(pc.cast(flag, pa.int64())).as_py() or 0)
        if self.state_key is not None:
            t = t.filter(pc.is_valid(t.column(COUNT)))  # late events have no state
            if REVISION in t.column_names:
                # Each correction's latest revision: the one of the event a device's row holds
                # replaces it (TableSpec.identity). Not only the device's highest count: a device
                # that expired and came back counts from 1 again.
                fix = pc.equal(t.column(KIND), KIND_CORRECTION)
                fixes = latest_per_key(t.filter(fix), (self.state_key, *self.spec.identity), REVISION)
                t = pa.concat_tables([latest_per_key(t.filter(pc.invert(fix)), (self.state_key,), COUNT), fixes])
            else:
                t = latest_per_key(t, (self.state_key,), COUNT)
        elif REVISION in t.column_names:  # two corrections of one event in a batch: the later one
            t = latest_per_key(t, self.spec.key, REVISION)
        return t.select(names), events, late


def refused_letters(rows: pa.Table, why: pa.Array, names: Sequence[str]) -> pa.Table:
    """Rows the database would refuse as dead letters (the ``__dead`` columns): ``why`` as the
    error; as the value the original event where the rows still carry it (the state step and the
    parser keep it only for events that failed there), else the row as JSON (NaN and Infinity as
    JSON's extensions), the source headers pointing at the event."""
    rows = rows.set_column(rows.schema.get_field_index(DEAD + ERROR), DEAD + ERROR, why)
    kept = rows.column(DEAD + "_value")
    if kept.null_count == 0:
        return rows
    present = [n for n in names if n in rows.column_names]  # not TOPIC_ID, which the task adds when writing
    as_json = [json.dumps(r, default=str).encode() for r in rows.select(present).to_pylist()]
    value = pc.if_else(pc.is_valid(kept), kept, pa.array(as_json, pa.binary()))
    return rows.set_column(rows.schema.get_field_index(DEAD + "_value"), DEAD + "_value", value)


@dataclass(frozen=True)
class DeadLetterSlots:
    """Where the tasks write their slots' dead letters: ``topic``, each slot in a Kafka transaction
    of its own (``<base_id>-<slot>``, recorded in the topic's ledger ``ledger_topic``), as the Kafka
    sink's tasks do (:mod:`enrich.sinks.kafka.tasks`). Picklable."""

    settings: dict[str, str]
    topic: str
    ledger_topic: str
    base_id: str
    scope: str | None

    def writer(self, batch_id: int) -> TaskWriter:
        return TaskWriter(self.settings, self.topic, self.topic, self.ledger_topic, self.base_id, self.scope, batch_id)


@dataclass(frozen=True)
class DatabaseTaskWriter:
    """The ``mapInArrow`` function writing one task's rows (the table's columns, plus ``_late``
    when ``rows.late``, and the ``__dead`` columns) as its slot of batch ``batch_id`` of query
    ``query_id``, and its dead letters to ``dead_letters``. Picklable."""

    rows: SlotRows
    query_id: str
    batch_id: int
    dead_letters: DeadLetterSlots | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        slot = ctx.partitionId() if ctx is not None else 0
        started = time.monotonic()
        good: list[pa.Table] = []
        dead: list[pa.Table] = []
        for b in batches:
            t = pa.Table.from_batches([b])
            if DEAD + ERROR in t.column_names:
                bad = pc.is_valid(t.column(DEAD + ERROR))
                if pc.any(bad).as_py():
                    dead.append(t.filter(bad))
                    t = t.filter(pc.invert(bad))
                why = self.rows.refusals(t)
                if why.null_count < len(why):  # rows the database would refuse: dead letters, never a failed write
                    dead.append(refused_letters(t.filter(pc.is_valid(why)), why.filter(pc.is_valid(why)),
                                                self.rows.spec.names))
                    t = t.filter(pc.is_null(why))
            good.append(t)
        table, events, late = self.rows.table(good)
        letters = pa.concat_tables(dead) if dead else None
        spec = self.rows.spec
        written: int | None = 0
        try:
            if letters is not None and self.dead_letters is not None:
                written = self._with_dead_letters(slot, table, letters)
            elif table.num_rows:
                written = write_slot(task_connection(spec), spec, self.query_id, slot, self.batch_id, table,
                                     written=lambda: self.written(slot))
        except RefstreamError:
            drop_connection(spec)
            raise
        n_dead = letters.num_rows if letters is not None else 0
        log.info("batch %d slot %d: %s rows to %s, %d dead letter(s) in %.2fs", self.batch_id, slot,
                 "no" if written is None else written, spec.table, n_dead, time.monotonic() - started)
        yield pa.RecordBatch.from_pylist([{"slot": slot, "events": events, "late": late, "rows": written or 0,
                                           "skipped": written is None, "seconds": time.monotonic() - started,
                                           "dead_letters": 0 if written is None else n_dead}],
                                         schema=RESULT_SCHEMA)

    def _with_dead_letters(self, slot: int, table: pa.Table, letters: pa.Table) -> int | None:
        """The slot's rows and its dead letters: the database transaction commits inside the Kafka
        transaction's commit step (as with ``output.kafka``), so a slot whose ledger says committed
        has both, and one whose database side committed alone writes only the dead letters again."""
        from enrich.sinks.kafka.tasks import _SlotTransaction

        assert self.dead_letters is not None
        spec = self.rows.spec
        tx = _SlotTransaction(self.dead_letters.writer(self.batch_id), slot)
        try:
            if tx.committed is not None and tx.committed >= self.batch_id:
                log.info("batch %d slot %d: dead letters committed before; skipped", self.batch_id, slot)
                return None
            cols = {c: letters.column(DEAD + c) for c in DEAD_COLUMNS}
            records = pa.table({"key": cols["_key"], "value": pa.nulls(letters.num_rows, pa.binary()), **cols})
            for b in records.to_batches():
                tx.write(b)
            done: dict[str, int | None] = {"rows": 0}

            def committing() -> None:
                if table.num_rows:
                    done["rows"] = write_slot(task_connection(spec), spec, self.query_id, slot, self.batch_id,
                                              table, written=lambda: self.written(slot))

            tx.commit(committing)
            return done["rows"]
        finally:
            tx.close()

    def written(self, slot: int) -> None:
        """Called after the slot's rows went in, before its transaction commits; nothing here. (The
        tests' kill hook overrides it: tests/enrich/kill.py.)"""


class DatabaseSink:
    """``output.database`` alone: the tasks write the table and the dead letters (to their topic,
    in transactions of ids ``<transactional_id>-<slot>``)."""

    writes_dead_letters = True
    reparses = False
    pending: tuple[int, ...] = ()
    counts: tuple[str, ...] = ("enriched", "late", "dead_letters")   # in the tasks

    def __init__(self, cfg: EnrichConfig, event_fields: Sequence[str], scope: str,
                 transactional_id: str | None = None) -> None:
        assert cfg.output.database is not None
        self.cfg, self.db, self.event_fields, self.scope = cfg, cfg.output.database, tuple(event_fields), scope
        self.layout = CheckpointLayout(cfg.checkpoint)
        check_table_record(self.layout, self.db, cfg.source)
        self.dead_letters = None if transactional_id is None else DeadLetterSlots(
            dict(cfg.kafka), cfg.dead_letter_topic, ensure_ledger(dict(cfg.kafka), cfg.dead_letter_topic),
            transactional_id, scope)
        self.counted = Counted()
        self._plans: dict[tuple[str, ...], RowPlan] = {}
        self.last_results: list[dict[str, Any]] = []
        state = cfg.state is not None and self.db.write == "state"
        corrected = state and any(j.corrections is not None for j in cfg.joins)
        check_existing(self.db, (cfg.state.key,) if cfg.state is not None and state else POSITION,
                       POSITION if corrected else ())

    def plan(self, batch: EnrichedBatch) -> RowPlan:
        """The rows of ``batch``'s columns; the table created (or completed) the first time they are seen."""
        got = self._plans.get(batch.columns)
        if got is None:
            got = row_plan(self.cfg, StructType(batch.df.schema.fields), batch.columns, self.event_fields)
            ensure(got.spec())
            self._plans[batch.columns] = got
        return got

    def slot_rows(self, plan: RowPlan, batch: EnrichedBatch, batch_id: int) -> SlotRows:
        spec = plan.spec()
        ids = tuple(sorted(batch_topic_ids(self.layout, batch_id).items())) if TOPIC_ID in spec.names else ()
        return SlotRows(spec, plan.key[0] if self.db.write == "state" else None, LATE in batch.df.columns, ids)

    def good_rows(self, plan: RowPlan, batch: EnrichedBatch, prefix: str = "") -> list[Column]:
        """The columns the tasks get for the table (``prefix``\\ed), with ``_late`` when the batch has it."""
        cols = plan.select(prefix)
        if LATE in batch.df.columns and not any(n == LATE for n, _ in plan.exprs):
            cols.append(F.col(LATE).alias(prefix + LATE))
        return cols

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        t0 = time.monotonic()
        plan = self.plan(batch)
        writer = DatabaseTaskWriter(self.slot_rows(plan, batch, batch_id), self.scope, batch_id, self.dead_letters)
        # Every row's source columns: a row the database would refuse becomes a dead letter in the task.
        frame = batch.df.select(*self.good_rows(plan, batch), *[F.col(c).alias(DEAD + c) for c in DEAD_COLUMNS])
        rows = run_tasks(frame, writer)
        self.last_results = rows
        self.counted = Counted(enriched=sum(int(r["events"]) for r in rows), late=sum(int(r["late"]) for r in rows),
                               dead_letters=sum(int(r["dead_letters"]) for r in rows))
        log.info("batch %d: %d rows to %s by %d task(s) (%d skipped as committed), %d dead letter(s) in %.2fs",
                 batch_id, sum(int(r["rows"]) for r in rows), self.db.table, len(rows),
                 sum(1 for r in rows if r["skipped"]), self.counted.dead_letters, time.monotonic() - t0)
        self.finish(batch_id, fenced=any(r["rows"] for r in rows))
        return pa.table({c: pa.array([], pa.null()) for c in DEAD_COLUMNS})

    def finish(self, batch_id: int, fenced: bool = True) -> None:
        """After the batch's tasks: :meth:`expire`, then the fence rows no replay needs are deleted
        (:func:`prune_fence`) when the batch wrote its own (``fenced``)."""
        self.expire(batch_id)
        if fenced:
            deleted = prune_fence(self.db, self.scope, batch_id)
            if deleted:
                log.info("batch %d: %d fence row(s) of earlier batches deleted from %s", batch_id, deleted,
                         self.db.fence)

    def expire(self, batch_id: int) -> None:
        """``write: state``: delete the rows of the devices whose state the batch dropped (TTL).

        The state step drops a device once the batch's watermark reaches its ``last_seen + ttl``,
        every bucket it is due in (a bucket's timer fires in the batch whose watermark passes its
        next expiry), and a device that sends an event after that starts afresh with a later
        ``last_seen``. So after batch n the state holds exactly the devices with ``last_seen + ttl``
        past batch n's watermark, and the rows to delete are those with ``last_seen`` at or before
        ``watermark - ttl``. Idempotent: a replay deletes the same rows, and no later row matches."""
        if self.db.write != "state":
            return
        assert self.cfg.state is not None
        ms = self.layout.batch_watermark_ms(batch_id)
        origin = Origin.read(self.layout)  # a fork's watermark floor: the state step drops devices by it too
        if origin is not None and origin.floor_us is not None:
            ms = max(ms or 0, origin.floor_us // 1000)
        if not ms:
            return
        cutoff = datetime.fromtimestamp(0, UTC) + timedelta(milliseconds=ms) - self.cfg.state.ttl
        deleted = delete_expired(self.db, cutoff)
        if deleted:
            log.info("batch %d: %d expired device(s) deleted from %s", batch_id, deleted, self.db.table)

    def close(self) -> None:
        pass


def ensure(spec: TableSpec) -> None:
    """Create the tables if missing (on the driver, before the tasks). A statement that ran out of
    ``statement_timeout`` (a lock another session holds, a busy server) is transient, as it is in the
    write: the batch's write is tried again, not the query failed."""
    conn = connect(spec.url, spec.dialect, spec.timeout)
    try:
        with classified(f"creating {spec.table}"):
            ensure_tables(conn, spec)
    finally:
        conn.close()


def batch_topic_ids(layout: CheckpointLayout, batch_id: int) -> dict[str, str]:
    """The broker's ids of the source's topics as Spark's offset log records them for ``batch_id``
    (the source's ``@topic_ids``: the same on a replay); empty where none is recorded."""
    from enrich.source.offsets import topic_ids_of

    entry = layout.offset_entry(batch_id)
    ids: dict[str, str] = {}
    for offsets in entry.sources if entry is not None else ():
        ids.update(topic_ids_of(offsets))
    return ids


def check_table_record(layout: CheckpointLayout, db: DatabaseOutput, source: str) -> None:
    """The table (and ``write``) the checkpoint writes, recorded at its first start in
    ``refstream/database.json``; a :class:`ConfigError` naming both tables when a checkpoint that
    has run is pointed at another: its fence rows, which say which slots of a replayed batch are
    written, are in the other table's fence table, and the new table would miss every row before."""
    path = layout.own / "database.json"
    wanted = {"table": db.table, "write": db.write}
    if path.exists():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            table, write = str(kept["table"]), str(kept["write"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a database output record ({exc}); restore it from a backup of the "
                              "checkpoint, or point checkpoint: at a new directory") from None
        if (table, write) != (db.table, db.write) and layout.planned_any():
            what = (f"output.database.table: {db.table!r} differs from {table!r}" if table != db.table
                    else f"output.database.write: {db.write!r} differs from {write!r}")
            raise ConfigError(f"{source}: {what}, which the checkpoint {layout.root} writes (table {table}, "
                              f"write: {write}): a pending batch's fence rows are in {table}_commits and the new "
                              f"table would lack every row before; put it back, or point checkpoint: at a new "
                              f"directory to start over")
    if not path.exists() or not layout.planned_any():
        write_json_atomic(path, wanted)


def prune_fence(db: DatabaseOutput, query_id: str, batch_id: int) -> int:
    """Delete the query's fence rows of the batches before ``batch_id``; how many. Spark plans a
    batch only once the one before is in its commit log, so only the batch being written can be
    replayed: its rows are the ones a replay looks for, and the table keeps at most two batches' rows
    per query (the ones before a crash and the replayed batch's). Other queries' rows (another
    checkpoint writing the same table) are theirs to prune."""
    return _delete(db, f"DELETE FROM {quote(db.dialect, db.fence)} WHERE query_id = %s AND batch_id < %s",
                   (query_id, batch_id), f"pruning {db.fence}")


def check_existing(db: DatabaseOutput, key: Sequence[str], identity: Sequence[str] = ()) -> None:
    """At the job's start: refuse tables that exist with a key column that merges keys, or an
    ``identity`` column that merges events (:func:`enrich.sinks.database.tables.check_keys`), before
    any batch runs."""
    with _cursor(db, f"checking the tables of {db.table}") as cur:
        check_keys(cur, db.dialect, db.table, db.fence, key, identity)


def delete_expired(db: DatabaseOutput, cutoff: datetime) -> int:
    value: Any = cutoff if db.dialect == "postgresql" else cutoff.replace(tzinfo=None)
    return _delete(db, f"DELETE FROM {quote(db.dialect, db.table)} WHERE {quote(db.dialect, 'last_seen')} <= %s",
                   (value,), f"deleting expired devices from {db.table}")


def _delete(db: DatabaseOutput, sql: str, params: tuple[Any, ...], what: str) -> int:
    """Run one DELETE on a connection of its own and commit it; the rows it deleted."""
    with _cursor(db, what) as cur:
        cur.execute(sql, params)
        return int(cur.rowcount)


@contextmanager
def _cursor(db: DatabaseOutput, what: str) -> Iterator[Any]:
    """A cursor on a connection of its own, committed when the block ends and closed either way;
    the drivers' errors are classified by :func:`transient` (``what`` names the work in the message)."""
    conn = connect(db.url, db.dialect, db.statement_timeout.total_seconds())
    try:
        with classified(what):
            with conn.cursor() as cur:
                yield cur
            conn.commit()
    finally:
        conn.close()


def run_tasks(frame: DataFrame, writer: Any) -> list[dict[str, Any]]:
    """Run ``writer`` over ``frame`` in a ``mapInArrow``; its tasks' result rows. A task that failed
    transiently fails the batch's write as a :class:`TransientError` (the job retries it; slots that
    committed skip it by their fence rows)."""
    try:
        return [r.asDict() for r in frame.mapInArrow(writer, RESULT_DDL).collect()]
    except Exception as exc:
        transient = transient_cause(exc)
        if transient is not None:
            raise transient from exc
        raise

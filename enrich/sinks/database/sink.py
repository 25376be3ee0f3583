"""The database output on the driver (:class:`DatabaseSink`) and in the tasks (:class:`DatabaseTaskWriter`).

The driver selects the batch's rows as the table's columns (and the dead letters' columns) and runs
:class:`DatabaseTaskWriter` over them in a ``mapInArrow``; each task writes its slot by
:func:`enrich.sinks.database.slots.write_slot` and returns one row of counts and its dead letters,
which the driver writes to their topic: the batch is computed once, never cached. The plan has no shuffle after the state step, so a device's events
all reach the task of its state partition: ``write: state`` keeps, per device, the row of the event
the state step applied last (the greatest ``events`` count), whose ``state`` is the device's state
after the batch. After the tasks, the driver deletes the rows of devices whose state expired
(:meth:`DatabaseSink.expire`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType

from enrich.checkpoint import CheckpointLayout
from enrich.columns import ERROR, LATE, STATE
from enrich.config import DatabaseOutput, EnrichConfig
from enrich.events import SOURCE_TYPES
from enrich.sinks.abc import Counted, EnrichedBatch
from enrich.sinks.database.connect import connect, quote, transient
from enrich.sinks.database.slots import write_slot
from enrich.sinks.database.tables import TableSpec, check_keys, ensure_tables, table_spec
from enrich.sinks.deadletter import COLUMNS as DEAD_COLUMNS
from refstream.errors import RefstreamError, TransientError

log = logging.getLogger(__name__)

__all__ = ["DatabaseSink", "DatabaseTaskWriter", "RowPlan", "row_plan"]

#: The event's position: the primary key of ``write: events``.
POSITION = ("_topic", "_partition", "_offset")
#: The state field that orders a device's events within a batch (the count after each event).
COUNT = "events"
#: The prefix of the dead-letter columns in the rows the tasks get and return.
DEAD = "__dead"
#: What a task returns to the driver: one row of counts, then its dead letters (``__dead_error``
#: set), so that the batch is computed once, by the tasks, and never cached.
RESULT_DDL = ("slot INT, events BIGINT, late BIGINT, rows BIGINT, skipped BOOLEAN, seconds DOUBLE, "
              f"{DEAD}_error STRING, {DEAD}_key BINARY, {DEAD}_value BINARY, {DEAD}_topic STRING, "
              f"{DEAD}_partition INT, {DEAD}_offset BIGINT")
RESULT_SCHEMA = pa.schema([("slot", pa.int32()), ("events", pa.int64()), ("late", pa.int64()), ("rows", pa.int64()),
                           ("skipped", pa.bool_()), ("seconds", pa.float64()),
                           (f"{DEAD}_error", pa.string()), (f"{DEAD}_key", pa.binary()),
                           (f"{DEAD}_value", pa.binary()), (f"{DEAD}_topic", pa.string()),
                           (f"{DEAD}_partition", pa.int32()), (f"{DEAD}_offset", pa.int64())])
_TRANSIENT = "refstream.errors.TransientError: "
DEAD_SCHEMA = pa.schema([(c, RESULT_SCHEMA.field(DEAD + c).type) for c in DEAD_COLUMNS])


@dataclass(frozen=True)
class RowPlan:
    """How a batch's good events become the table's rows: ``fields`` (the table's columns, in order),
    each taken by ``select`` (name -> Spark expression over the batch) and keyed by ``key``."""

    db: DatabaseOutput
    fields: tuple[StructField, ...]
    key: tuple[str, ...]
    exprs: tuple[tuple[str, str], ...]   # column -> the batch column it comes from (``a.b``: a struct field)

    def select(self, prefix: str = "") -> list[Column]:
        return [_col(src).alias(prefix + name) for name, src in self.exprs]

    def spec(self) -> TableSpec:
        return table_spec(self.db, self.fields, self.key)


def _col(src: str) -> Column:
    if "." in src:
        struct, field = src.split(".", 1)
        return F.col(f"`{struct}`").getField(field)
    return F.col(f"`{src}`")


def row_plan(cfg: EnrichConfig, schema: StructType, columns: Sequence[str], event_fields: Sequence[str]) -> RowPlan:
    """The rows of ``write: events`` (every output column, ``state``'s fields as ``state_<field>``,
    then the event's position) or ``write: state`` (``state.key``, ``state``'s fields - the calls'
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
        for c in POSITION:
            exprs.append((c, c))
            fields.append(StructField(c, schema[c].dataType if c in schema.fieldNames() else SOURCE_TYPES[c]))
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
    return RowPlan(db, tuple(fields), (key,), tuple(exprs))


def latest_per_key(table: pa.Table, key: str, order: str) -> pa.Table:
    """One row per ``key``: the one with the greatest ``order``."""
    if table.num_rows <= 1:
        return table
    table = table.take(pc.sort_indices(table, [(key, "ascending"), (order, "descending")]))
    keys = table.column(key).combine_chunks()
    first = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1))
    return table.filter(pa.concat_arrays([pa.array([True]), first.fill_null(True)]))


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

    def table(self, parts: Sequence[pa.RecordBatch | pa.Table]) -> tuple[pa.Table, int, int]:
        """(rows to write, events, late events) of the task's ``parts``."""
        names = list(self.spec.names)
        tables = [pa.Table.from_batches([p]) if isinstance(p, pa.RecordBatch) else p for p in parts]
        if not tables:
            return pa.table({}), 0, 0
        t = pa.concat_tables(tables)
        events, late = t.num_rows, 0
        if self.late:
            flag = pc.fill_null(t.column(LATE), False)
            late = int(pc.sum(pc.cast(flag, pa.int64())).as_py() or 0)
        if self.state_key is not None:
            t = t.filter(pc.is_valid(t.column(COUNT)))  # late events have no state
            t = latest_per_key(t, self.state_key, COUNT)
        return t.select(names), events, late


@dataclass(frozen=True)
class DatabaseTaskWriter:
    """The ``mapInArrow`` function writing one task's rows (the table's columns, plus ``_late``
    when ``rows.late``) as its slot of batch ``batch_id`` of query ``query_id``. Picklable."""

    rows: SlotRows
    query_id: str
    batch_id: int

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
            good.append(t)
        table, events, late = self.rows.table(good)
        written: int | None = 0
        if table.num_rows:
            spec = self.rows.spec
            try:
                written = write_slot(task_connection(spec), spec, self.query_id, slot, self.batch_id, table,
                                     written=lambda: self.written(slot))
            except RefstreamError:
                drop_connection(spec)
                raise
        log.info("batch %d slot %d: %s rows to %s in %.2fs", self.batch_id, slot,
                 "no" if written is None else written, self.rows.spec.table, time.monotonic() - started)
        yield pa.RecordBatch.from_pylist([{"slot": slot, "events": events, "late": late, "rows": written or 0,
                                           "skipped": written is None, "seconds": time.monotonic() - started}],
                                         schema=RESULT_SCHEMA)
        for t in dead:
            cols = [t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(t.num_rows, f.type)
                    for f in RESULT_SCHEMA]
            yield from pa.Table.from_arrays(cols, schema=RESULT_SCHEMA).to_batches()

    def written(self, slot: int) -> None:
        """Called after the slot's rows went in, before its transaction commits; nothing here. (The
        tests' kill hook overrides it: tests/enrich/kill.py.)"""


class DatabaseSink:
    """``output.database`` alone: the tasks write the table; the driver the dead letters (to their topic)."""

    writes_dead_letters = False
    reparses = False
    pending: tuple[int, ...] = ()
    counts: tuple[str, ...] = ("enriched", "late")   # in the tasks

    def __init__(self, cfg: EnrichConfig, event_fields: Sequence[str], scope: str) -> None:
        assert cfg.output.database is not None
        self.cfg, self.db, self.event_fields, self.scope = cfg, cfg.output.database, tuple(event_fields), scope
        self.layout = CheckpointLayout(cfg.checkpoint)
        self.counted = Counted()
        self._plans: dict[tuple[str, ...], RowPlan] = {}
        self.last_results: list[dict[str, Any]] = []
        check_existing(self.db, (cfg.state.key,) if cfg.state is not None and self.db.write == "state" else POSITION)

    def plan(self, batch: EnrichedBatch) -> RowPlan:
        """The rows of ``batch``'s columns; the table created (or completed) the first time they are seen."""
        got = self._plans.get(batch.columns)
        if got is None:
            got = row_plan(self.cfg, StructType(batch.df.schema.fields), batch.columns, self.event_fields)
            ensure(got.spec())
            self._plans[batch.columns] = got
        return got

    def slot_rows(self, plan: RowPlan, batch: EnrichedBatch) -> SlotRows:
        return SlotRows(plan.spec(), plan.key[0] if self.db.write == "state" else None,
                        LATE in batch.df.columns)

    def good_rows(self, plan: RowPlan, batch: EnrichedBatch, prefix: str = "") -> list[Column]:
        """The columns the tasks get for the table (``prefix``\\ed), with ``_late`` when the batch has it."""
        cols = plan.select(prefix)
        if LATE in batch.df.columns and not any(n == LATE for n, _ in plan.exprs):
            cols.append(F.col(LATE).alias(prefix + LATE))
        return cols

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        t0 = time.monotonic()
        plan = self.plan(batch)
        writer = DatabaseTaskWriter(self.slot_rows(plan, batch), self.scope, batch_id)
        failed = F.col(ERROR).isNotNull()
        frame = batch.df.select(*self.good_rows(plan, batch),
                                *[(F.col(c) if c == ERROR else F.when(failed, F.col(c))).alias(DEAD + c)
                                  for c in DEAD_COLUMNS])
        out = run_tasks(frame, writer)
        rows = [r for r in out if r[DEAD + ERROR] is None]
        dead = pa.Table.from_pylist([{c: r[DEAD + c] for c in DEAD_COLUMNS} for r in out if r[DEAD + ERROR] is not None],
                                    schema=DEAD_SCHEMA)
        self.last_results = rows
        self.counted = Counted(enriched=sum(int(r["events"]) for r in rows), late=sum(int(r["late"]) for r in rows))
        log.info("batch %d: %d rows to %s by %d task(s) (%d skipped as committed) in %.2fs", batch_id,
                 sum(int(r["rows"]) for r in rows), self.db.table, len(rows), sum(1 for r in rows if r["skipped"]),
                 time.monotonic() - t0)
        self.expire(batch_id)
        return dead

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
        if not ms:
            return
        cutoff = datetime.fromtimestamp(0, UTC) + timedelta(milliseconds=ms) - self.cfg.state.ttl
        deleted = delete_expired(self.db, cutoff)
        if deleted:
            log.info("batch %d: %d expired device(s) deleted from %s", batch_id, deleted, self.db.table)

    def close(self) -> None:
        pass


def ensure(spec: TableSpec) -> None:
    """Create the tables if missing (on the driver, before the tasks)."""
    conn = connect(spec.url, spec.dialect, spec.timeout)
    try:
        ensure_tables(conn, spec)
    finally:
        conn.close()


def check_existing(db: DatabaseOutput, key: Sequence[str]) -> None:
    """At the job's start: refuse tables that exist with a key column that merges keys
    (:func:`enrich.sinks.database.tables.check_keys`), before any batch runs."""
    conn = connect(db.url, db.dialect, db.statement_timeout.total_seconds())
    try:
        with conn.cursor() as cur:
            check_keys(cur, db.dialect, db.table, db.fence, key)
        conn.commit()
    finally:
        conn.close()


def delete_expired(db: DatabaseOutput, cutoff: datetime) -> int:
    conn = connect(db.url, db.dialect, db.statement_timeout.total_seconds())
    try:
        with conn.cursor() as cur:
            value: Any = cutoff if db.dialect == "postgresql" else cutoff.replace(tzinfo=None)
            cur.execute(f"DELETE FROM {quote(db.dialect, db.table)} WHERE {quote(db.dialect, 'last_seen')} <= %s",
                        (value,))
            n = int(cur.rowcount)
        conn.commit()
        return n
    except RefstreamError:
        raise
    except Exception as exc:  # noqa: BLE001 - the drivers' errors, classified by transient()
        raise transient(exc, f"deleting expired devices from {db.table}") from exc
    finally:
        conn.close()


def run_tasks(frame: DataFrame, writer: Any) -> list[dict[str, Any]]:
    """Run ``writer`` over ``frame`` in a ``mapInArrow``; its tasks' result rows. A task that failed
    transiently fails the batch's write as a :class:`TransientError` (the job retries it; slots that
    committed skip it by their fence rows)."""
    try:
        return [r.asDict() for r in frame.mapInArrow(writer, RESULT_DDL).collect()]
    except Exception as exc:
        text = str(exc)
        if _TRANSIENT in text:
            raise TransientError(text[text.rindex(_TRANSIENT) + len(_TRANSIENT):].splitlines()[0]) from exc
        raise

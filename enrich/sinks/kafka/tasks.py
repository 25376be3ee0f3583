"""The task side of the Kafka output: :class:`TaskWriter`, the ``mapInArrow`` function that writes
one task's rows in one Kafka transaction, by the protocol :mod:`enrich.sinks.kafka` describes."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import KafkaException, Producer

from enrich.columns import CORRECTION, ERROR, LATE, SLOW, UNMATCHED
from enrich.sinks.deadletter import COLUMNS as DEAD_COLUMNS
from enrich.sinks.deadletter import to_records, too_large_error
from enrich.sinks.kafka.ledger import Ledger
from enrich.sinks.kafka.writer import (
    abort,
    classify,
    commit,
    identity,
    produce_all,
    read_identities,
    record_limit,
    settled_ends,
    written_ends,
)
from enrich.worker import settle
from refstream.errors import TerminalError
from refstream.kafka import TRANSACTION_TIMEOUT_MS, producer

log = logging.getLogger(__name__)

# A row's optional flags (enrich.sinks.kafka.sink.records_frame), UNMATCHED and LATE: an event some join
# found no row for, and an event later than the watermark; a task counts those of the events it writes.
#: What a task returns to the driver: one row of counts, never an event. ``unmatched``, ``late`` and
#: ``corrections`` count among ``records`` (the enriched events written, and corrections of them).
RESULT_DDL = ("slot INT, transactional_id STRING, records BIGINT, dead_letters BIGINT, unmatched BIGINT, "
              "late BIGINT, corrections BIGINT, skipped BOOLEAN, redo BOOLEAN, leaked BIGINT, worker STRING, seconds DOUBLE, "
              "setup DOUBLE, first_rows DOUBLE, commit DOUBLE")
#: ``seconds``: the task's whole time in the writer; ``setup``: its slot's setup (ends probed, producer
#: fenced in, ledger read), ``first_rows``: when its first rows came from upstream, ``commit``: the
#: transaction's flush and commit; each from the task's start, and overlapping (setup runs while
#: upstream makes the first rows).


class Companion(Protocol):
    """Another output a task writes with its slot's Kafka transaction, committed just before it."""

    def take(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Keep this output's part of ``batch``; the Kafka part (the other columns) back."""

    def committing(self) -> None:
        """Commit this output's part; called just before the Kafka transaction commits."""

    def close(self) -> None: ...


def slot_id(base: str, slot: int) -> str:
    """The transactional id of ``slot``'s tasks."""
    return f"{base}-{slot}"


@dataclass(frozen=True)
class TaskWriter:
    """The ``mapInArrow`` function that writes a task's rows (``key``, ``value`` - null for a dead
    letter - and ``enrich.sinks.deadletter.COLUMNS``) to Kafka exactly once; yields one row of
    :data:`RESULT_DDL`. Picklable: built on the driver per batch."""

    settings: dict[str, str]
    topic: str
    dead_letter_topic: str
    ledger_topic: str
    base_id: str
    scope: str | None
    batch_id: int
    timeout: float = 60.0
    #: What makes the rows above from the task's input, in this worker (``enrich.sinks.kafka.values.Fused``:
    #: the join pass and the records); None: the input is the rows.
    upstream: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        raw = batches  # what is left of it is drained unread by a slot that writes nothing
        if self.upstream is not None:
            batches = self.upstream(batches)
        ctx = TaskContext.get()
        slot = ctx.partitionId() if ctx is not None else 0
        settle()
        started = time.monotonic()
        # The slot's setup (ends probed, producer fenced in, ledger read: a few broker round
        # trips, about a third of a second against the test broker) runs while the task's first rows
        # are still being made upstream: a task after the state step waits for its buckets.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="slot-setup") as pool:
            setup = pool.submit(_SlotTransaction, self, slot)
            first = next(batches, None)
            first_at = time.monotonic() - started
            tx = setup.result()
        times = {"setup": tx.ready - started, "first_rows": first_at}
        if first is None:  # nothing to write: no transaction, no ledger entry (a replay has nothing either)
            tx.close()
            yield self._result(slot, started, times)
            return
        companion = self.companion(slot)
        try:
            if tx.committed is not None and tx.committed >= self.batch_id:
                for _ in raw:  # the input is consumed all the same (not made into records)
                    pass
                log.info("batch %d slot %d: committed before (last %d); skipped", self.batch_id, slot,
                         tx.committed)
                yield self._result(slot, started, times, skipped=True)
                return
            for b in chain([first], batches):
                if SLOW in b.schema.names and pc.any(b.column(SLOW)).as_py():
                    # An event the fast parser left to from_json: this slot is written by the
                    # from_json pass instead (the job runs it for the slots that ask).
                    tx.abort()
                    for _ in raw:
                        pass
                    yield self._result(slot, started, times, redo=True)
                    return
                tx.write(companion.take(b) if companion is not None else b)
                self.sent(slot, tx.producer)
            t_commit = time.monotonic()
            tx.commit(companion.committing if companion is not None else None)
            times["commit"] = time.monotonic() - t_commit
        finally:
            tx.close()
            if companion is not None:
                companion.close()
        log.info("batch %d slot %d (%s): %d records, %d dead letters in %.2fs", self.batch_id, slot, tx.tid,
                 tx.records, tx.dead, time.monotonic() - started)
        yield self._result(slot, started, times, records=tx.records, dead=tx.dead, leaked=tx.leaked_total,
                           unmatched=tx.flagged[UNMATCHED], late=tx.flagged[LATE], corrections=tx.flagged[CORRECTION])

    def companion(self, slot: int) -> Companion | None:
        """Another output written with the slot's transaction (None here: the database output's
        writer, :mod:`enrich.sinks.database.kafka`, gives one)."""
        return None

    def sent(self, slot: int, producer: Producer) -> None:
        """Called after each chunk of the task's records went to ``producer`` inside the slot's open
        transaction; nothing here. (The tests' kill hook overrides it: tests/enrich/kill.py.)"""

    def _result(self, slot: int, started: float, times: Mapping[str, float], *, records: int = 0, dead: int = 0,
                skipped: bool = False, redo: bool = False, leaked: int = 0, unmatched: int = 0,
                late: int = 0, corrections: int = 0) -> pa.RecordBatch:
        return pa.RecordBatch.from_pylist([{
            "slot": slot, "transactional_id": slot_id(self.base_id, slot), "records": records,
            "dead_letters": dead, "unmatched": unmatched, "late": late, "corrections": corrections,
            "skipped": skipped, "redo": redo,
            "leaked": leaked, "worker": worker_name(), "seconds": time.monotonic() - started,
            "setup": times.get("setup", 0.0), "first_rows": times.get("first_rows", 0.0),
            "commit": times.get("commit", 0.0)}], schema=RESULT_SCHEMA)


RESULT_SCHEMA = pa.schema([("slot", pa.int32()), ("transactional_id", pa.string()), ("records", pa.int64()),
                          ("dead_letters", pa.int64()), ("unmatched", pa.int64()), ("late", pa.int64()),
                          ("corrections", pa.int64()), ("skipped", pa.bool_()), ("redo", pa.bool_()), ("leaked", pa.int64()),
                          ("worker", pa.string()), ("seconds", pa.float64()), ("setup", pa.float64()),
                          ("first_rows", pa.float64()), ("commit", pa.float64())])


def worker_name() -> str:
    """Where this Python worker runs: host, process id and working directory (an executor's own
    directory on a cluster)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.getcwd()}"


class _SlotTransaction:
    """One task's transaction (see the module docstring)."""

    def __init__(self, w: TaskWriter, slot: int) -> None:
        self.w, self.slot = w, slot
        self.tid = slot_id(w.base_id, slot)
        self.limit = record_limit(w.settings)
        self.records = self.dead = self.leaked_total = 0
        self.flagged = {UNMATCHED: 0, LATE: 0, CORRECTION: 0}  # of the records written
        topics = list(dict.fromkeys([w.topic, w.dead_letter_topic]))  # one topic: the database output's dead letters
        # Nothing this attempt writes lies before these ends. The written ends, not the read_committed
        # ones: their probe can wait while another task's transaction is open on the same partitions
        # (seconds per task when the state step's tasks outnumber the cores, docs/benchmarks.md).
        self.before = written_ends(w.settings, topics, kept=True)
        self.open, self.began = False, time.monotonic()
        self.producer = producer(w.settings, role="transactional",
                                 **{"transactional.id": self.tid, "client.id": f"{self.tid}@{worker_name()}"})
        self.ledger = Ledger(w.settings, w.ledger_topic, self.tid, w.scope, timeout=w.timeout)
        try:
            self.producer.init_transactions(w.timeout)
            entry = self.ledger.read(self.before)
        except KafkaException as exc:
            raise classify(exc, f"batch {w.batch_id} slot {slot}: init_transactions", self.tid, w.topic) from None
        self.committed = entry.committed
        log.debug("batch %d slot %d: ledger %s", w.batch_id, slot, entry)
        self.leaked: Counter[tuple] = Counter()
        if entry.unfinished == w.batch_id and entry.ends:
            # This attempt begins where the first unfinished one did: an attempt in between (a task
            # Spark sent back, then a crash) would otherwise record later ends, and the next attempt
            # would miss the records of the first, which a broker showing aborted transactions shows.
            self.before = {tp: min(end, entry.ends.get(tp, end)) for tp, end in self.before.items()}
        if entry.unfinished == w.batch_id:
            # The previous attempt at this batch began and its commit is not seen: on Apache Kafka it
            # was aborted and none of its records show. Once every older transaction has ended (the
            # ledger module's doc), the records a consumer sees past the ends that attempt recorded
            # count as written: a broker that shows aborted records shows them there.
            self.leaked = read_identities(w.settings, entry.ends, settled_ends(w.settings, topics, w.timeout),
                                          w.timeout)
            log.warning("batch %d slot %d: the previous attempt began and its commit is not seen; %d of its "
                        "records are in the log already and will not be written again", w.batch_id, slot,
                        sum(self.leaked.values()))
        self.ready = time.monotonic()

    def begin(self) -> None:
        w = self.w
        try:
            self.ledger.begin(w.batch_id, self.before)
            self.producer.begin_transaction()
            self.open, self.began = True, time.monotonic()
        except KafkaException as exc:
            raise self._failed(exc) from None

    def abort(self) -> None:
        if self.open:
            self.producer.flush(self.w.timeout)
            abort(self.producer, self.w.timeout, self.w.topic)
            self.open = False

    def write(self, batch: pa.RecordBatch) -> None:
        if not self.open:
            self.begin()
        table = too_large_to_dead_letters(pa.Table.from_batches([batch]), self.limit)
        failed = pc.is_valid(table.column(ERROR))
        good = table.filter(pc.invert(failed))
        bad = table.filter(failed)
        values = good.column("value").to_pylist()
        keys = good.column("key").to_pylist()
        dead = to_records(bad.select(list(DEAD_COLUMNS)), self.limit) if bad.num_rows else None
        try:
            if self.leaked:
                keep = self._unleaked(values, keys)
                values, keys = [values[i] for i in keep], [keys[i] for i in keep]
                good = good.take(pa.array(keep, pa.int64()))
            flags = {f: good.column(f) for f in self.flagged if f in good.schema.names}
            produce_all(self.producer, self.w.topic, values, keys, None)
            if dead is not None:
                dv, dk, dh = (dead.column("value").to_pylist(), dead.column("key").to_pylist(),
                              [[(e["key"], e["value"]) for e in h] for h in dead.column("headers").to_pylist()])
                if self.leaked:
                    dv, dk, dh = self._unleaked_dead(dv, dk, dh)
                produce_all(self.producer, self.w.dead_letter_topic, dv, dk, dh)
                self.dead += len(dv)
        except KafkaException as exc:
            raise self._failed(exc) from None
        self.records += len(values)
        for f, col in flags.items():
            self.flagged[f] += int(pc.sum(pc.cast(col.fill_null(False), pa.int64())).as_py() or 0)

    def commit(self, committing: Callable[[], None] | None = None) -> None:
        """Commit the transaction; ``committing`` runs just before, once every record and the
        ledger's entry are in it (a failure there aborts the transaction)."""
        w = self.w
        if not self.open:
            self.begin()
        try:
            self.producer.flush(w.timeout)  # data before the ledger (see TransactionalBatchWriter.write)
            self.ledger.commit_in(self.producer, w.batch_id)
            if committing is not None:
                try:
                    committing()
                except Exception:
                    self.abort()
                    raise
            commit(self.producer, w.timeout, w.topic)
            self.open = False
        except KafkaException as exc:
            raise self._failed(exc) from None

    def close(self) -> None:
        self.producer.flush(min(self.w.timeout, 10.0))
        self.ledger.close()

    def _failed(self, exc: KafkaException) -> Exception:
        err = classify(exc, f"batch {self.w.batch_id} slot {self.slot}", self.tid, self.w.topic,
                       open_for=time.monotonic() - self.began if self.open else None,
                       timeout_ms=int(self.w.settings.get("transaction.timeout.ms", TRANSACTION_TIMEOUT_MS)))
        if not isinstance(err, TerminalError):
            abort(self.producer, self.w.timeout, self.w.topic)
        return err

    def _unleaked(self, values: list, keys: list) -> list[int]:
        """Positions of the records not visible already from an aborted attempt."""
        return [i for i, (v, k) in enumerate(zip(values, keys, strict=True)) if not self._take(identity(k, v, None))]

    def _unleaked_dead(self, values: list, keys: list, headers: list) -> tuple[list, list, list]:
        keep = [i for i, (v, k, h) in enumerate(zip(values, keys, headers, strict=True))
                if not self._take(identity(k, v, h))]
        return [values[i] for i in keep], [keys[i] for i in keep], [headers[i] for i in keep]

    def _take(self, ident: tuple) -> bool:
        if self.leaked[ident] > 0:
            self.leaked[ident] -= 1
            self.leaked_total += 1
            return True
        return False


def too_large_to_dead_letters(table: pa.Table, limit: int) -> pa.Table:
    """Enriched events too large for the producer become dead letters (reason ``too_large``, the
    enriched value as the dead letter's value, cut to fit there): one such event must not fail the
    batch again on every restart."""
    size = pc.add(pc.fill_null(pc.binary_length(table.column("value")), 0),
                  pc.fill_null(pc.binary_length(table.column("key")), 0))
    over = pc.and_(pc.is_null(table.column(ERROR)), pc.greater(size, limit))
    if not pc.any(over).as_py():
        return table
    sizes = size.to_pylist()
    at = np.flatnonzero(over.to_numpy(zero_copy_only=False))
    errors = table.column(ERROR).to_pylist()
    values = table.column("_value").to_pylist()
    keys = table.column("_key").to_pylist()
    enriched, src = table.column("value").to_pylist(), table.column("key").to_pylist()
    for i in at:
        errors[i] = too_large_error("enriched event", sizes[i], limit)
        values[i], keys[i] = enriched[i], src[i]
        log.warning("event at %s/%s offset %s: %s; sent to the dead-letter topic", table.column("_topic")[i],
                    table.column("_partition")[i], table.column("_offset")[i], errors[i])
    for name, col in ((ERROR, errors), ("_value", values), ("_key", keys)):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, pa.array(col, table.schema.field(name).type))
    return table


def summary(rows: Sequence[Mapping[str, object]]) -> tuple[int, int, int]:
    """(records, dead letters, slots skipped as committed) over the tasks' result rows."""
    return (sum(int(str(r["records"])) for r in rows), sum(int(str(r["dead_letters"])) for r in rows),
            sum(1 for r in rows if r["skipped"]))

"""The kill hook of the restart tests: a Kafka sink task that, inside its transaction, after sending
its first records and before its commit, kills its own Python worker - or the whole job. A database
sink task (``output.database`` alone) does the same after writing its rows, before its commit.

Run the job through it: ``python -m tests.enrich.kill [job:]BATCH[+]:SLOT|*:FLAG run --config F ...``
(or ``rollup:BATCH:FLAG``: the driver kills the job once the first rollup's rows of the batch are
written, :func:`kill_after_rollup_rows`; ``gaps:KIND:FLAG``: once a batch's gap records with one of
``KIND`` are written, :func:`kill_after_gaps`; ``corrections:FLAG``: once a batch's changes with a
corrected version are recorded, before its tasks run, :func:`kill_after_corrections`).
It replaces the sink's task writer with :class:`KillingTaskWriter` and runs ``enrich``'s CLI; the
writer travels to the workers pickled (its class by reference: the workers import this module, so
``tests`` must be on their ``PYTHONPATH``). The first task of ``SLOT`` (``*``: any) writing records in
batch ``BATCH`` (``+``: or a later one) fires, once: ``FLAG`` is created first.

- Without ``job:`` it kills its worker (Spark runs the task again).
- With ``race:`` the other slots of the batch begin only once the picked task has begun, and the
  picked task, having sent its first records, waits until another slot has begun too, then kills
  its worker: the other slot's records land after where the picked attempt's start, and commit
  while it is dead (Spark runs it again, ``local[N,F]``).
- With ``retry:`` the picked task kills its worker; the task Spark runs again for that slot sends
  its records and kills every process of the job (as ``job:`` does): two unfinished attempts at the
  batch before the restart.
- With ``job:`` the picked task waits until another slot of the same batch has committed it (that
  slot's ledger says so), then begins its transaction, sends its first records and SIGKILLs every
  process of the job: a crash that leaves the batch committed in one slot and open in another. The
  job must have been started in a session of its own (``start_new_session``): PySpark's daemons put
  themselves and their workers in process groups of their own, so the job's processes are those of
  the driver's session. It appends what it found to ``FLAG`` as a JSON line (:func:`read_note`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from confluent_kafka import Producer

from enrich.sinks.database.connect import connect
from enrich.sinks.database.sink import DatabaseTaskWriter
from enrich.sinks.kafka.ledger import Entry, Ledger
from enrich.sinks.kafka.tasks import TaskWriter, slot_id
from tests.timing import bound

MODULE = "tests.enrich.kill"
JOB = "job:"
RACE = "race:"
RETRY = "retry:"
#: The other slots a ``job:`` kill looks at: the tests' batches have fewer.
SLOTS = 8
#: How long a ``job:`` kill waits for another slot's commit before it kills the job all the same
#: (its note then says ``other: null``, for the test to fail on).
WAIT_S = 120.0


@dataclass(frozen=True)
class KillPoint:
    """Which task fires (see the module doc); ``from_spec`` reads ``[job:]BATCH[+]:SLOT|*:FLAG``."""

    batch_id: int
    slot: int | None
    flag: str
    later: bool = False
    job: bool = False   # kill the whole job once another slot of the batch has committed
    race: bool = False  # kill the worker once another slot, begun after it, is writing
    retry: bool = False  # kill the worker, then the job from the task Spark runs again

    @classmethod
    def from_spec(cls, value: str) -> KillPoint:
        job, race, retry = value.startswith(JOB), value.startswith(RACE), value.startswith(RETRY)
        batch, slot, flag = value.removeprefix(JOB).removeprefix(RACE).removeprefix(RETRY).split(":", 2)
        return cls(int(batch.rstrip("+")), None if slot == "*" else int(slot), flag, batch.endswith("+"), job,
                   race, retry)

    def picked(self) -> tuple[int, int] | None:
        """(batch, slot) of the task picked (``race:``), once it is."""
        try:
            fields = Path(self.flag).read_text().split()
        except OSError:
            return None
        return (int(fields[1]), int(fields[2])) if len(fields) >= 3 else None

    def picks(self, batch_id: int, slot: int) -> bool:
        """Whether the task of ``slot`` in ``batch_id`` is the one (the first time only)."""
        if batch_id < self.batch_id or (batch_id != self.batch_id and not self.later):
            return False
        if self.slot is not None and slot != self.slot:
            return False
        try:  # once, also when tasks of two slots get here together
            fd = os.open(self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, f"{os.getpid()} {batch_id} {slot}\n".encode())
        os.close(fd)
        return True


# The tasks a ``job:`` or ``race:`` kill picked in this worker: (batch, slot) -> the other slot found
# committed (``job:``; None for ``race:``).
_HELD: dict[tuple[int, int], int | None] = {}


@dataclass(frozen=True)
class KillingTaskWriter(TaskWriter):
    kill: KillPoint | None = None

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        if self.kill is not None and (self.kill.job or self.kill.race):
            batches = self._gated(batches)
        return super().__call__(batches)

    def _gated(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The task's input, its first rows held back: with ``job:``, the picked task's until another
        slot has committed the batch; with ``race:``, the other slots' until the picked task has
        begun it (its ledger shows the batch begun). Held before the task's transaction begins (its
        producer and ledger are set up meanwhile), not after: the test broker hides a transaction's
        commit, ledger offsets included, while an older transaction is open on a partition it
        wrote - every output partition here."""
        from pyspark import TaskContext

        first = next(batches, None)
        if first is None:
            return
        ctx = TaskContext.get()
        slot = ctx.partitionId() if ctx is not None else 0
        assert self.kill is not None
        if self.kill.picks(self.batch_id, slot):
            _HELD[(self.batch_id, slot)] = self._another_slot_committed(slot) if self.kill.job else None
        elif self.kill.race:
            picked = self.kill.picked()
            if picked is not None and picked[0] == self.batch_id and picked[1] != slot:
                self._wait_begun(picked[1])
        yield first
        yield from batches

    def _wait_begun(self, *slots: int) -> int | None:
        """The first of ``slots`` whose ledger shows this batch begun (None: none did in time)."""
        return self._first_ledger(slots, lambda entry: entry.begun, poll=0.05)

    def _first_ledger(self, slots: Iterable[int], reached: Callable[[Entry], int | None],
                      poll: float = 0.1) -> int | None:
        """The first of ``slots`` whose ledger's ``reached(entry)`` is this batch or later, polled
        for up to :data:`WAIT_S` (None: none was)."""
        ledgers = {s: Ledger(self.settings, self.ledger_topic, slot_id(self.base_id, s), self.scope, timeout=bound(10))
                   for s in slots}
        try:
            deadline = time.monotonic() + bound(WAIT_S)
            while time.monotonic() < deadline:
                for s, ledger in ledgers.items():
                    batch = reached(ledger.read())
                    if batch is not None and batch >= self.batch_id:
                        return s
                time.sleep(poll)
            return None
        finally:
            for ledger in ledgers.values():
                ledger.close()

    def sent(self, slot: int, producer: Producer) -> None:
        if self.kill is None:
            return
        if self.kill.retry:
            if self.kill.picks(self.batch_id, slot):  # the first attempt: Spark runs the task again
                producer.flush(30)
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.kill.picked() == (self.batch_id, slot):
                try:  # the attempt after it, once: the whole job
                    os.close(os.open(f"{self.kill.flag}.again", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return
                producer.flush(30)
                kill_session()
            return
        if self.kill.race:
            if _HELD.pop((self.batch_id, slot), 0) is None:  # the picked task, once
                producer.flush(30)
                self._wait_begun(*[s for s in range(SLOTS) if s != slot])
                os.kill(os.getpid(), signal.SIGKILL)
            return
        if self.kill.job:
            if (self.batch_id, slot) not in _HELD:
                return
            producer.flush(30)  # the records reach the broker, the commit never does
            note = {"batch": self.batch_id, "slot": slot, "other": _HELD[(self.batch_id, slot)],
                    "base_id": self.base_id, "scope": self.scope, "ledger_topic": self.ledger_topic,
                    "session": os.getsid(0)}
            with open(self.kill.flag, "a", encoding="utf-8") as f:
                f.write(json.dumps(note) + "\n")
            kill_session()
        elif self.kill.picks(self.batch_id, slot):
            producer.flush(30)
            os.kill(os.getpid(), signal.SIGKILL)

    def _another_slot_committed(self, slot: int) -> int | None:
        """The first other slot whose ledger shows this batch committed (None: none did in time)."""
        return self._first_ledger((s for s in range(SLOTS) if s != slot), lambda entry: entry.committed)


@dataclass(frozen=True)
class KillingDatabaseWriter(DatabaseTaskWriter):
    """The database sink's task writer (``output.database`` alone) with the same kill points: the
    picked task has written its rows, its transaction is open, then it kills (with ``job:``, once
    another slot of the batch has its fence row committed)."""

    kill: KillPoint | None = None

    def written(self, slot: int) -> None:
        if self.kill is None or not self.kill.picks(self.batch_id, slot):
            return
        if not self.kill.job:
            os.kill(os.getpid(), signal.SIGKILL)
        note = {"batch": self.batch_id, "slot": slot, "other": self._another_slot_committed(slot),
                "scope": self.query_id, "session": os.getsid(0)}
        with open(self.kill.flag, "a", encoding="utf-8") as f:
            f.write(json.dumps(note) + "\n")
        kill_session()

    def _another_slot_committed(self, slot: int) -> int | None:
        """The first other slot with a fence row of this batch, polled for up to :data:`WAIT_S`."""
        spec = self.rows.spec
        conn = connect(spec.url, spec.dialect)
        try:
            deadline = time.monotonic() + bound(WAIT_S)
            while time.monotonic() < deadline:
                with conn.cursor() as cur:
                    cur.execute(f"SELECT slot FROM {spec.fence} WHERE query_id = %s AND batch_id = %s AND slot <> %s",
                                (self.query_id, self.batch_id, slot))
                    found = cur.fetchone()
                conn.commit()
                if found is not None:
                    return int(found[0])
                time.sleep(0.1)
            return None
        finally:
            conn.close()


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux ``/proc``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses
        if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
            pids.append(int(entry.name))
    return pids


def kill_session() -> None:
    """SIGKILL every process of the job - its driver's session: driver, JVM, PySpark's daemons and
    their workers - this one last. Refused (this worker only is killed) unless the session's leader
    is the job run through this module: started otherwise, the session could be a terminal's."""
    sid, me = os.getsid(0), os.getpid()
    try:
        leader = Path(f"/proc/{sid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        leader = []
    if MODULE.encode() not in leader:
        print(f"kill hook: session {sid} is not the job's own; killing this worker only", file=sys.stderr)
        os.kill(me, signal.SIGKILL)
    for _ in range(2):  # a daemon may fork a worker meanwhile
        for pid in session_pids(sid):
            if pid != me:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    os.kill(me, signal.SIGKILL)


def read_note(flag: str | Path) -> dict[str, Any] | None:
    """What a ``job:`` kill found (the JSON line it appended to its flag), or None."""
    lines = Path(flag).read_text(encoding="utf-8").splitlines()
    return json.loads(lines[-1]) if len(lines) > 1 else None


def kill_session_once(flag: str, note: str = "") -> None:
    """The driver's kill points: create ``flag`` (with ``note``), then SIGKILL the job's session;
    nothing when ``flag`` exists already, so each fires once."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    if note:
        Path(flag).write_text(note)
    kill_session()


def kill_after_rollup_rows(batch: int, flag: str, every: bool = False) -> None:
    """The ``rollup:BATCH:FLAG`` kill point: once the first rollup's Parquet rows of batch ``BATCH``
    are in place (its directory renamed), before the other outputs' and before Spark commits the
    batch, SIGKILL the job (``FLAG`` created first, so it fires once). ``rollups:`` (``every``):
    once every rollup output of the batch is written (Parquet, tables, topics), before the commit."""
    from enrich.sinks import rollups

    if every:
        write = rollups.RollupWriter.write

        def killing_all(self: Any, batch_id: int, *args: Any) -> Any:
            done = write(self, batch_id, *args)
            if batch_id == batch:
                kill_session_once(flag)
            return done

        rollups.RollupWriter.write = killing_all  # type: ignore[method-assign]
        return
    parquet = rollups.RollupWriter._parquet

    def killing(self: Any, batch_id: int, *args: Any) -> int | None:
        written = parquet(self, batch_id, *args)
        if batch_id == batch:
            kill_session_once(flag)
        return written

    rollups.RollupWriter._parquet = killing  # type: ignore[method-assign]


def kill_after_gaps(kind: str, flag: str) -> None:
    """The ``gaps:KIND:FLAG`` kill point: once the first batch whose gap records include one of
    ``KIND`` has written them (the topic and its ledger, the table and its fence, ``gaps.json``),
    before Spark commits it, SIGKILL the job (``FLAG`` created first, so it fires once)."""
    from enrich.sinks import gaps

    write = gaps.GapWriter.write

    def killing(self: Any, batch_id: int, *args: Any) -> Any:
        done = write(self, batch_id, *args)
        if done.kinds.get(kind):
            kill_session_once(flag, str(batch_id))
        return done

    gaps.GapWriter.write = killing  # type: ignore[method-assign]


def kill_after_corrections(flag: str) -> None:
    """The ``corrections:FLAG`` kill point: once the driver has recorded a batch's changes with a
    corrected version (``<checkpoint>/refstream/corrections``), before the batch's tasks run, SIGKILL
    the job (``FLAG`` created first, holding the batch id, so it fires once)."""
    from enrich.dimension import corrections

    record = corrections.BatchChanges.record

    def killing(self: Any, batch_id: int, *args: Any) -> None:
        record(self, batch_id, *args)
        if any(result == "corrected" for _, result in self.counts):
            kill_session_once(flag, str(batch_id))

    corrections.BatchChanges.record = killing  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    import functools

    from enrich import cli
    from enrich.sinks.database import sink as database
    from enrich.sinks.kafka import sink
    from tests.enrich import kill  # this module by its name, not as __main__: pickled by reference

    if argv[0].startswith("gaps:"):  # gaps:KIND:FLAG
        _, kind, flag = argv[0].split(":", 2)
        kill.kill_after_gaps(kind, flag)
        return cli.main(argv[1:])
    if argv[0].startswith("corrections:"):  # corrections:FLAG
        kill.kill_after_corrections(argv[0].split(":", 1)[1])
        return cli.main(argv[1:])
    if argv[0].startswith(("rollup:", "rollups:")):  # rollup[s]:BATCH:FLAG
        which, batch, flag = argv[0].split(":", 2)
        kill.kill_after_rollup_rows(int(batch), flag, every=which == "rollups")
        return cli.main(argv[1:])
    point = kill.KillPoint.from_spec(argv[0])
    sink.TaskWriter = functools.partial(kill.KillingTaskWriter, kill=point)  # type: ignore[misc]
    database.DatabaseTaskWriter = functools.partial(kill.KillingDatabaseWriter, kill=point)  # type: ignore[misc]
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

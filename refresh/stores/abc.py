"""What the runner needs from a state store.

Layout under ``state_dir/<dataset>/`` (the file store, :mod:`refresh.stores.files`):

- ``state.json``     the committed state (:class:`CommittedState`), replaced atomically;
- ``snapshot-<version>.arrow``  the published rows the state points at, in the Arrow IPC file format
  with LZ4 (the only snapshot format), with one more column, :data:`VALID_FROM_COLUMN`: the time each
  row was published as valid from, so a row republished unchanged keeps it; older ones are removed
  after the state that replaced them is durable;
- ``status.json``    the last run and the last success (:class:`DatasetStatus`), written after every
  run, failed or not;
- ``runs.jsonl``     the last runs (:class:`RunRecord`, one JSON object per line, oldest first; kept
  to :data:`RUN_HISTORY`), for the status page's history;
- ``lock``           ``flock``-ed while a run holds the dataset.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa

from refstream.contract import TIME_TYPE, DatasetSchema
from refstream.errors import DataError

__all__ = [
    "RUN_HISTORY",
    "CommittedState",
    "DatasetStatus",
    "RunKind",
    "RunOutcome",
    "RunRecord",
    "RunResult",
    "SnapshotRows",
    "StagedSnapshot",
    "StateStore",
    "TableSnapshot",
    "VALID_FROM_COLUMN",
    "check_columns",
    "split_valid_from",
    "with_valid_from",
]

#: Runs kept per dataset in the run history.
RUN_HISTORY = 50

#: The snapshot column of each row's valid-from time (``timestamp[us, UTC]``); never a source column.
VALID_FROM_COLUMN = "__refstream_valid_from"


def with_valid_from(rows: pa.Table, valid_from: pa.Array | pa.ChunkedArray) -> pa.Table:
    """``rows`` as a snapshot stores them: with their valid-from times as the last column."""
    return rows.append_column(pa.field(VALID_FROM_COLUMN, TIME_TYPE, nullable=False), valid_from.cast(TIME_TYPE))


def split_valid_from(table: pa.Table) -> tuple[pa.Table, pa.ChunkedArray | None]:
    """A stored snapshot's rows and their valid-from times (None: written before they were kept)."""
    i = table.schema.get_field_index(VALID_FROM_COLUMN)
    if i < 0:
        return table, None
    return table.remove_column(i), table.column(i)


def check_columns(dataset: str, rows: pa.Table) -> None:
    """Refuse a source column named like the snapshot's own."""
    if VALID_FROM_COLUMN in rows.column_names:
        raise DataError(f"dataset {dataset}: column {VALID_FROM_COLUMN} is reserved for the refresher's "
                        f"snapshot; rename it in the source")


@dataclass(frozen=True)
class CommittedState:
    """What the topic is known to hold: written only after every message of a run was acknowledged."""

    version: int = 0
    schema: DatasetSchema | None = None   # last schema record published
    snapshot: str | None = None           # file name of the snapshot of published rows
    rows: int = 0
    watermark: Any = None                 # incremental: highest cursor value published (JSON form)
    watermark_type: str | None = None     # contract type of the cursor column
    last_reconcile: str | None = None     # ISO time of the last full read (incremental mode)
    # The last completeness published (contract time text): every change of the source valid at or
    # before it is in the changelog.
    complete_as_of: str | None = None
    topic: str | None = None              # the topic the rows were published to
    # The topic's end offset per partition, as ListOffsets reported it after the last publish: a topic
    # whose ends are found below these was deleted, recreated or emptied since (None: not recorded).
    offsets: dict[int, int] | None = None


#: What a run did: ``diff`` / ``incremental`` (the dataset's mode), ``reconcile`` (an incremental dataset
#: read whole to find hard deletes), ``full`` (every row republished), ``republish`` (every row
#: republished because the topic no longer holds what the state says was published; see ``reason``).
RunKind = Literal["diff", "incremental", "reconcile", "full", "republish"]
#: How a run ended, as ``refresh status`` shows it; an interrupted run is not a failure, a refused one
#: (a guard saw what looks like a partial source, :class:`refresh.errors.Refused`) is not one either,
#: but is not healthy.
RunOutcome = Literal["ok", "interrupted", "refused", "failed"]


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """Outcome of one run. ``published`` counts messages acknowledged (schema records included)."""

    dataset: str
    ok: bool
    version: int
    rows: int
    inserts: int
    updates: int
    deletes: int
    published: int
    seconds: float
    error: str | None = None
    kind: RunKind = "diff"
    watermark: Any = None
    schema_changed: bool = False
    phases: dict[str, float] = field(default_factory=dict)   # seconds per step: load, read, diff, ...
    interrupted: bool = False     # cut short by a stop request: nothing committed, not a failure
    refused: bool = False         # a guard refused the change set: nothing published nor committed
    reason: str | None = None     # why a ``republish`` run republished everything
    complete_as_of: str | None = None  # the completeness the run published (contract time text)

    @property
    def outcome(self) -> RunOutcome:
        if self.ok:
            return "ok"
        return "interrupted" if self.interrupted else "refused" if self.refused else "failed"


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """A run as ``status.json`` keeps it: its result and when it started and finished (ISO, UTC).
    In JSON the result's fields sit beside ``started`` and ``finished``."""

    started: str
    finished: str
    result: RunResult

    def to_json(self) -> dict[str, Any]:
        return {"started": self.started, "finished": self.finished, **dataclasses.asdict(self.result)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RunRecord:
        """Raises KeyError or TypeError on a record that is not one."""
        names = {f.name for f in dataclasses.fields(RunResult)}
        result = RunResult(**{k: v for k, v in obj.items() if k in names})
        return cls(started=obj["started"], finished=obj["finished"], result=result)


@dataclass(frozen=True, kw_only=True)
class DatasetStatus:
    """A dataset's run status: its last run, its last successful run, the failures since that one."""

    dataset: str
    last_run: RunRecord | None = None
    last_success: RunRecord | None = None
    consecutive_failures: int = 0        # interrupted and refused runs do not count

    def after(self, run: RunRecord) -> DatasetStatus:
        """The status once ``run`` is recorded."""
        ok, failed = run.result.ok, run.result.outcome == "failed"
        return DatasetStatus(
            dataset=self.dataset, last_run=run, last_success=run if ok else self.last_success,
            consecutive_failures=0 if ok else self.consecutive_failures + (1 if failed else 0))

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset,
                "last_run": self.last_run.to_json() if self.last_run else None,
                "last_success": self.last_success.to_json() if self.last_success else None,
                "consecutive_failures": self.consecutive_failures}

    @classmethod
    def from_json(cls, dataset: str, obj: dict[str, Any]) -> DatasetStatus:
        """Raises KeyError, TypeError or ValueError on a document that is not a status."""
        last, success = obj.get("last_run"), obj.get("last_success")
        return cls(dataset=dataset, last_run=RunRecord.from_json(last) if last else None,
                   last_success=RunRecord.from_json(success) if success else None,
                   consecutive_failures=int(obj.get("consecutive_failures", 0)))


class SnapshotRows(ABC):
    """The published rows, read a column at a time: the diff needs the key columns of every row
    and then one value column after the other, so the old snapshot never sits in memory whole.
    Offers the subset of :class:`pyarrow.Table` the diff uses; ``schema`` and the reads hold the
    rows' own columns only, :meth:`valid_from` the times stored beside them."""

    schema: pa.Schema
    num_rows: int

    @abstractmethod
    def select(self, names: list[str]) -> pa.Table:
        """These columns of every row."""

    @abstractmethod
    def column(self, name: str) -> pa.ChunkedArray:
        """One column of every row."""

    @abstractmethod
    def read(self) -> pa.Table:
        """Every column of every row."""

    @abstractmethod
    def valid_from(self) -> pa.ChunkedArray | None:
        """Each row's valid-from time (None: a snapshot written before they were kept)."""

    def prefetch(self, max_bytes: int) -> bool:
        """Start reading every column in the background when they take at most ``max_bytes`` in
        memory (the refresher calls it before it reads the source, which mostly waits on the
        database); later calls then use the rows read. Returns whether it started."""
        return False


class TableSnapshot(SnapshotRows):
    """A snapshot held in memory (as :meth:`StateStore.load_snapshot` returns it)."""

    def __init__(self, table: pa.Table) -> None:
        self._rows, self._valid_from = split_valid_from(table)
        self.schema = self._rows.schema
        self.num_rows = self._rows.num_rows

    def select(self, names: list[str]) -> pa.Table:
        return self._rows.select(names)

    def column(self, name: str) -> pa.ChunkedArray:
        return self._rows.column(name)

    def read(self) -> pa.Table:
        return self._rows

    def valid_from(self) -> pa.ChunkedArray | None:
        return self._valid_from


class StagedSnapshot:
    """A new snapshot handed to the store before its commit (:meth:`StateStore.stage_snapshot`), so
    that writing it can overlap the diff and the publish. It is not committed: until
    :meth:`StateStore.commit` is given it, nothing points at what it wrote. This base writes nothing
    early (``commit`` then writes ``table`` itself).

    ``valid_from`` (the rows' valid-from column) may be a future the run resolves once its diff knows
    which rows changed: the early write waits for it, and :meth:`discard` cancels it."""

    def __init__(self, table: pa.Table, valid_from: Future[pa.Array] | pa.Array | None = None) -> None:
        self._rows = table
        self._valid_from = valid_from
        #: Set by the store's commit once the state pointing at it is durable.
        self.committed = False

    @property
    def table(self) -> pa.Table:
        """What is stored: the rows, and their valid-from column once it is known (waits for it;
        raises ``CancelledError`` once discarded)."""
        vf = self._valid_from
        if isinstance(vf, Future):
            vf = vf.result()
        return self._rows if vf is None else with_valid_from(self._rows, vf)

    def _cancel(self) -> None:
        if isinstance(self._valid_from, Future):
            self._valid_from.cancel()  # a write waiting for it gives up

    def wait(self) -> str | None:
        """Wait for the early write and return what the store named it (None: nothing was written
        early); raises what the write raised."""
        return None

    def discard(self) -> None:
        """The run did not commit it: stop writing and remove what was written. A no-op once
        committed; idempotent."""
        if not self.committed:
            self._cancel()


class StateStore(ABC):
    """Per-dataset durable state. Implementations make each ``commit`` atomic."""

    @abstractmethod
    def lock(self, dataset: str, *, wait: bool = True,
             stop: Any = None) -> AbstractContextManager[None]:
        """Hold the dataset exclusively (across threads and processes); raises DatasetBusy when
        ``wait`` is false and another holder exists."""

    @abstractmethod
    def load(self, dataset: str) -> CommittedState:
        """The last committed state (a fresh one when the dataset never ran)."""

    @abstractmethod
    def load_snapshot(self, dataset: str, state: CommittedState) -> pa.Table | None:
        """The published rows ``state`` points at as stored (their valid-from column included, if
        any), or None."""

    def open_snapshot(self, dataset: str, state: CommittedState) -> SnapshotRows | None:
        """The published rows ``state`` points at, or None; may read columns only when asked for
        (see SnapshotRows)."""
        table = self.load_snapshot(dataset, state)
        return None if table is None else TableSnapshot(table)

    @abstractmethod
    def commit(self, dataset: str, state: CommittedState,
               snapshot: pa.Table | StagedSnapshot | None) -> CommittedState:
        """Durably store ``snapshot`` (if given, as a new file; a staged one once its write is done)
        and then ``state``; returns the state as stored. Either the whole commit is visible
        afterwards or none of it."""

    def stage_snapshot(self, dataset: str, version: int, table: pa.Table,
                       valid_from: Future[pa.Array] | pa.Array | None = None) -> StagedSnapshot:
        """Start storing ``table`` (with ``valid_from`` as its valid-from column, see
        :class:`StagedSnapshot`) as the snapshot of ``version`` in the background, invisible until
        :meth:`commit` is given the result; the caller must commit or discard it."""
        return StagedSnapshot(table, valid_from)

    @abstractmethod
    def reserve(self, dataset: str, version: int) -> None:
        """Durably record that messages of ``version`` are about to be published, so that no later
        run reuses the number even if this one never commits (versions seen by consumers grow)."""

    @abstractmethod
    def reserved(self, dataset: str) -> int:
        """The highest version ever reserved (0 if none)."""

    @abstractmethod
    def write_status(self, dataset: str, status: DatasetStatus) -> None:
        """Replace the dataset's run status."""

    @abstractmethod
    def read_status(self, dataset: str) -> DatasetStatus:
        """The dataset's run status (one without runs if it never ran)."""

    @abstractmethod
    def append_run(self, dataset: str, run: RunRecord) -> None:
        """Add ``run`` to the dataset's run history (the oldest beyond :data:`RUN_HISTORY` dropped)."""

    @abstractmethod
    def read_runs(self, dataset: str) -> list[RunRecord]:
        """The dataset's last runs, oldest first (empty if it never ran)."""

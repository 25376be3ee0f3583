"""What the runner needs from a state store.

Layout under ``state_dir/<dataset>/`` (the file store, :mod:`refresh.stores.files`):

- ``state.json``     the committed state (:class:`CommittedState`), replaced atomically;
- ``snapshot-<version>.parquet``  the published rows the state points at (older ones are removed
  after the state that replaced them is durable);
- ``status.json``    the last run and the last success, written after every run, failed or not;
- ``lock``           ``flock``-ed while a run holds the dataset.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from refstream.contract import DatasetSchema


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
    topic: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class SnapshotRows(ABC):
    """The published rows, read a column at a time: the diff needs the key columns of every row
    and then one value column after the other, so the old snapshot never sits in memory whole.
    Offers the subset of :class:`pyarrow.Table` the diff uses."""

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
        """The published rows ``state`` points at, or None."""

    def open_snapshot(self, dataset: str, state: CommittedState) -> SnapshotRows | pa.Table | None:
        """Like :meth:`load_snapshot`, but may read columns only when asked for (see SnapshotRows)."""
        return self.load_snapshot(dataset, state)

    @abstractmethod
    def commit(self, dataset: str, state: CommittedState, snapshot: pa.Table | None) -> CommittedState:
        """Durably store ``snapshot`` (if given, as a new file) and then ``state``; returns the state
        as stored. Either the whole commit is visible afterwards or none of it."""

    @abstractmethod
    def reserve(self, dataset: str, version: int) -> None:
        """Durably record that messages of ``version`` are about to be published, so that no later
        run reuses the number even if this one never commits (versions seen by consumers grow)."""

    @abstractmethod
    def reserved(self, dataset: str) -> int:
        """The highest version ever reserved (0 if none)."""

    @abstractmethod
    def write_status(self, dataset: str, status: dict[str, Any]) -> None:
        """Replace the dataset's run status."""

    @abstractmethod
    def read_status(self, dataset: str) -> dict[str, Any]:
        """The dataset's run status ({} if it never ran)."""

"""Errors specific to the refresher (the shared hierarchy lives in :mod:`refstream.errors`)."""

from __future__ import annotations

from refstream.errors import DataError, RefstreamError, TransientError

__all__ = [
    "DatasetBusy",
    "DuplicateKey",
    "EmptySnapshot",
    "FileNotStable",
    "PublishError",
    "Refused",
    "Stopped",
    "TooManyDeletes",
    "TopicChanged",
]


class DatasetBusy(RefstreamError):
    """Another process or thread is refreshing the dataset (raised by ``run(wait=False)``)."""

    def __init__(self, dataset: str) -> None:
        super().__init__(f"dataset {dataset}: a refresh is already running (lock held)")
        self.dataset = dataset


class Refused(DataError):
    """A guard refused the run's change set (it looks like a partial source); nothing was published.
    Recorded as the run's own outcome, ``refused``, rather than as a failure."""


class EmptySnapshot(Refused):
    """A full read returned no rows and the dataset does not allow empty snapshots."""


class TooManyDeletes(Refused):
    """The run would delete more than ``max_delete_fraction`` of the committed rows."""


class FileNotStable(TransientError):
    """A source file kept changing (size or mtime) for longer than the source waits for it to settle."""


class DuplicateKey(DataError):
    """The snapshot holds the same primary key twice; the message names the key."""


class PublishError(TransientError):
    """Not every message was acknowledged by the broker; nothing was committed."""


class Stopped(RefstreamError):
    """The run was interrupted by its ``stop`` event before anything was committed."""


class TopicChanged(RefstreamError):
    """The topic changed between a run's check of it and its publish (deleted and recreated, or
    repartitioned): nothing was published to it, since what the run would publish, its completeness
    above all, was computed for the topic it checked. Not retried within the run: the next run's
    check sees what the topic holds (and republishes a lost one)."""

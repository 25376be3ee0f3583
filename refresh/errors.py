"""Errors specific to the refresher (the shared hierarchy lives in :mod:`refstream.errors`)."""

from __future__ import annotations

from refstream.errors import DataError, RefstreamError, TransientError


class DatasetBusy(RefstreamError):
    """Another process or thread is refreshing the dataset (raised by ``run(wait=False)``)."""

    def __init__(self, dataset: str) -> None:
        super().__init__(f"dataset {dataset}: a refresh is already running (lock held)")
        self.dataset = dataset


class EmptySnapshot(DataError):
    """A full read returned no rows and the dataset does not allow empty snapshots."""


class DuplicateKey(DataError):
    """The snapshot holds the same primary key twice; the message names the key."""


class PublishError(TransientError):
    """Not every message was acknowledged by the broker; nothing was committed."""


class Stopped(RefstreamError):
    """The run was interrupted by its ``stop`` event before anything was committed."""

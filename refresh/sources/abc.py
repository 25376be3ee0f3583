"""The source interface: a dataset read as Arrow record batches.

Sources never build Python objects per row for the whole dataset: they hand out record batches of
at most ``chunk_rows`` rows, which the runner concatenates into one table (columnar, a few bytes per
value). Errors: :class:`refstream.errors.TransientError` for an unreachable database (retried),
:class:`refstream.errors.DataError` for bad data (naming dataset, file, line), anything else terminal.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pyarrow as pa

__all__ = ["IncrementalSource", "Progress", "Source", "collect"]

#: Called with the number of rows read so far (progress bars).
Progress = Callable[[int], None]


class Source(ABC):
    """A dataset's rows at rest."""

    dataset: str
    #: When the rows of the last read were taken, set by a source that knows better than its caller
    #: when the read began (files: once they held still); None: the caller's own time applies.
    read_started: datetime | None = None

    @abstractmethod
    def describe(self) -> str:
        """Human-readable location (URL without password, or path) for logs and errors."""

    @abstractmethod
    def batches(self) -> Iterator[pa.RecordBatch]:
        """Every row, as record batches sharing one schema."""

    def interrupt(self) -> None:  # noqa: B027 - most sources have nothing to interrupt
        """Abort a read in progress, from another thread (a stop request): the reading call fails
        soon after. Sources whose reads cannot block for long do nothing."""

    def read(self, progress: Progress | None = None) -> pa.Table:
        """Every row as one table (empty table with the right schema when the source is empty)."""
        return collect(self.batches(), progress)

    @abstractmethod
    def probe(self) -> str:
        """Check that the source can be read without reading its rows (``refresh validate --connect``):
        a short description of what was found; raises the error a run would meet."""


class IncrementalSource(Source):
    """A source that can be read from a cursor column onwards (SQL)."""

    @abstractmethod
    def now(self) -> Any:
        """The source's own clock ("now" as the database sees it)."""

    @abstractmethod
    def batches_since(self, column: str, low: Any) -> Iterator[pa.RecordBatch]:
        """Rows whose ``column`` is at least ``low`` (every row when ``low`` is None)."""

    def read_since(self, column: str, low: Any, progress: Progress | None = None) -> pa.Table:
        return collect(self.batches_since(column, low), progress)


def collect(batches: Iterator[pa.RecordBatch], progress: Progress | None = None) -> pa.Table:
    out: list[pa.RecordBatch] = []
    schema: pa.Schema | None = None
    n = 0
    for b in batches:
        if schema is None:
            schema = b.schema
        out.append(b)
        n += b.num_rows
        if progress is not None:
            progress(n)
    if schema is None:
        raise AssertionError("a source must yield at least one (possibly empty) batch")
    return pa.Table.from_batches(out, schema=schema)

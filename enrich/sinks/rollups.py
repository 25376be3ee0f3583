"""The rollups' outputs: each rollup's rows of a micro-batch, and the batch's rollup dead letters
and counts, from the rollup step's packed values (:mod:`enrich.state.rollups`).

Parquet: one directory per rollup, ``<path>/batch_id=<N>/`` per micro-batch holding every row the
batch wrote (each revision appended); written by the executors to ``<path>/_staging/`` and renamed
into place once complete, and not written again for a batch whose directory exists (a replay after
a crash), as the event output's Parquet is. The latest revision of each window is the row with the
greatest ``_revision`` per (keys, ``window_start``) (docs/rollups.md gives the query).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from enrich.columns import PACK_KIND, ROWS
from enrich.ipc import from_ipc
from enrich.rollups.config import RollupConfig
from enrich.rollups.packs import COUNTS, COUNTS_SCHEMA, DEAD
from enrich.rollups.spec import RollupSpec
from enrich.sinks.deadletter import COLUMNS as DEAD_COLUMNS
from refstream.atomic import fsync_dir

log = logging.getLogger(__name__)

__all__ = ["RollupBatch", "RollupWriter", "rows_of"]


@dataclass(frozen=True)
class RollupBatch:
    """What a batch gave the rollups: ``dead`` letters (events beyond a horizon), ``counts``
    (rollup, result) -> events, and ``rows`` rollup -> rows written (None: written before, a replay)."""

    dead: pa.Table
    counts: dict[tuple[str, str], int]
    rows: dict[str, int | None]


def rows_of(batches: Iterable[pa.RecordBatch], *, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` (``enrich.query.rollup_rows``): the rollup rows held by packed values."""
    for batch in batches:
        for value in batch.column(ROWS).to_pylist():
            table = from_ipc(value)
            if table.num_rows:
                yield from table.cast(schema).to_batches()


class RollupWriter:
    """Writes each rollup's rows of a batch (at most once per batch id) and reads the batch's rollup
    dead letters and counts (small: collected)."""

    def __init__(self, specs: Sequence[RollupSpec], configs: Sequence[RollupConfig]) -> None:
        self.specs = tuple(specs)
        self.paths = tuple(c.output.parquet.resolve() for c in configs)
        for path in self.paths:
            (path / "_staging").mkdir(parents=True, exist_ok=True)

    def write(self, batch_id: int, df: DataFrame, frames: Sequence[DataFrame]) -> RollupBatch:
        """``df``: a batch of the rollup step's output (``PACK_KIND``, ``ROWS``), cached by the caller;
        ``frames``: each rollup's rows in it (``enrich.query.rollup_rows``)."""
        rows: dict[str, int | None] = {}
        for spec, path, frame in zip(self.specs, self.paths, frames, strict=True):
            rows[spec.name] = self._parquet(batch_id, frame, spec, path)
        small = df.where(F.col(PACK_KIND).isin(DEAD, COUNTS)).toArrow()
        dead, counts = [], Counter[tuple[str, str]]()
        for kind, value in zip(small.column(PACK_KIND).to_pylist(), small.column(ROWS).to_pylist(), strict=True):
            table = from_ipc(value)
            if kind == DEAD:
                dead.append(table.select(list(DEAD_COLUMNS)))
            else:
                for r in table.cast(COUNTS_SCHEMA).to_pylist():
                    counts[(r["rollup"], r["result"])] += r["events"]
        return RollupBatch(pa.concat_tables(dead) if dead else _no_dead(), dict(counts), rows)

    def _parquet(self, batch_id: int, df: DataFrame, spec: RollupSpec, path: Path) -> int | None:
        final = path / f"batch_id={batch_id}"
        if final.exists():
            log.info("batch %d: rollup %s: %s exists (a replay); not written again", batch_id, spec.name, final)
            return None
        tmp = path / "_staging" / f"batch_id={batch_id}-{uuid.uuid4().hex[:8]}"
        df.write.parquet("file://" + str(tmp))  # not as_uri(): it escapes "="
        os.replace(tmp, final)
        fsync_dir(path)
        for stale in (path / "_staging").glob(f"batch_id={batch_id}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return sum(pq.read_metadata(f).num_rows for f in final.glob("*.parquet"))


def _no_dead() -> pa.Table:
    return pa.table({c: pa.array([], pa.string() if c in ("_error", "_topic") else
                                 pa.binary() if c in ("_key", "_value") else pa.int64()) for c in DEAD_COLUMNS})

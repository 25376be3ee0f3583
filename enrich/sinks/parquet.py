"""Parquet output: one directory per micro-batch, ``<path>/batch_id=<N>/``.

Spark writes the batch to ``<path>/_staging/`` first; the directory is renamed into place only once
complete, and a batch whose directory exists is not written again (a replay after a crash). Readers
see whole batches only (Spark ignores ``_``-prefixed directories) and ``batch_id`` as a column.
The rename is atomic on a local or POSIX file system; object stores need a committing format instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from enrich.columns import KIND, KIND_CORRECTION
from enrich.sinks.abc import Counted, EnrichedBatch
from refstream.atomic import fsync_dir

log = logging.getLogger(__name__)


def write_batch(path: Path, batch_id: int, write: Callable[[str], None], *, keep_empty: bool = True) -> int:
    """Batch ``batch_id``'s directory under ``path``, ``batch_id=<N>``, written by ``write`` (given a
    ``file://`` URI in ``path/_staging/``) and renamed into place once complete; the rows its files
    hold. The caller checks first that it does not exist (a replay). Without ``keep_empty``, a batch
    of no rows leaves no directory (0)."""
    staging = path / "_staging"
    final = path / f"batch_id={batch_id}"
    tmp = staging / f"batch_id={batch_id}-{uuid.uuid4().hex[:8]}"
    write("file://" + str(tmp))  # not as_uri(): it escapes "="
    rows = sum(pq.read_metadata(f).num_rows for f in tmp.glob("*.parquet"))
    if rows or keep_empty:
        os.replace(tmp, final)
        fsync_dir(path)
    for stale in staging.glob(f"batch_id={batch_id}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return rows


class ParquetSink:
    writes_dead_letters = False
    counts: tuple[str, ...] = ("enriched",)  # from the written files' footers
    reparses = False  # writes through Spark: events are parsed by from_json
    pending: tuple[int, ...] = ()

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.counted = Counted()
        self.path = Path(path).resolve()
        self.staging = self.path / "_staging"
        self.staging.mkdir(parents=True, exist_ok=True)

    def final_dir(self, batch_id: int) -> Path:
        return self.path / f"batch_id={batch_id}"

    def write(self, batch_id: int, batch: EnrichedBatch) -> pa.Table:
        self.counted = Counted(enriched=0)
        if self.final_dir(batch_id).exists():
            log.info("batch %d: %s exists (a replay); not written again", batch_id, self.final_dir(batch_id))
            return batch.dead_letters()
        df = batch.df.persist()
        try:
            written = write_batch(self.path, batch_id, lambda uri: batch.good().write.parquet(uri))
            dead = batch.dead_letters()
        finally:
            df.unpersist()
        fixed = 0
        if KIND in batch.df.columns:  # with corrections: counted apart from the events
            kinds = pq.read_table(self.final_dir(batch_id), columns=[KIND]).column(KIND)
            fixed = int(pc.sum(pc.cast(pc.equal(kinds, KIND_CORRECTION), pa.int64())).as_py() or 0)
        self.counted = Counted(enriched=written - fixed, corrections=fixed)
        return dead

    def close(self) -> None:
        pass

"""Reading a job's checkpoint (never writing it): the micro-batches Spark committed, the event
offsets each one processed, and the changelog positions and dimension facts the job recorded for it.

Its paths, and Spark's offset and commit logs, are read through
:class:`enrich.checkpoint.CheckpointLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from enrich.checkpoint import CheckpointLayout
from enrich.dimension.abc import Positions
from enrich.dimension.versions import FileVersionLog
from enrich.source.offsets import TP, from_json_offsets
from refstream.errors import DataError


@dataclass(frozen=True, kw_only=True)
class BatchInfo:
    """What the checkpoint says about one committed micro-batch."""

    batch_id: int
    committed_at: float                      # when Spark wrote its commit file (epoch seconds)
    timestamp_ms: int | None                 # the batch's trigger time, as Spark recorded it
    events_end: dict[TP, int]                # every source's offsets processed up to (excluding): the
                                             # events and the changelogs of partitioned dimensions
    positions: dict[str, Positions]          # dataset -> changelog positions the batch used (broadcast)
    dimensions: dict[str, dict[str, object]]  # dataset -> rows, version, changed_ms (when recorded)

    def source_end(self, topic: str) -> Positions:
        """``{partition: offset}`` the batch read ``topic`` up to (a topic read as a source of the query)."""
        return {p: o for (t, p), o in self.events_end.items() if t == topic}


class Checkpoint:
    """A read-only view of one job checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.layout = CheckpointLayout(self.path)
        if not self.layout.offsets.is_dir():
            raise DataError(f"{self.path}: not a job checkpoint (no spark/offsets); has the job run with "
                            "this checkpoint: yet?")
        self._versions = FileVersionLog(self.layout.dimensions, create=False)

    def committed(self) -> list[int]:
        """Ids of the committed micro-batches Spark still keeps, ascending."""
        return self.layout.committed()

    def last_committed(self) -> int | None:
        ids = self.committed()
        return ids[-1] if ids else None

    def committed_batch(self, batch_id: int | None = None) -> int:
        """``batch_id`` if it is a committed batch Spark still keeps (default: the last committed
        one); a :class:`DataError` saying which batches there are otherwise."""
        ids = self.committed()
        if batch_id is None:
            if not ids:
                raise DataError(f"{self.path}: no micro-batch has been committed yet")
            return ids[-1]
        if batch_id not in ids:
            have = f"batches {ids[0]}..{ids[-1]} are kept" if ids else "no batch is committed yet"
            raise DataError(f"{self.path}: batch {batch_id} is not a committed batch in this checkpoint ({have})")
        return batch_id

    def batch(self, batch_id: int | None = None) -> BatchInfo:
        """The facts of ``batch_id`` (default: the last committed batch)."""
        batch_id = self.committed_batch(batch_id)
        meta, sources = self._offsets(batch_id)
        events_end: dict[TP, int] = {}
        for src in sources:
            events_end.update(from_json_offsets(src))
        commit = self.layout.commits / str(batch_id)
        positions = self._versions.get(batch_id)
        if positions is None:
            kept = self._versions.ids()
            raise DataError(f"{self.path}: no dimension positions recorded for batch {batch_id} (the job keeps "
                            f"the last {len(kept)}: {kept[0] if kept else '-'}..{kept[-1] if kept else '-'})")
        ts = meta.get("batchTimestampMs")
        return BatchInfo(batch_id=batch_id, committed_at=commit.stat().st_mtime,
                         timestamp_ms=int(ts) if ts is not None else None, events_end=events_end,
                         positions=positions, dimensions=self._versions.info(batch_id))

    def _offsets(self, batch_id: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        entry = self.layout.offset_entry(batch_id, missing_ok=False)
        assert entry is not None
        return entry.meta, list(entry.sources)

"""Shipping dimension versions to executors through Spark broadcasts, only when they change.

A base is broadcast once per generation (Arrow IPC bytes); an overlay once per change. Executors
get a :class:`Shipped` handle per batch: ids plus broadcast references, a few hundred bytes. Python
workers are reused across batches and cache the lookup they built per id (see ``enrich.joins``), so
a batch in which nothing changed re-ships and rebuilds nothing.

After :meth:`Shipper.write_to`, every shipped version is also written to its directory as an Arrow IPC file named by its id
(:func:`file_of`): a join inside the streaming plan (before the state step) cannot get broadcasts
made after the plan was built, so its tasks read the pinned versions from these files instead,
which must then be on storage every executor sees (the checkpoint's, on a cluster).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark import SparkContext
from pyspark.broadcast import Broadcast

from enrich.dimension.store import Snapshot
from enrich.ipc import to_ipc
from refstream.atomic import write_bytes_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shipped:
    """A picklable reference to one dimension version, for the executors."""

    dataset: str
    key: tuple[str, ...]
    base_id: str
    base: Any               # Broadcast[bytes]
    overlay_id: str | None
    overlay: Any | None     # Broadcast[bytes] | None


def file_of(files: str | Path, ident: str) -> Path:
    """The file a version shipped with id ``ident`` is written to under ``files``."""
    return Path(files) / (ident.replace("/", "-") + ".arrow")


class Shipper:
    """Broadcasts new bases and overlays of every dimension; retires replaced broadcasts (and, with
    ``files``, writes each one there too: see the module doc)."""

    def __init__(self, sc: SparkContext) -> None:
        self._sc = sc
        self.files: Path | None = None      # see write_to
        self._retired_files: list[Path] = []
        self._run = uuid.uuid4().hex[:8]
        self._current: dict[str, Shipped] = {}
        self._gens: dict[str, tuple[int, int]] = {}
        self._retired: list[Broadcast[Any]] = []
        self._seq = 0
        self.bytes_shipped = 0
        self.broadcasts = 0     # broadcasts created so far (bases and overlays)

    def _broadcast(self, data: bytes) -> tuple[str, Broadcast[bytes]]:
        """A new broadcast and an id no other broadcast of this shipper has: executors cache by id."""
        self._seq += 1
        self.broadcasts += 1
        self.bytes_shipped += len(data)
        ident = f"{self._run}/{self._seq}"
        if self.files is not None:
            write_bytes_atomic(file_of(self.files, ident), data)
        return ident, self._sc.broadcast(data)

    def ship(self, snap: Snapshot) -> Shipped:
        # Replaced broadcasts are dropped once the batch that used them is over (batches run one at a time).
        for bc in self._retired:
            bc.destroy(blocking=False)
        self._retired = []
        for path in self._retired_files:
            path.unlink(missing_ok=True)
        self._retired_files = []
        prev = self._current.get(snap.dataset)
        gens = self._gens.get(snap.dataset)
        if prev is not None and gens == (snap.base_gen, snap.overlay_gen):
            return prev
        if prev is not None and gens is not None and gens[0] == snap.base_gen:
            base_id, base_bc = prev.base_id, prev.base
        else:
            data = to_ipc(snap.base)
            base_id, base_bc = self._broadcast(data)
            log.info("dataset %s: shipping base generation %d (%d rows, %.1f MB)", snap.dataset,
                     snap.base_gen, snap.base.num_rows, len(data) / 1e6)
            if prev is not None:
                self._retire(prev.base_id, prev.base)
        overlay_id, overlay_bc = None, None
        if snap.overlay is not None:
            data = to_ipc(snap.overlay)
            overlay_id, overlay_bc = self._broadcast(data)
            log.debug("dataset %s: shipping overlay %s (%d rows)", snap.dataset, overlay_id, snap.overlay.num_rows)
        if prev is not None and prev.overlay is not None:
            assert prev.overlay_id is not None
            self._retire(prev.overlay_id, prev.overlay)
        shipped = Shipped(snap.dataset, snap.schema.key, base_id, base_bc, overlay_id, overlay_bc)
        self._current[snap.dataset] = shipped
        self._gens[snap.dataset] = (snap.base_gen, snap.overlay_gen)
        return shipped

    def write_to(self, files: Path) -> None:
        """Write every version shipped from now on to ``files`` too (before the first ship)."""
        assert not self._current, "write_to() after versions were shipped"
        files.mkdir(parents=True, exist_ok=True)
        for old in files.glob("*.arrow"):  # an earlier run's: its ids are never used again
            old.unlink(missing_ok=True)
        self.files = files

    def _retire(self, ident: str, bc: Broadcast[bytes]) -> None:
        self._retired.append(bc)
        if self.files is not None:
            self._retired_files.append(file_of(self.files, ident))

    def forget(self, dataset: str) -> None:
        """Drop what was shipped for ``dataset``: its state was rebuilt, and a rebuilt state restarts its
        generations, so equal generation numbers no longer mean equal contents."""
        prev = self._current.pop(dataset, None)
        self._gens.pop(dataset, None)
        if prev is not None:
            self._retire(prev.base_id, prev.base)
            if prev.overlay is not None and prev.overlay_id is not None:
                self._retire(prev.overlay_id, prev.overlay)

    def close(self) -> None:
        for s in self._current.values():
            for bc in (s.base, s.overlay):
                if bc is not None:
                    bc.destroy(blocking=False)
        for bc in self._retired:
            bc.destroy(blocking=False)
        self._current, self._retired = {}, []

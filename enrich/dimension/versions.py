"""Write-ahead record of the changelog positions each micro-batch used: ``<dir>/<batch_id>.json``.

Written (temp file, fsync, rename, fsync of the directory) before the batch runs, so a replay of
the batch after a crash rebuilds the dimension to exactly these positions.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from enrich.dimension.abc import Positions
from refstream.atomic import write_bytes_atomic

_NAME = re.compile(r"^(\d+)\.json$")


class FileVersionLog:
    """A :class:`~enrich.dimension.abc.VersionLog` in a directory; keeps the last ``keep`` entries."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 100, *, create: bool = True) -> None:
        self.dir = Path(directory)
        if create:  # readers (``enrich status``) do not create it
            self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def _path(self, batch_id: int) -> Path:
        return self.dir / f"{batch_id}.json"

    def get(self, batch_id: int) -> dict[str, Positions] | None:
        try:
            raw = json.loads(self._path(batch_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        return {ds: {int(p): int(o) for p, o in pos.items()} for ds, pos in raw["positions"].items()}

    def put(self, batch_id: int, positions: Mapping[str, Positions],
            info: Mapping[str, Mapping[str, object]] | None = None) -> None:
        path = self._path(batch_id)
        entry: dict[str, object] = {
            "batch_id": batch_id,
            "positions": {ds: {str(p): o for p, o in pos.items()} for ds, pos in positions.items()}}
        if info:
            entry["dimensions"] = {ds: dict(facts) for ds, facts in info.items()}
        data = json.dumps(entry, sort_keys=True)
        write_bytes_atomic(path, data.encode("utf-8"))
        for old in self._ids()[:-self.keep]:
            self._path(old).unlink(missing_ok=True)

    def info(self, batch_id: int) -> dict[str, dict[str, object]]:
        """What was recorded about each dimension for ``batch_id`` besides its positions (rows,
        version, ``changed_ms``); empty for entries written without it."""
        try:
            raw = json.loads(self._path(batch_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        return {ds: dict(facts) for ds, facts in (raw.get("dimensions") or {}).items()}

    def ids(self) -> list[int]:
        """The batch ids recorded, ascending."""
        return self._ids()

    def latest(self) -> tuple[int, dict[str, Positions]] | None:
        ids = self._ids()
        if not ids:
            return None
        got = self.get(ids[-1])
        return (ids[-1], got) if got is not None else None

    def _ids(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.match(p.name)))

"""What a checkpoint records at its first start and every later start reuses
(``CheckpointLayout.origin``): where its events start and, for a fork, the savepoint it started
from and its watermark floor.

Spark keeps a source's starting offsets nowhere: until batch 0 commits, every start asks the
source's ``initialOffset`` again, and Spark runs a replayed batch 0 from that answer to the end it
logged. ``latest`` resolved again at a restart would skip what batch 0 held and what arrived
meanwhile. So the job resolves ``events.starting_offsets`` to per-partition offsets at the first
start, records them, and hands the recorded offsets to the source at every start (after batch 0
commits Spark reads its own offset log and ignores them).

A fork (``--from-savepoint``) records the savepoint's directory, offsets and watermark floor: until
its batch 0 commits, a start (with the same ``--from-savepoint`` or without it) forks again from
the recorded savepoint, whose initial state Spark applies in a replayed batch 0; the floor holds at
every start of the checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from enrich.checkpoint import CheckpointLayout
from refstream.atomic import write_json_atomic
from refstream.errors import ConfigError

__all__ = ["Origin"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Origin:
    """``events``: the events' starting offsets (Spark's JSON, ``{topic: {partition: offset}}``);
    ``savepoint``: the directory a fork started from (None: not a fork); ``floor_us``: a fork's
    watermark floor (event time, microseconds; None: none)."""

    events: str
    savepoint: str | None = None
    floor_us: int | None = None

    @classmethod
    def read(cls, layout: CheckpointLayout) -> Origin | None:
        """The checkpoint's record; None before its first start. A :class:`ConfigError` naming the
        file when it is not one."""
        path = layout.origin
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            events = json.dumps(kept["events"], sort_keys=True)
            savepoint, floor = kept.get("savepoint"), kept.get("floor_us")
            if not isinstance(kept["events"], dict) or not (savepoint is None or isinstance(savepoint, str)) \
                    or not (floor is None or (isinstance(floor, int) and not isinstance(floor, bool))):
                raise ValueError("events, savepoint or floor_us of the wrong type")
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a checkpoint origin record ({exc}); restore it from a backup of the "
                              "checkpoint, or point checkpoint: at a new directory") from None
        return cls(events, savepoint, floor)

    def write(self, layout: CheckpointLayout) -> None:
        write_json_atomic(layout.origin, {"events": json.loads(self.events), "savepoint": self.savepoint,
                                          "floor_us": self.floor_us})
        log.info("%s: the checkpoint's events start at %s%s", layout.root, self.events,
                 f" (a fork of the savepoint {self.savepoint})" if self.savepoint else "")

    def forked_from(self, directory: str | Path) -> bool:
        """Whether the checkpoint is a fork of the savepoint in ``directory``."""
        return self.savepoint is not None and Path(self.savepoint) == Path(directory).resolve()

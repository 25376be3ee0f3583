"""The layout of a job's checkpoint directory (``checkpoint:`` in enrich.yaml): the one place that
names a path under it. Every module that reads or writes the checkpoint takes its paths from a
:class:`CheckpointLayout`.

::

    <checkpoint>/
      spark/                    Spark's own checkpoint (the query's checkpointLocation):
        offsets/<n>               the sources' end offsets of batch n (written when it is planned)
        commits/<n>               exists once batch n has been written
        state/                    the state store (device state, partitioned dimensions)
      dimensions/<n>.json       the changelog positions batch n pinned (enrich.dimension.versions)
      refstream/
        sink.json               the writers' identity: the query's scope and the base transactional
                                ids, fixed at the first start (enrich.sinks.identity)
        shipped/                dimension versions written for the tasks of joins in the plan
        state.json              the state settings the stored state is laid out by (enrich.state.checkpoint)
        devices.json            devices in state per bucket (enrich.state.devices)
        schemas.json            the published schemas the pipeline was last planned with (lookups)

Spark's part belongs to Spark; the job writes the rest, each file atomically
(:mod:`refstream.atomic`), and never a file of Spark's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from refstream.atomic import write_json_atomic
from refstream.contract import DatasetSchema
from refstream.errors import ContractError, DataError

__all__ = ["CheckpointLayout"]


@dataclass(frozen=True)
class CheckpointLayout:
    """The paths of one checkpoint directory (``root``); nothing is created until written."""

    root: Path

    @property
    def spark(self) -> Path:
        """Spark's checkpoint location (pass it resolved: Spark keeps it as a URI)."""
        return self.root / "spark"

    @property
    def offsets(self) -> Path:
        return self.spark / "offsets"

    @property
    def commits(self) -> Path:
        return self.spark / "commits"

    @property
    def dimensions(self) -> Path:
        return self.root / "dimensions"

    @property
    def own(self) -> Path:
        """The job's own records (everything under ``refstream/``)."""
        return self.root / "refstream"

    @property
    def sink_identity(self) -> Path:
        return self.own / "sink.json"

    @property
    def shipped(self) -> Path:
        return self.own / "shipped"

    @property
    def state_record(self) -> Path:
        return self.own / "state.json"

    @property
    def devices(self) -> Path:
        return self.own / "devices.json"

    @property
    def schemas(self) -> Path:
        return self.own / "schemas.json"

    def planned_any(self) -> bool:
        """Whether Spark has planned a batch here (an offset log entry exists)."""
        return any(self.offsets.glob("[0-9]*"))

    def committed_any(self) -> bool:
        """Whether Spark has committed a batch here."""
        return any(self.commits.glob("[0-9]*"))

    def write_schemas(self, schemas: Mapping[str, DatasetSchema]) -> None:
        """Keep the published schemas the pipeline was planned with, for planning it again without
        the broker (``enrich lookup --state``)."""
        write_json_atomic(self.schemas, {ds: json.loads(s.to_json()) for ds, s in sorted(schemas.items())})

    def read_schemas(self) -> dict[str, DatasetSchema]:
        """What :meth:`write_schemas` kept; a :class:`DataError` naming the file when it is missing
        or unreadable."""
        path = self.schemas
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            return {ds: DatasetSchema.from_json(json.dumps(s)) for ds, s in kept.items()}
        except FileNotFoundError:
            raise DataError(f"{path}: missing; the job has not started on this checkpoint") from None
        except (ValueError, AttributeError, ContractError) as exc:
            raise DataError(f"{path}: not a schema record ({exc}); start the job once to write it again") from None

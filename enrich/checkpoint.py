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
        job.lock                held by the running job, or ``enrich rescale``: one at a time; says who
                                (host, process id), its modification time the heartbeat
        origin.json             where the events start (and a fork's savepoint and watermark floor),
                                resolved at the first start and reused at every start (enrich.origin)
        sink.json               the writers' identity: the query's scope and the base transactional
                                ids, fixed at the first start (enrich.sinks.identity)
        shipped/                dimension versions written for the tasks of joins in the plan
        state.json              the state settings the stored state is laid out by (enrich.state.record)
        devices.json            devices in state per bucket (enrich.state.devices)
        schemas.json            the published schemas the pipeline was last planned with (lookups)
        calls/<batch>/<bucket>.json   the responses a bucket's calls received in a batch (enrich.calls.record)
        idle.json               the last batch that read events and its time, for the rollups'
                                idle_finalize (enrich.state.rollups.idle_facts)
        gaps.json               the time each source partition reached before and after the last
                                batch, and its quiet partitions, for the gaps (enrich.sinks.gaps)
        corrections/<n>.<dataset>.arrow   batch n's late versions of a corrected dataset, written
                                before the batch runs (enrich.dimension.corrections)

Spark's part belongs to Spark; the job writes the rest, each file atomically
(:mod:`refstream.atomic`), and never a file of Spark's. Spark's offset and commit logs are read
here only (:meth:`CheckpointLayout.offset_entry`, :meth:`CheckpointLayout.commit_entry`,
:meth:`CheckpointLayout.planned`, :meth:`CheckpointLayout.committed`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refstream.atomic import write_json_atomic
from refstream.contract import DatasetSchema
from refstream.errors import ConfigError, ContractError, DataError

__all__ = ["CheckpointBusy", "CheckpointLayout"]

log = logging.getLogger(__name__)

#: Spark's number of shuffle (and so state) partitions, as its offset log records it per batch.
_SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"


class CheckpointBusy(ConfigError):
    """The checkpoint's lock is held, by a running job or ``enrich rescale``: a second job, or a
    rescale, on it is refused (the CLI exits 2)."""


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
    def lock(self) -> Path:
        return self.own / "job.lock"

    @property
    def origin(self) -> Path:
        return self.own / "origin.json"

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

    @property
    def calls(self) -> Path:
        return self.own / "calls"

    @property
    def corrections(self) -> Path:
        return self.own / "corrections"

    @property
    def idle(self) -> Path:
        return self.own / "idle.json"

    @property
    def gaps(self) -> Path:
        return self.own / "gaps.json"

    def call_record(self, batch_id: int, bucket: int) -> Path:
        """Where the responses of ``bucket``'s calls in batch ``batch_id`` are kept."""
        return self.calls / str(batch_id) / f"{bucket}.json"

    def planned_any(self) -> bool:
        """Whether Spark has planned a batch here (an offset log entry exists)."""
        return any(self.offsets.glob("[0-9]*"))

    def committed_any(self) -> bool:
        """Whether Spark has committed a batch here."""
        return any(self.commits.glob("[0-9]*"))

    def planned(self) -> list[int]:
        """The batch ids in Spark's offset log, ascending."""
        return _ids(self.offsets)

    def committed(self) -> list[int]:
        """The batch ids in Spark's commit log, ascending."""
        return _ids(self.commits)

    def offset_entry(self, batch_id: int, *, missing_ok: bool = True) -> OffsetEntry | None:
        """Batch ``batch_id``'s entry in Spark's offset log (``v1``, the batch's metadata as JSON,
        then a line per source: its end offsets as JSON, ``-`` for none), the one reader of it;
        None when there is none (a :class:`DataError` unless ``missing_ok``), a :class:`DataError`
        naming the file when it cannot be read."""
        path = self.offsets / str(batch_id)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            meta = json.loads(lines[1]) if len(lines) > 1 else {}
            if not isinstance(meta, dict):
                raise ValueError("the batch's metadata is not a JSON object")
            sources = tuple(json.loads(line) for line in lines[2:] if line.strip() and line.strip() != "-")
        except FileNotFoundError as exc:
            if missing_ok:
                return None
            raise DataError(f"{path}: unreadable offset log entry ({exc})") from None
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: unreadable offset log entry ({exc})") from None
        return OffsetEntry(meta, tuple(s for s in sources if isinstance(s, dict)))

    def commit_entry(self, batch_id: int) -> dict[str, Any]:
        """The metadata of batch ``batch_id``'s entry in Spark's commit log (``v1``, then JSON such as
        ``nextBatchWatermarkMs``), the one reader of it; a :class:`DataError` naming the file when it
        is missing or cannot be read."""
        path = self.commits / str(batch_id)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            meta = json.loads(lines[1]) if len(lines) > 1 else {}
            if not isinstance(meta, dict):
                raise ValueError("the commit's metadata is not a JSON object")
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: unreadable commit log entry ({exc})") from None
        return meta

    def recorded_partitions(self, batch_id: int) -> int | None:
        """The number of state partitions Spark recorded for ``batch_id`` in its offset log (the one
        it runs the batch with, whatever the session says); None when the entry or the number is missing."""
        entry = self.offset_entry(batch_id)
        value = entry.meta.get("conf", {}).get(_SHUFFLE_PARTITIONS) if entry is not None else None
        return None if value is None else _int(value, self.offsets / str(batch_id))

    def batch_watermark_ms(self, batch_id: int) -> int | None:
        """The event-time watermark Spark recorded for ``batch_id`` in its offset log (the one its
        stateful step drops state by, a replay included); None when the entry is missing."""
        entry = self.offset_entry(batch_id)
        value = entry.meta.get("batchWatermarkMs") if entry is not None else None
        return None if value is None else _int(value, self.offsets / str(batch_id))

    def unfinished_rescale(self) -> int | None:
        """The number of state partitions of a rescale Spark began and did not commit, if the last
        batch is one: planned and not committed, with another number than the batch before it (how
        Spark's offline repartition tells its own batches). It must be finished with that number
        before the query runs again (the batch has no input to replay, and its state is half written)."""
        planned, committed = self.planned(), self.committed()
        if not planned or (committed and committed[-1] >= planned[-1]) or planned[-1] == 0:
            return None
        last, before = self.recorded_partitions(planned[-1]), self.recorded_partitions(planned[-1] - 1)
        return last if last is not None and before is not None and last != before else None

    @contextmanager
    def held(self, *, exclusive: bool = False) -> Iterator[None]:
        """Hold the checkpoint's lock (:attr:`lock`) while the block runs, alone: one running job
        (two would race on Spark's state store and repeat external calls), or ``enrich rescale``
        (``exclusive``: it rewrites Spark's state while no job runs). Never waits: a
        :class:`CheckpointBusy` naming the holder (what it is, its host and process id). The lock is
        an ``flock`` released with its process, however that ends; the file says who holds it, and
        its modification time is its heartbeat (every :data:`HEARTBEAT_S`), for storage whose
        ``flock`` does not reach other machines (some network file systems): a start that gets the
        lock but finds another machine's holder beating within :data:`STALE_S` is refused too."""
        self.own.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        stop = threading.Event()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CheckpointBusy(self._busy(_holder(fd))) from None
            other = _holder(fd)
            if (other.get("host") not in (None, socket.gethostname())
                    and time.time() - os.fstat(fd).st_mtime < STALE_S):
                raise CheckpointBusy(self._busy(other))
            me = {"holder": "rescale" if exclusive else "job", "host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
            threading.Thread(target=_beat, args=(fd, stop), name="checkpoint-heartbeat", daemon=True).start()
            yield
        finally:
            stop.set()  # the heartbeat thread touches the file only while the lock is held
            with _BEATING:
                os.close(fd)  # releases the lock

    def _busy(self, holder: Mapping[str, Any]) -> str:
        who = f"{holder.get('host', '?')}, process {holder.get('pid', '?')}"
        if holder.get("holder") == "rescale":
            return (f"{self.root}: enrich rescale is rewriting this checkpoint's state (on {who}; it holds "
                    f"{self.lock}); start the job once it has finished")
        return (f"{self.root}: the job is running on this checkpoint (on {who}; it holds {self.lock}); stop it "
                "(SIGTERM lets it finish its batch) and try again, or point checkpoint: at another directory")

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


#: How often a lock's holder touches the lock file, and how old a touch from another machine may be
#: before the holder is taken for gone (its flock, on storage that shares one, says so at once).
HEARTBEAT_S = 10.0
STALE_S = 3 * HEARTBEAT_S
_BEATING = threading.Lock()  # a touch never runs on a file descriptor closed (and reused) meanwhile


def _holder(fd: int) -> dict[str, Any]:
    """Who the lock file says holds the lock ({} when it says nothing readable)."""
    try:
        kept = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _beat(fd: int, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with _BEATING:
            if stop.is_set():
                return
            try:
                os.utime(fd)
            except OSError as exc:  # the checkpoint's storage: the lock itself is still held
                log.warning("checkpoint lock heartbeat failed: %s", exc)


@dataclass(frozen=True)
class OffsetEntry:
    """One batch's entry in Spark's offset log: ``meta`` the batch's metadata (``batchWatermarkMs``,
    ``batchTimestampMs``, ``conf``), ``sources`` every source's end offsets (JSON objects, in the
    query's order of sources, those without offsets left out)."""

    meta: dict[str, Any]
    sources: tuple[dict[str, Any], ...]


def _int(value: Any, path: Path) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: unreadable offset log entry ({exc})") from None


def _ids(log: Path) -> list[int]:
    if not log.is_dir():
        return []
    return sorted(int(p.name) for p in log.iterdir() if p.name.isdigit())

"""The file state store (see :mod:`refresh.stores.abc` for the layout)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import logging
import math
import os
import threading
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from refresh.errors import DatasetBusy, Stopped
from refresh.stores.abc import (
    RUN_HISTORY,
    VALID_FROM_COLUMN,
    CommittedState,
    DatasetStatus,
    RunRecord,
    SnapshotRows,
    StagedSnapshot,
    StateStore,
)
from refstream.atomic import write_atomic, write_bytes_atomic, write_json_atomic
from refstream.contract import DatasetSchema
from refstream.errors import TerminalError
from refstream.retry import RetryPolicy

__all__ = [
    "IPC_SUFFIX",
    "ROW_GROUP",
    "STATE_FORMAT",
    "FileStateStore",
    "IpcSnapshot",
    "open_snapshot_file",
    "snapshot_name",
    "write_snapshot",
]

log = logging.getLogger(__name__)

STATE_FORMAT = 1
_LOCK_POLL = RetryPolicy.every(0.1)  # waiting for another run of a dataset to release its lock


class FileStateStore(StateStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def dir(self, dataset: str) -> Path:
        return self.root / dataset

    # ------------------------------------------------------------------------------------- lock
    @contextlib.contextmanager
    def lock(self, dataset: str, *, wait: bool = True,
             stop: threading.Event | None = None) -> Iterator[None]:
        d = self.dir(dataset)
        d.mkdir(parents=True, exist_ok=True)
        # flock locks belong to the open file description: a second open() in this process conflicts
        # with the first just like another process does, so threads are excluded too.
        fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for attempt in _LOCK_POLL.until(math.inf, stop=stop):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not wait:
                        raise DatasetBusy(dataset) from None
                    if attempt == 1:
                        log.info("dataset %s: waiting for the refresh already running", dataset)
            else:
                raise Stopped(f"dataset {dataset}: stopped while waiting for the lock")
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {threading.current_thread().name}\n".encode())
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------ state
    def load(self, dataset: str) -> CommittedState:
        p = self.dir(dataset) / "state.json"
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return CommittedState()
        except (OSError, ValueError) as exc:
            raise TerminalError(f"dataset {dataset}: unreadable state file {p}: {exc}") from None
        schema = obj.get("schema")
        return CommittedState(
            version=int(obj.get("version", 0)),
            schema=DatasetSchema.from_json(json.dumps(schema)) if schema else None,
            snapshot=obj.get("snapshot"), rows=int(obj.get("rows", 0)),
            watermark=obj.get("watermark"), watermark_type=obj.get("watermark_type"),
            last_reconcile=obj.get("last_reconcile"), complete_as_of=obj.get("complete_as_of"),
            topic=obj.get("topic"), offsets=_offsets(dataset, p, obj.get("offsets")),
        )

    def load_snapshot(self, dataset: str, state: CommittedState) -> pa.Table | None:
        if not state.snapshot:
            return None
        p = self.dir(dataset) / state.snapshot
        try:
            return open_snapshot_file(p).read_stored()
        except (OSError, pa.ArrowException) as exc:
            raise TerminalError(f"dataset {dataset}: snapshot {p} is unreadable ({exc}); "
                                f"remove {self.dir(dataset) / 'state.json'} to start over") from None

    def open_snapshot(self, dataset: str, state: CommittedState) -> SnapshotRows | None:
        if not state.snapshot:
            return None
        p = self.dir(dataset) / state.snapshot
        try:
            return open_snapshot_file(p)
        except (OSError, pa.ArrowException) as exc:
            raise TerminalError(f"dataset {dataset}: snapshot {p} is unreadable ({exc}); "
                                f"remove {self.dir(dataset) / 'state.json'} to start over") from None

    def commit(self, dataset: str, state: CommittedState,
               snapshot: pa.Table | StagedSnapshot | None) -> CommittedState:
        d = self.dir(dataset)
        d.mkdir(parents=True, exist_ok=True)
        old = self.load(dataset).snapshot
        if snapshot is not None:
            name = snapshot_name(state.version)
            staged = snapshot.wait() if isinstance(snapshot, StagedSnapshot) else None
            if staged is not None:
                if staged != name:
                    raise ValueError(f"dataset {dataset}: staged snapshot {staged} is not version {state.version}'s")
            else:
                table = snapshot.table if isinstance(snapshot, StagedSnapshot) else snapshot
                write_atomic(d / name, lambda f: write_snapshot(table, f))
            state = CommittedState(**{**state.__dict__, "snapshot": name})
        obj = {
            "format": STATE_FORMAT, "version": state.version,
            "schema": json.loads(state.schema.to_json()) if state.schema else None,
            "snapshot": state.snapshot, "rows": state.rows, "watermark": state.watermark,
            "watermark_type": state.watermark_type, "last_reconcile": state.last_reconcile,
            "complete_as_of": state.complete_as_of, "topic": state.topic,
            "offsets": {str(p): o for p, o in sorted(state.offsets.items())} if state.offsets else None,
        }
        write_json_atomic(d / "state.json", obj)
        if isinstance(snapshot, StagedSnapshot):
            snapshot.committed = True
        # Only now is the new snapshot the committed one: remove what nothing points at any more.
        committed = _snapshot_version(state.snapshot or "")
        for p in d.glob("snapshot-*"):
            version = _snapshot_version(p.name)
            if version is None or p.name == state.snapshot:
                continue
            if p.name == old or (committed is not None and version < committed):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        for p in d.glob(".*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        return state

    def stage_snapshot(self, dataset: str, version: int, table: pa.Table,
                       valid_from: concurrent.futures.Future[pa.Array] | pa.Array | None = None) -> StagedSnapshot:
        return _StagedFile(self.dir(dataset) / snapshot_name(version), table, valid_from)

    # --------------------------------------------------------------------------------- versions
    def reserve(self, dataset: str, version: int) -> None:
        d = self.dir(dataset)
        d.mkdir(parents=True, exist_ok=True)
        write_json_atomic(d / "reserved.json", {"version": version})

    def reserved(self, dataset: str) -> int:
        p = self.dir(dataset) / "reserved.json"
        try:
            return int(json.loads(p.read_text(encoding="utf-8"))["version"])
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TerminalError(f"dataset {dataset}: unreadable version reservation {p}: {exc}") from None

    # ----------------------------------------------------------------------------------- status
    def write_status(self, dataset: str, status: DatasetStatus) -> None:
        write_json_atomic(self.dir(dataset) / "status.json", status.to_json())

    def read_status(self, dataset: str) -> DatasetStatus:
        try:
            obj = json.loads((self.dir(dataset) / "status.json").read_text(encoding="utf-8"))
            return DatasetStatus.from_json(dataset, obj)
        except FileNotFoundError:
            return DatasetStatus(dataset=dataset)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("dataset %s: unreadable status file: %s", dataset, exc)
            return DatasetStatus(dataset=dataset)

    def append_run(self, dataset: str, run: RunRecord) -> None:
        # Rewritten whole (atomically): the file is small, and a crash never leaves half a line.
        runs = [r.to_json() for r in self.read_runs(dataset)[-(RUN_HISTORY - 1):]] + [run.to_json()]
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in runs)
        write_bytes_atomic(self.dir(dataset) / "runs.jsonl", data.encode("utf-8"))

    def read_runs(self, dataset: str) -> list[RunRecord]:
        path = self.dir(dataset) / "runs.jsonl"
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("dataset %s: unreadable run history %s: %s", dataset, path, exc)
            return []
        out = []
        for n, line in enumerate(lines, 1):
            try:
                out.append(RunRecord.from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("dataset %s: %s line %d: skipped (%s)", dataset, path, n, exc)
        return out


def _offsets(dataset: str, path: Path, obj: object) -> dict[int, int] | None:
    if not obj:
        return None
    try:
        return {int(p): int(o) for p, o in obj.items()}  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        raise TerminalError(f"dataset {dataset}: state file {path}: offsets {obj!r} are not "
                            f"{{partition: offset}}") from None


def snapshot_name(version: int) -> str:
    """The file a committed snapshot of ``version`` is stored in (the Arrow IPC file format: the one
    snapshot format there is)."""
    return f"snapshot-{version:010d}{IPC_SUFFIX}"


IPC_SUFFIX = ".arrow"


def _snapshot_version(name: str) -> int | None:
    """The version in a snapshot file's name, None for another file."""
    stem, dot, suffix = name.partition(".")
    if not stem.startswith("snapshot-") or dot + suffix != IPC_SUFFIX:
        return None
    digits = stem.removeprefix("snapshot-")
    return int(digits) if digits.isdigit() else None


def open_snapshot_file(path: Path) -> IpcSnapshot:
    """A committed snapshot. Any other file than an Arrow IPC one fails (``pa.ArrowException``)."""
    return IpcSnapshot(path)


#: Rows per record batch of a snapshot: the lazy diff reads one at a time.
ROW_GROUP = 1 << 20
#: Arrow IPC with LZ4 frames compressed on pyarrow's thread pool: at 1M rows it writes in a fraction
#: of Parquet's single-threaded encoding, and reads back without decoding (docs/benchmarks.md).
_IPC_WRITE = pa.ipc.IpcWriteOptions(compression="lz4", use_threads=True)


class _Discarded(Exception):
    """A staged snapshot's write stopped because the run will not commit it."""


def write_snapshot(table: pa.Table, f: BinaryIO, stop: threading.Event | None = None) -> None:
    """``table`` as a snapshot file (Arrow IPC file format, LZ4, record batches of at most
    :data:`ROW_GROUP` rows); ``stop`` is checked between batches."""
    with pa.ipc.new_file(f, table.schema, options=_IPC_WRITE) as writer:
        for start in range(0, table.num_rows, ROW_GROUP):
            if stop is not None and stop.is_set():
                raise _Discarded
            writer.write_table(table.slice(start, ROW_GROUP), max_chunksize=ROW_GROUP)


class _StagedFile(StagedSnapshot):
    """A snapshot written to its final name in a thread of its own while the run goes on. The name
    is safe to take early: no committed state points at it (the version is above the committed
    one), and a commit of a later version removes it if this run never commits."""

    def __init__(self, path: Path, table: pa.Table,
                 valid_from: concurrent.futures.Future[pa.Array] | pa.Array | None = None) -> None:
        super().__init__(table, valid_from)
        self.path = path
        self._stop = threading.Event()
        self._done: concurrent.futures.Future[None] = concurrent.futures.Future()
        threading.Thread(target=self._write, name=f"stage-{path.name}", daemon=True).start()

    def _write(self) -> None:
        try:
            table = self.table  # waits for the valid-from column the run's diff is computing
            write_atomic(self.path, lambda f: write_snapshot(table, f, self._stop))
            self._done.set_result(None)
        except BaseException as exc:
            self._done.set_exception(exc)

    def wait(self) -> str | None:
        self._done.result()
        return self.path.name

    def discard(self) -> None:
        if self.committed:
            return
        self._stop.set()
        self._cancel()
        with contextlib.suppress(BaseException):
            self._done.result()
        self.path.unlink(missing_ok=True)


class _FileSnapshot(SnapshotRows):
    """A snapshot file read column by column on demand, or whole in the background (``prefetch``).
    The file format gives :meth:`_read`, :meth:`_parts`, :meth:`_memory_size` and :meth:`_close`,
    and sets ``schema`` (the rows' columns) and ``_stored`` (the file's, the valid-from one too)."""

    _stored: pa.Schema

    def __init__(self, path: Path) -> None:
        self.path = path
        self._prefetch: concurrent.futures.Future[pa.Table] | None = None

    @abstractmethod
    def _read(self, names: list[str] | None) -> pa.Table:
        """These columns (every stored one for None) of every row, from the file."""

    @abstractmethod
    def _parts(self, name: str) -> Iterator[pa.ChunkedArray]:
        """One column, a part (record batch) at a time, from the file."""

    @abstractmethod
    def _memory_size(self) -> int:
        """About how many bytes the whole snapshot takes in memory."""

    def _close(self) -> None:
        pass

    def prefetch(self, max_bytes: int) -> bool:
        if self._prefetch is not None or self._memory_size() > max_bytes:
            return False
        # A thread of its own, not a pool: nothing else may use the file until it is done (_whole).
        future: concurrent.futures.Future[pa.Table] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(self._read(None))
            except BaseException as exc:  # the lazy reads below meet it again, and report it
                future.set_exception(exc)

        threading.Thread(target=run, name=f"prefetch-{self.path.name}", daemon=True).start()
        self._prefetch = future
        return True

    def _whole(self) -> pa.Table | None:
        """The prefetched rows (waiting for them), or None when none were or the prefetch failed."""
        if self._prefetch is None:
            return None
        try:
            return self._prefetch.result()
        except Exception as exc:
            log.debug("prefetch of %s failed (%s); reading on demand", self.path, exc)
            self._prefetch = None
            return None

    def select(self, names: list[str]) -> pa.Table:
        whole = self._whole()
        return whole.select(list(names)) if whole is not None else self._read(list(names))

    def column(self, name: str) -> pa.ChunkedArray:
        whole = self._whole()
        return whole.column(name) if whole is not None else self._read([name]).column(0)

    def column_parts(self, name: str) -> Iterator[tuple[int, pa.ChunkedArray]]:
        """(first row, values) of one column per part of the file: the diff of a 10M-row table then
        holds one part of an old column at a time, not the whole column."""
        whole = self._whole()
        start = 0
        if whole is not None:
            for chunk in whole.column(name).chunks:  # a chunk per part: no copy
                yield start, pa.chunked_array([chunk])
                start += len(chunk)
            return
        for part in self._parts(name):
            n = len(part)
            yield start, part
            del part  # before the next part is read
            start += n

    def read(self) -> pa.Table:
        whole = self._whole()
        return whole.select(self.schema.names) if whole is not None else self._read(self.schema.names)

    def read_stored(self) -> pa.Table:
        """Every column as stored, the valid-from one included."""
        whole = self._whole()
        return whole if whole is not None else self._read(None)

    def valid_from(self) -> pa.ChunkedArray | None:
        if self._stored.get_field_index(VALID_FROM_COLUMN) < 0:
            return None
        return self.column_stored(VALID_FROM_COLUMN)

    def column_stored(self, name: str) -> pa.ChunkedArray:
        whole = self._whole()
        return whole.column(name) if whole is not None else self._read([name]).column(0)

    def close(self) -> None:
        self._whole()  # the prefetch thread reads the file until it is done
        self._close()


class IpcSnapshot(_FileSnapshot):
    """A snapshot in the Arrow IPC file format, a record batch per part. One open file serves every
    reader (positional reads), so a later commit removing the file does not matter; not
    memory-mapped, so nothing done to the file can fault the process."""

    #: Compressed bytes on disk to bytes in memory, roughly (LZ4 on typical reference data): what
    #: ``prefetch`` compares with its limit, since the file records no uncompressed size.
    EXPANSION = 4

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._source = pa.OSFile(str(path))
        reader = pa.ipc.open_file(self._source)
        self._stored = reader.schema
        i = self._stored.get_field_index(VALID_FROM_COLUMN)
        self.schema = self._stored if i < 0 else self._stored.remove(i)
        self.num_rows = reader.count_rows() if reader.num_record_batches else 0
        self._batches = reader.num_record_batches

    def _reader(self, names: list[str] | None) -> pa.ipc.RecordBatchFileReader:
        fields = None if names is None else [self._stored.get_field_index(n) for n in names]
        return pa.ipc.open_file(self._source, options=pa.ipc.IpcReadOptions(included_fields=fields))

    def _read(self, names: list[str] | None) -> pa.Table:
        table = self._reader(names).read_all()
        return table if names is None else table.select(names)  # included_fields keeps file order

    def _parts(self, name: str) -> Iterator[pa.ChunkedArray]:
        reader = self._reader([name])
        for i in range(self._batches):
            yield pa.chunked_array([reader.get_batch(i).column(0)])

    def _memory_size(self) -> int:
        return self.path.stat().st_size * self.EXPANSION

    def _close(self) -> None:
        self._source.close()

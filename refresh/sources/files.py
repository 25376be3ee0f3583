"""CSV, JSON lines and Parquet files as a source; a glob reads many files as one dataset.

Files are parsed by Arrow's native readers (multi-threaded, columnar). When a reader rejects a file,
the file is scanned again line by line only to name the line at fault, so errors read like
``dataset sites: data/sites.csv:7: expected 3 fields, got 2``.

An empty file (no bytes, or a header without rows) counts as a source that reads empty: the runner
refuses it unless the dataset allows empty snapshots, and in a glob it is refused on its own, since
one empty file among many is what a half-written export looks like.

Files are read only once they are stable, whatever triggered the run (schedule, file watcher, CLI):
every file the pattern matches must keep its size and mtime (and the set of matching files must stay
the same) for ``stable_for``; files whose last change (ctime) is already older than that are read at
once. After the read the files are looked at again, and read again once settled if a writer touched
them meanwhile. A file that never settles within ``stable_timeout`` fails the read, naming it.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from refresh.config import FileSourceConfig
from refresh.errors import EmptySnapshot, FileNotStable
from refresh.sources.abc import Progress, Source, collect
from refstream.contract import type_to_arrow
from refstream.errors import DataError

__all__ = ["FileSource", "FileStats", "stat_files"]

log = logging.getLogger(__name__)

_BLOCK = 16 << 20
_POLL = 0.1  # seconds between looks at a settling file (and between stop checks)

#: The files a pattern matches at one moment: sorted (path, inode, size, mtime_ns).
FileStats = tuple[tuple[str, int, int, int], ...]


def _stat(pattern: str) -> dict[str, os.stat_result]:
    names = glob.glob(pattern, recursive=True) if glob.has_magic(pattern) else [pattern]
    out = {}
    for name in names:
        try:
            st = os.stat(name)
        except OSError:  # vanished between glob and stat, or missing
            continue
        if os.path.isfile(name):
            out[os.path.abspath(name)] = st
    return out


def _stats(found: dict[str, os.stat_result]) -> FileStats:
    return tuple(sorted((p, st.st_ino, st.st_size, st.st_mtime_ns) for p, st in found.items()))


def stat_files(pattern: str) -> FileStats:
    """Stat every file ``pattern`` (a path or a glob) matches now; hidden files only when the pattern
    names them."""
    return _stats(_stat(pattern))


def _changed(old: FileStats, new: FileStats) -> list[str]:
    """The paths that appeared, vanished or changed between two looks."""
    a, b = {s[0]: s for s in old}, {s[0]: s for s in new}
    return sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))


class FileSource(Source):
    def __init__(self, dataset: str, cfg: FileSourceConfig) -> None:
        self.dataset = dataset
        self.cfg = cfg
        self.pattern = cfg.path
        self.types = {name: type_to_arrow(t) for name, t in cfg.types}

    def describe(self) -> str:
        return self.pattern

    def files(self) -> list[Path]:
        """The files the dataset is made of, sorted (a plain path is a one-file list)."""
        if glob.has_magic(self.pattern):
            found = sorted(Path(p) for p in glob.glob(self.pattern, recursive=True) if os.path.isfile(p))
            if not found:
                raise DataError(f"dataset {self.dataset}: no file matches {self.pattern}")
            return found
        p = Path(self.pattern)
        if not p.is_file():
            raise DataError(f"dataset {self.dataset}: file {p} not found")
        return [p]

    def read(self, progress: Progress | None = None) -> pa.Table:
        return collect(self._batches(progress), progress)

    def probe(self) -> str:
        """The matching files exist (their contents are checked by a run)."""
        found = self.files()
        size = sum(p.stat().st_size for p in found)
        return f"{len(found)} file(s), {size:,} bytes"

    def batches(self) -> Iterator[pa.RecordBatch]:
        return self._batches(None)

    def wait_stable(self, deadline: float, progress: Progress | None = None) -> FileStats:
        """The matching files once none changed for ``stable_for``; :class:`FileNotStable` naming the
        files still changing at monotonic time ``deadline``. ``progress(0)`` is called while waiting
        (the runner's stop check)."""
        interval = self.cfg.stable_for.total_seconds()
        found = _stat(self.pattern)
        now = time.time_ns()
        # ctime moves with every write and cannot be set back (unlike mtime, which tools copy):
        # files untouched for the whole interval already are settled without waiting.
        if interval <= 0 or all(now - st.st_ctime_ns >= interval * 1e9 for st in found.values()):
            return _stats(found)
        prev = _stats(found)
        moving = sorted(p for p, st in found.items() if now - st.st_ctime_ns < interval * 1e9)
        log.info("dataset %s: %s changed in the last %gs; waiting for it to settle", self.dataset,
                 ", ".join(moving), interval)
        while True:
            end = time.monotonic() + interval
            while (left := end - time.monotonic()) > 0:
                if progress is not None:
                    progress(0)
                time.sleep(min(_POLL, left))
            cur = stat_files(self.pattern)
            if cur == prev:
                return cur
            moving, prev = _changed(prev, cur), cur
            if time.monotonic() > deadline:
                raise FileNotStable(
                    f"dataset {self.dataset}: {', '.join(moving)} still changing after "
                    f"{self.cfg.stable_timeout.total_seconds():g}s (size or mtime not stable for "
                    f"{interval:g}s); not read")
            log.debug("dataset %s: still changing: %s", self.dataset, ", ".join(moving))

    def _read_stable(self, progress: Progress | None) -> tuple[list[Path], list[pa.Table]]:
        """Every file read while it held still: settled before the read and unchanged after it."""
        deadline = time.monotonic() + self.cfg.stable_timeout.total_seconds()
        while True:
            before = self.wait_stable(deadline, progress)
            started = datetime.now(UTC)
            files = self.files()
            tables: list[pa.Table] | None
            try:
                tables = [self.read_file(f) for f in files]
            except DataError:
                if stat_files(self.pattern) == before:
                    raise
                tables = None  # a writer came back during the read: read again once settled
            after = stat_files(self.pattern)
            if tables is not None and after == before:
                # The time of the read that counts (not of the wait for the files to settle): what
                # the files said then, they said throughout the read.
                self.read_started = started
                return files, tables
            moved = _changed(before, after) or [self.pattern]
            if time.monotonic() > deadline:
                raise FileNotStable(f"dataset {self.dataset}: {', '.join(moved)} changed while being read "
                                    f"for {self.cfg.stable_timeout.total_seconds():g}s; not read")
            log.info("dataset %s: %s changed while being read; reading again once settled", self.dataset,
                     ", ".join(moved))

    def _batches(self, progress: Progress | None) -> Iterator[pa.RecordBatch]:
        files, read = self._read_stable(progress)
        schema: pa.Schema | None = None
        first: Path | None = None
        tables: list[pa.Table] = []
        for f, t in zip(files, read, strict=True):
            if t.num_rows == 0 and len(files) > 1:
                raise EmptySnapshot(f"dataset {self.dataset}: {f} is empty (one of {len(files)} files "
                                    f"matching {self.pattern}); refusing a partial snapshot")
            if schema is None:
                schema, first = t.schema, f
            elif t.column_names != schema.names:
                raise DataError(f"dataset {self.dataset}: {f} has columns {t.column_names}, but {first} "
                                f"has {schema.names}")
            tables.append(t)
        try:
            table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DataError(f"dataset {self.dataset}: files matching {self.pattern} disagree on column "
                            f"types: {exc}") from None
        if table.num_rows == 0:
            yield pa.RecordBatch.from_pylist([], schema=table.schema)
            return
        yield from table.to_batches(max_chunksize=self.cfg.chunk_rows)

    # ------------------------------------------------------------------------------- one file
    def read_file(self, path: Path) -> pa.Table:
        if path.stat().st_size == 0:
            return pa.table({})
        fmt = self.cfg.format
        try:
            if fmt == "csv":
                table = self._csv(path)
                if _odd_quotes(path):
                    # Arrow takes a quote left open at the end of the file as a value running to EOF:
                    # that is a truncated file, not data.
                    raise pa.ArrowInvalid("CSV parse error: a quoted value is not closed (truncated file?)")
            elif fmt == "jsonl":
                table = self._jsonl(path)
            else:
                table = pq.read_table(path)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OSError) as exc:
            raise DataError(self._locate(path, fmt or "", exc)) from None
        return self._apply_types(path, table)

    def _csv(self, path: Path) -> pa.Table:
        return pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(block_size=_BLOCK),
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(column_types=self.types or None,
                                                 strings_can_be_null=False),
        )

    def _jsonl(self, path: Path) -> pa.Table:
        explicit = pa.schema(list(self.types.items())) if self.types else None
        return pajson.read_json(path, read_options=pajson.ReadOptions(block_size=_BLOCK),
                                parse_options=pajson.ParseOptions(explicit_schema=explicit))

    def _apply_types(self, path: Path, table: pa.Table) -> pa.Table:
        for name, t in self.types.items():
            if name in table.column_names and table.schema.field(name).type != t:
                i = table.column_names.index(name)
                try:
                    table = table.set_column(i, pa.field(name, t), table.column(i).cast(t))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise DataError(f"dataset {self.dataset}: {path}: column {name} is not {t}: {exc}") from None
        return table

    def _locate(self, path: Path, fmt: str, exc: Exception) -> str:
        """An error message naming the line at fault when one can be found."""
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"dataset {self.dataset}: {path}"
        try:
            if fmt == "csv":
                line = _csv_bad_line(path, msg)
            elif fmt == "jsonl":
                line = _jsonl_bad_line(path)
            else:
                line = None
        except (OSError, UnicodeDecodeError) as scan:
            return f"{where}: {msg} ({scan})"
        if line is not None:
            return f"{where}:{line[0]}: {line[1]}"
        return f"{where}: {msg}"


def _odd_quotes(path: Path) -> bool:
    count = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            count += chunk.count(b'"')
    return count % 2 == 1


def _csv_bad_line(path: Path, msg: str) -> tuple[int, str] | None:
    m = re.search(r"invalid value '(.*)'", msg)
    col = re.search(r"column #(\d+)", msg)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, strict=True)
        start = 1
        try:
            header = next(reader)
            start = reader.line_num + 1
            for row in reader:
                if len(row) != len(header):
                    return start, f"expected {len(header)} fields, got {len(row)}: {','.join(row)[:120]!r}"
                if m and col and int(col.group(1)) < len(row) and row[int(col.group(1))] == m.group(1):
                    return start, f"column {header[int(col.group(1))]}: {msg}"
                start = reader.line_num + 1
        except StopIteration:
            return None
        except csv.Error as exc:
            return start, f"{msg} ({exc})"
    return None


def _jsonl_bad_line(path: Path) -> tuple[int, str] | None:
    kinds: dict[str, tuple[str, int]] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                return n, f"invalid JSON: {exc}"
            if not isinstance(obj, dict):
                return n, f"expected a JSON object, got {type(obj).__name__}"
            for k, v in obj.items():
                kind = _json_kind(v)
                if kind == "null":
                    continue
                seen = kinds.setdefault(k, (kind, n))
                if seen[0] != kind and {seen[0], kind} != {"int", "float"}:
                    return n, f"field {k} is a {kind}, but a {seen[0]} on line {seen[1]}"
    return None


def _json_kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    return "list" if isinstance(v, list) else "object"

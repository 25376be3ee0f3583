"""Watch source files and call back once the events about them have stopped.

A change is reported for a dataset when, after a relevant filesystem event, no further event arrived
for ``debounce`` seconds and the matching files' (inode, size, mtime) differ from what was last
reported. That covers:

- bursts of writes (one callback, not one per write);
- editors that write a temp file and rename it over the target (the rename's destination matches);
- a file still being written (every write pushes the deadline; and at the deadline, a file modified
  less than ``debounce`` ago - its event not handled yet, on a loaded machine - pushes it again);
- reads of the file by the refresher itself (open/close-without-write events are ignored, and files
  identical to the last reported ones are not reported again).

Whether the files are complete when they are read is not decided here: every read of a file source,
whatever triggered it, waits until the files hold still (:meth:`refresh.sources.files.FileSource.wait_stable`),
which also covers writers whose events were coalesced or missed.

Paths may be globs (``data/sites-*.csv``, ``data/**/part-*.parquet``): the static directory prefix is
watched, recursively when the glob spans directories.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from watchdog.events import (
    EVENT_TYPE_ATTRIB,
    EVENT_TYPE_CLOSED,
    EVENT_TYPE_CREATED,
    EVENT_TYPE_DELETED,
    EVENT_TYPE_MODIFIED,
    EVENT_TYPE_MOVED,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from refresh.sources.files import FileStats, stat_files

__all__ = ["FileWatcher", "quiet_for", "split_pattern"]

log = logging.getLogger(__name__)

# Events that can change a file's content or presence. "opened" and "closed_no_write" are not here:
# the refresher reading the file must not trigger another refresh.
_RELEVANT = frozenset({EVENT_TYPE_CREATED, EVENT_TYPE_MODIFIED, EVENT_TYPE_MOVED, EVENT_TYPE_DELETED,
                       EVENT_TYPE_CLOSED, EVENT_TYPE_ATTRIB})


def split_pattern(pattern: str) -> tuple[Path, bool]:
    """The directory to watch for ``pattern`` (its longest glob-free prefix) and whether the glob
    reaches below it (then the watch must be recursive)."""
    parts = Path(pattern).parts
    static: list[str] = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        static.append(part)
    base = Path(*static) if static else Path(".")
    recursive = len(static) < len(parts) - 1
    return base, recursive


@dataclass
class _Watch:
    name: str
    pattern: str  # absolute
    hidden_ok: bool
    last_reported: FileStats
    deadline: float | None = None  # monotonic time at which the events are over unless more come
    waiting_logged: bool = False

    def matches(self, path: str) -> bool:
        if not self.hidden_ok and os.path.basename(path).startswith("."):
            return False
        return fnmatchcase(os.path.abspath(path), self.pattern)


class FileWatcher:
    """Calls ``on_change(name)`` from its own thread when a watched pattern's files have settled.

    ``add()`` every pattern, then ``start()``; ``stop()`` (or the context manager) joins the threads.
    ``on_change`` must be quick (schedule work, don't do it) and never raise.
    """

    def __init__(self, on_change: Callable[[str], None], *, debounce: float = 2.0) -> None:
        if debounce <= 0:
            raise ValueError("debounce must be positive")
        self.debounce = debounce
        self._on_change = on_change
        self._watches: dict[str, _Watch] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._observer = Observer()
        self._thread = threading.Thread(target=self._loop, name="refresh-watch-debounce", daemon=True)
        self._scheduled: set[tuple[str, bool]] = set()

    def add(self, name: str, pattern: str | os.PathLike[str]) -> None:
        """Watch the file or glob ``pattern`` on behalf of ``name`` (a dataset)."""
        pattern = os.path.abspath(os.fspath(pattern))
        base, recursive = split_pattern(pattern)
        if not base.is_dir():
            raise FileNotFoundError(f"cannot watch {pattern}: directory {base} does not exist")
        watch = _Watch(name, pattern, os.path.basename(pattern).startswith("."), stat_files(pattern))
        with self._cond:
            self._watches[name] = watch
        # One watch per (directory, recursive); events are dispatched to every pattern that matches.
        key = (str(base), recursive)
        if key not in self._scheduled:
            self._observer.schedule(_Handler(self), str(base), recursive=recursive)
            self._scheduled.add(key)
        log.info("watching %s for dataset %s (%s%s)", pattern, name, base,
                 ", recursive" if recursive else "")

    def start(self) -> FileWatcher:
        self._observer.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._observer.is_alive():
            self._observer.stop()
            self._observer.join(10)
        if self._thread.is_alive():
            self._thread.join(10)

    def __enter__(self) -> FileWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------ internals

    def _event(self, event: FileSystemEvent) -> None:
        if event.event_type not in _RELEVANT or event.is_directory:
            return
        paths = [os.fsdecode(event.src_path)]
        if event.event_type == EVENT_TYPE_MOVED and event.dest_path:
            paths.append(os.fsdecode(event.dest_path))
        now = time.monotonic()
        with self._cond:
            hit = False
            for w in self._watches.values():
                if any(w.matches(p) for p in paths):
                    w.deadline = now + self.debounce
                    hit = True
                    log.debug("%s: %s %s", w.name, event.event_type, paths[-1])
            if hit:
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                now = time.monotonic()
                due = [w for w in self._watches.values() if w.deadline is not None and w.deadline <= now]
                if not due:
                    deadlines = [w.deadline for w in self._watches.values() if w.deadline is not None]
                    self._cond.wait(min(deadlines) - now if deadlines else None)
                    continue
                for w in due:
                    w.deadline = None
            for w in due:  # stat outside the lock: a large glob must not block the event thread
                self._check(w)

    def _check(self, w: _Watch) -> None:
        current = stat_files(w.pattern)
        if not current:
            if not w.waiting_logged:
                log.warning("dataset %s: no file matches %s; waiting for one to appear", w.name, w.pattern)
                w.waiting_logged = True
            w.last_reported = current
            return
        w.waiting_logged = False
        if current == w.last_reported:
            log.debug("dataset %s: files unchanged after events; not refreshing", w.name)
            return
        quiet = quiet_for(current, time.time_ns())
        if quiet < self.debounce:
            # Written since the last event arrived: its event is late (the observer's thread waits for
            # the CPU on a loaded machine), and the write still goes on. Wait a debounce from the write.
            with self._cond:
                if w.deadline is None:
                    w.deadline = time.monotonic() + self.debounce - quiet
                    self._cond.notify_all()
            return
        w.last_reported = current
        log.info("dataset %s: %s changed (%d file(s), no event for %.1fs)", w.name, w.pattern,
                 len(current), self.debounce)
        try:
            self._on_change(w.name)
        except Exception:
            log.exception("dataset %s: change callback failed", w.name)


def quiet_for(files: FileStats, now_ns: int) -> float:
    """Seconds since the newest modification time of ``files`` at the wall clock ``now_ns``; a time in
    the future (another machine's clock, a ``touch -d``) counts as long ago, so it cannot hold a
    change back."""
    ages = [now_ns - mtime for *_, mtime in files if mtime <= now_ns]
    return min(ages) / 1e9 if ages else float("inf")


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: FileWatcher) -> None:
        self._watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._watcher._event(event)

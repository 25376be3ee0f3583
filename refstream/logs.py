"""Logging setup of the entry points (CLIs, demo, benchmarks); library modules only log.

Every module logs through ``logging.getLogger(__name__)``; handlers are attached here and only by
``main()`` functions, so that an application or a test embedding refstream keeps its own setup.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, get_args

__all__ = ["CHATTY", "FORMAT", "LOG_FORMATS", "JsonFormatter", "LogFormat", "RepeatSuppressor", "line_key",
           "setup_logging"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Libraries that log every request at INFO/DEBUG (APScheduler: every job added, run and removed,
#: which the daemon's own lines already say); kept at WARNING.
CHATTY = ("py4j", "urllib3", "apscheduler")
#: ``--log-format`` of the CLIs: lines for people, or one JSON object per line for log collectors.
LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (ISO 8601, UTC, milliseconds), ``level``,
    ``logger``, ``message`` (arguments applied), and ``exc`` (the formatted traceback) when the record
    carries exception info, ``stack`` when it carries a stack."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, str] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # json escapes newlines inside strings: a traceback stays on the record's one line.
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(level: int | str = logging.INFO, *, debug: bool = False,
                  file: str | os.PathLike[str] | None = None, fmt: str = FORMAT,
                  quiet: Iterable[str] = CHATTY, force: bool = False, log_format: LogFormat = "text") -> None:
    """Send log records to stderr (or append them to ``file``) at ``level`` (``DEBUG`` when ``debug``),
    as text lines in ``fmt`` or, with ``log_format="json"``, as :class:`JsonFormatter` objects.

    Like :func:`logging.basicConfig`, this does nothing when the root logger has handlers already
    (e.g. under pytest), unless ``force`` replaces them."""
    if debug:
        level = logging.DEBUG
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    if force or not logging.getLogger().handlers:  # no handler opened (no file created) otherwise
        handler: logging.Handler = logging.FileHandler(os.fspath(file)) if file is not None \
            else logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(fmt))
        logging.basicConfig(level=level, handlers=[handler], force=force)
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)


# What makes two occurrences of one line differ: client instance names (``rdkafka#producer-7``) and
# free-standing numbers (timings ``after 3ms``, ``0.12ms``, counts ``1/1``). Numbers inside an address
# (``127.0.0.1:9092``, ``kafka-1:9092``) touch a ``.``, ``:``, ``-`` or a letter and are kept: two
# brokers' failures stay two lines.
# librdkafka's own suppression (``..., 3 identical error(s) suppressed)``) is a repeat of the line
# without it.
_CLIENT = re.compile(r"(#(?:producer|consumer)-)\d+")
_NUMBER = re.compile(r"(?<![\w.:-])\d+(?:\.\d+)?(?:ms|us|s)?(?![\w.:])")
_SUPPRESSED = re.compile(r", (\d+) identical error\(s\) suppressed\)")


def line_key(text: str) -> str:
    """``text`` with its volatile numbers replaced by ``#``: lines with the same key are one line
    repeated, for :class:`RepeatSuppressor`."""
    return _NUMBER.sub("#", _CLIENT.sub(r"\1#", _SUPPRESSED.sub(")", text)))


@dataclass(frozen=True)
class _Window:
    start: float        # when the line was first let through (or the last count logged)
    repeats: int        # occurrences held back since
    level: int
    text: str           # the latest occurrence


class RepeatSuppressor:
    """A front for ``logger`` that logs a line the first time and, while it repeats within ``window``
    seconds, counts it instead; once the window has passed it logs the latest occurrence once more,
    with ``(repeated N times in the last 60 s)``, and counts on. A line that did not repeat in its
    window is forgotten. Lines are the same when their level and :func:`line_key` are.

    It has the ``log(level, msg, *args)`` of a :class:`logging.Logger`, which is what confluent-kafka's
    ``logger`` client setting calls, so the lines keep the logger's level and handlers (format).
    :meth:`flush` logs the counts of windows that have passed: call it every second or so, since a
    line that stops repeating brings no call of its own. Thread-safe."""

    def __init__(self, logger: logging.Logger, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.window, self._clock = logger, window, clock
        self._windows: dict[tuple[int, str], _Window] = {}
        self._lock = threading.Lock()

    def log(self, level: int, msg: str, *args: object) -> None:
        """Log ``msg % args`` at ``level``, or count it if it repeats a line of the current window."""
        if not self.logger.isEnabledFor(level):
            return  # a line nobody sees is not counted either
        text = msg % args if args else msg
        key = (level, line_key(text))
        # A repeat carrying librdkafka's own count of the repeats it held back stands for them too (a
        # loaded machine makes librdkafka hold back more); the count logged later includes them, so
        # the line kept for it drops librdkafka's note. A first line is logged with its note.
        held = _SUPPRESSED.search(text)
        now = self._clock()
        with self._lock:
            due = self._take_due(now)
            w = self._windows.get(key)
            if w is None:
                self._windows[key] = _Window(now, 0, level, text)
            else:
                self._windows[key] = _Window(w.start, w.repeats + 1 + (int(held.group(1)) if held else 0), level,
                                             _SUPPRESSED.sub(")", text))
        self._emit(due)
        if w is None:
            self.logger.log(level, "%s", text)

    def flush(self, *, everything: bool = False) -> None:
        """Log the count of every window that has passed (``everything``: of every window, as at exit)."""
        now = self._clock()
        with self._lock:
            due = self._take_due(now, everything=everything)
        self._emit(due)

    def _take_due(self, now: float, *, everything: bool = False) -> list[tuple[_Window, float]]:
        """Windows to report (with the seconds they covered); each one with repeats starts anew."""
        due = []
        for key, w in list(self._windows.items()):
            if now - w.start < self.window and not everything:
                continue
            if w.repeats:
                due.append((w, min(now - w.start, self.window)))
                self._windows[key] = _Window(now, 0, w.level, w.text)
            else:
                del self._windows[key]
        return due

    def _emit(self, due: list[tuple[_Window, float]]) -> None:
        for w, span in due:
            self.logger.log(w.level, "%s (repeated %d time%s in the last %d s)", w.text, w.repeats,
                            "" if w.repeats == 1 else "s", max(1, round(span)))

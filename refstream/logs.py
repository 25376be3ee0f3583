"""Logging setup of the entry points (CLIs, demo, benchmarks); library modules only log.

Every module logs through ``logging.getLogger(__name__)``; handlers are attached here and only by
``main()`` functions, so that an application or a test embedding refstream keeps its own setup.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Literal, get_args

__all__ = ["CHATTY", "FORMAT", "LOG_FORMATS", "JsonFormatter", "LogFormat", "setup_logging"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Libraries that log every request at INFO/DEBUG; kept at WARNING.
CHATTY = ("py4j", "urllib3")
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

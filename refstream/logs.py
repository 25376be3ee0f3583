"""Logging setup of the entry points (CLIs, demo, benchmarks); library modules only log.

Every module logs through ``logging.getLogger(__name__)``; handlers are attached here and only by
``main()`` functions, so that an application or a test embedding refstream keeps its own setup.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Libraries that log every request at INFO/DEBUG; kept at WARNING.
CHATTY = ("py4j", "urllib3")


def setup_logging(level: int | str = logging.INFO, *, debug: bool = False,
                  file: str | os.PathLike[str] | None = None, fmt: str = FORMAT,
                  quiet: Iterable[str] = CHATTY, force: bool = False) -> None:
    """Send log records to stderr (or append them to ``file``) at ``level`` (``DEBUG`` when ``debug``).

    Like :func:`logging.basicConfig`, this does nothing when the root logger has handlers already
    (e.g. under pytest), unless ``force`` replaces them."""
    if debug:
        level = logging.DEBUG
    if file is not None:
        logging.basicConfig(level=level, format=fmt, filename=os.fspath(file), force=force)
    else:
        logging.basicConfig(level=level, format=fmt, stream=sys.stderr, force=force)
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)

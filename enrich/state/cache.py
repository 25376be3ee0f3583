"""An executor-local copy of each bucket's device table, so that a batch need not read it back.

A bucket's device table is about 1.4 MB at 1M devices and 64 buckets; reading it back from Spark's
state store at every batch was a large part of what the state costs (docs/benchmarks.md). The
state store stays the only truth (a base and the changes since: ``enrich.state.processor``); this
cache spares the read. Each store writes the whole new table to a local file named by a new token,
and the token to a small state value in the same commit. A call reads the token (a few bytes) and,
when this machine has the file, the table from it; else (another executor stored it, a new run, a
retried task whose attempt before replaced the file) from the state store. A token is a random
UUID, never reused: a file names one version's table, so a hit is exact whatever happened in
between, and a miss costs only the read it would have cost anyway.

The files live in ``<first of SPARK_LOCAL_DIRS, else the temp dir>/refstream-state/<run>``, one per
bucket this executor stored last (the previous one is removed with each store); ``run`` is new for
every start of the job, which removes its directory on the driver's machine when it stops.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from refstream.atomic import write_bytes_atomic

log = logging.getLogger(__name__)

#: Where Spark tells its Python workers to keep local files (the executor's local directories).
LOCAL_DIRS = "SPARK_LOCAL_DIRS"


@dataclass(frozen=True)
class TableCache:
    """Files of stored bucket tables by token, under a directory of this job run. Picklable."""

    run: str

    def directory(self) -> Path:
        roots = os.environ.get(LOCAL_DIRS, "")
        root = roots.split(",")[0] if roots else tempfile.gettempdir()
        return Path(root) / "refstream-state" / self.run

    def get(self, token: str) -> bytes | None:
        """The bytes stored under ``token``; None when this machine does not have them."""
        try:
            return (self.directory() / token).read_bytes()
        except OSError:
            return None

    def put(self, token: str, data: bytes, previous: str | None = None) -> None:
        """Keep ``data`` under ``token`` and let ``previous`` go. A failure only costs later reads."""
        try:
            # Not fsynced: a file lost to a crash is a miss, and a restart starts another run.
            write_bytes_atomic(self.directory() / token, data, durable=False)
        except OSError as exc:
            log.warning("state table cache %s: cannot write (%s); the tables are read from the state store",
                        self.directory(), exc)
        if previous is not None:
            self.drop(previous)

    def drop(self, token: str) -> None:
        try:
            (self.directory() / token).unlink(missing_ok=True)
        except OSError:
            pass

    def remove(self) -> None:
        """Remove this run's directory (on the machine this runs on)."""
        shutil.rmtree(self.directory(), ignore_errors=True)

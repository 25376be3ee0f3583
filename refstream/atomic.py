"""Atomic file replacement: write a temporary file beside the target, fsync, rename, fsync the dir.

Shared by the refresher's state store and daemon and by the job's version log and Parquet sink."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["fsync_dir", "write_atomic", "write_bytes_atomic", "write_json_atomic"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[BinaryIO], None], *, durable: bool = True) -> None:
    """Call ``write`` on a temporary file and move it over ``path`` once it is on disk. With
    ``durable=False`` nothing is fsynced: readers still see the old file or the whole new one, but
    a machine crash may lose the write (for caches that a restart does not read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    def write(f: BinaryIO) -> None:
        f.write(data)

    write_atomic(path, write, durable=durable)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8"))

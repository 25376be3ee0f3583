"""The responses one bucket's calls received in one micro-batch, kept in the checkpoint
(``CheckpointLayout.call_record``) so that a replay of the batch reuses them instead of calling again.

Written once the bucket's calls have ended and before the bucket's output rows leave the state
step, so before the slot writes any of them. The first attempt to record a bucket's responses wins:
the file is linked into place (``os.link`` fails if it exists, also on shared file systems where
the executors of a cluster write it), and an attempt that finds it there adopts what it holds."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from enrich.calls.client import Outcome
from refstream.atomic import fsync_dir

__all__ = ["read_record", "write_record"]


def read_record(path: Path) -> dict[str, Outcome]:
    """The outcomes recorded at ``path`` by Idempotency-Key ({} when none were)."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    return {k: Outcome.from_json(v) for k, v in data.items()}


def write_record(path: Path, outcomes: Mapping[str, Outcome]) -> dict[str, Outcome]:
    """Record ``outcomes`` durably at ``path`` unless another attempt has; returns the outcomes
    recorded there (the other attempt's where it recorded first, ``outcomes`` added to them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    kept = dict(outcomes)
    try:
        _write(fd, kept)
        try:
            os.link(tmp, path)
        except FileExistsError:
            there = read_record(path)
            if set(kept) <= set(there):
                return there
            kept = {**kept, **there}  # theirs win: never two responses for one call
            _write(os.open(tmp, os.O_WRONLY | os.O_TRUNC), kept)
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(path.parent)
    return kept


def _write(fd: int, outcomes: Mapping[str, Outcome]) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps({k: o.to_json() for k, o in sorted(outcomes.items())}).encode())
        f.flush()
        os.fsync(f.fileno())

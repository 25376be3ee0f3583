"""Which of a micro-batch's new versions of an as-of dataset correct events the job already wrote.

An event is joined with the version of its key valid at its time (:mod:`enrich.joins.asof`). A
version that reaches the job late - its ``valid_from`` earlier than events already written with
the version before it - makes those events wrong. Per changelog record the batch brought
(:class:`Entry`), :func:`changes` says which events it concerns: those of its key with a time in
``[start, end)``, where ``end`` is the key's next version's ``valid_from`` and ``start`` its own (or
no bound when it is the key's oldest version: older events are clipped to it), and whether it
changes them at all:

- ``timely``: no event written before it can be in its span (its start is later than every event
  time the job has seen: the watermark plus its delay): the common, on-time change; nothing to do;
- ``unchanged``: the version those events were joined with (the one valid at ``valid_from`` before
  the batch) has the same joined columns and is as absent or present: nothing to correct;
- ``beyond_horizon``: its ``valid_from`` is before the horizon's start: the events from that start
  on are corrected, the older ones cannot be (the job keeps nothing of them) and are counted;
- ``corrected``: every affected event within the horizon is corrected.

When the state before the batch is not known (a job restarted after the records were read at its
start), every version is taken as a change: a correction may then repeat what was written.
Of a key's records with one ``valid_from`` in a batch, the last in the changelog is the version.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from enrich.columns import DELETED, KEY_BYTES, VALID_FROM
from enrich.ipc import to_ipc
from refstream import contract
from refstream.atomic import write_bytes_atomic

log = logging.getLogger(__name__)

__all__ = ["CHANGE_COLUMNS", "NO_BOUND_END", "NO_BOUND_START", "QUIET", "BatchChanges", "Entry", "Result", "changes",
           "changes_file",
           "warn_beyond"]

#: ``start`` of a change with no lower bound, ``end`` of one with no upper bound (microseconds).
NO_BOUND_START, NO_BOUND_END = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)

Result = Literal["corrected", "beyond_horizon", "unchanged", "timely"]
#: The results that correct nothing (left out by the state step, and ``timely`` not counted).
QUIET = ("unchanged", "timely")

#: The columns of :func:`changes`' table besides the dataset's key columns.
CHANGE_COLUMNS = (KEY_BYTES, "valid_from", "start", "end", "partition", "offset", "result")


@dataclass(frozen=True)
class Entry:
    """One changelog record of a key a batch applied: its key bytes, ``valid_from`` (UTC
    microseconds), tombstone or not, and where it is in the changelog."""

    key: bytes
    valid_from: int
    deleted: bool
    partition: int
    offset: int


def _by_key(versions: pa.Table | None) -> dict[bytes, list[tuple[int, int]]]:
    """key -> [(valid_from, row)] sorted by time, one per time: the last in changelog order."""
    out: dict[bytes, dict[int, int]] = {}
    if versions is None or versions.num_rows == 0:
        return {}
    keys = versions.column(KEY_BYTES).to_pylist()
    vfs = versions.column(VALID_FROM).to_numpy(zero_copy_only=False)
    for row, (k, vf) in enumerate(zip(keys, vfs, strict=True)):
        out.setdefault(k, {})[int(vf)] = row
    return {k: sorted(v.items()) for k, v in out.items()}


def _valid_at(versions: list[tuple[int, int]], at: int) -> int | None:
    """The row of the version the as-of join gives an event at ``at``: the latest at or before it,
    else the oldest (clipped); None when the key has none."""
    if not versions:
        return None
    times = [t for t, _ in versions]
    i = int(np.searchsorted(times, at, side="right")) - 1
    return versions[max(i, 0)][1]


def _equal(a: Any, b: Any) -> bool:
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)  # NaN: NaN


def _same(old: dict[str, Any], new: dict[str, Any], columns: Sequence[str]) -> bool:
    if bool(old[DELETED]) != bool(new[DELETED]):
        return False
    return bool(new[DELETED]) or all(_equal(old.get(c), new.get(c)) for c in columns)


def changes(entries: Sequence[Entry], new: pa.Table, old: pa.Table | None, key: Sequence[str],
            columns: Sequence[str], horizon_start: int, seen_until: int | None = None) -> pa.Table:
    """The corrections ``entries`` (one batch's records of one dataset, in changelog order) call for.

    ``new``: the versions of their keys after the batch, ``old``: before it (None: not known), both
    as :func:`enrich.dimension.history.version_table` gives them (in changelog order); ``key`` the
    dataset's key columns, ``columns`` the joined ones; ``horizon_start``: the earliest event time
    (UTC microseconds) still corrected; ``seen_until``: no event written so far is later than this
    (None: not known). One row per version (see the module doc): the key columns,
    :data:`CHANGE_COLUMNS`."""
    new_by, old_by = _by_key(new), _by_key(old)
    new_rows = new.to_pylist()
    old_rows = old.to_pylist() if old is not None else []
    last = {(e.key, e.valid_from): i for i, e in enumerate(entries)}
    picked: list[tuple[Entry, dict[str, Any], int, int, Result]] = []
    for i, e in enumerate(entries):
        if last[(e.key, e.valid_from)] != i:
            continue  # a later record of this key and time replaced it in the same batch
        versions = new_by.get(e.key, [])
        at = next((r for t, r in versions if t == e.valid_from), None)
        if at is None:  # pruned already (older than the join's history): nothing is joined with it
            continue
        times = [t for t, _ in versions]
        pos = times.index(e.valid_from)
        start = e.valid_from if pos > 0 else NO_BOUND_START
        end = times[pos + 1] if pos + 1 < len(times) else NO_BOUND_END
        result: Result = "corrected"
        if seen_until is not None and start != NO_BOUND_START and start > seen_until:
            result = "timely"
        elif old is not None:
            was = _valid_at(old_by.get(e.key, []), e.valid_from)
            if was is not None and _same(old_rows[was], new_rows[at], columns):
                result = "unchanged"
        if result == "corrected" and e.valid_from < horizon_start:
            result = "beyond_horizon"
        picked.append((e, new_rows[at], start, end, result))
    data: dict[str, list[Any]] = {k: [row[k] for _, row, _, _, _ in picked] for k in key}
    data[KEY_BYTES] = [e.key for e, _, _, _, _ in picked]
    data["valid_from"] = [e.valid_from for e, _, _, _, _ in picked]
    data["start"] = [s for _, _, s, _, _ in picked]
    data["end"] = [x for _, _, _, x, _ in picked]
    data["partition"] = [e.partition for e, _, _, _, _ in picked]
    data["offset"] = [e.offset for e, _, _, _, _ in picked]
    data["result"] = [r for _, _, _, _, r in picked]
    fields = [new.schema.field(k) for k in key] + _FIELDS
    return pa.Table.from_pydict(data, schema=pa.schema(fields))


def changes_file(directory: str | Path, batch_id: int, dataset: str) -> Path:
    """Where batch ``batch_id``'s changes of ``dataset`` are kept (written before the batch runs)."""
    return Path(directory) / f"{batch_id}.{dataset}.arrow"


@dataclass(frozen=True)
class Corrected:
    """A dataset whose late versions correct written events: its key columns, the joined columns
    and the horizon (microseconds behind the watermark)."""

    dataset: str
    key: tuple[str, ...]
    columns: tuple[str, ...]
    horizon_us: int


class BatchChanges:
    """The driver's part: each batch's changes of every corrected dataset written to ``directory``
    before the batch runs (a replay finds them there and runs with the same), counted per result,
    and a change reaching before the horizon logged once per dataset and run. The last ``keep``
    batches' files are kept."""

    def __init__(self, corrected: Sequence[Corrected], directory: Path, delay_us: int, keep: int = 100) -> None:
        self.corrected, self.dir, self.delay_us, self.keep = tuple(corrected), directory, delay_us, keep
        self.dir.mkdir(parents=True, exist_ok=True)
        #: The datasets a change before the horizon was logged for this run (:func:`warn_beyond`).
        self.warned: set[str] = set()
        #: (dataset, result) -> versions counted by the last :meth:`record` (none for a batch found written).
        self.counts: Counter[tuple[str, str]] = Counter()

    def record(self, batch_id: int, journals: Mapping[str, Any], replay: bool, watermark_ms: int | None) -> None:
        """Write batch ``batch_id``'s changes from the pin's ``journals`` (``HistoryState.end_journal``
        per dataset), unless the batch is a replay whose changes are written already. ``watermark_ms``:
        the batch's (Spark's offset log; 0 or None: none yet)."""
        self.counts = Counter()
        for c in self.corrected:
            path = changes_file(self.dir, batch_id, c.dataset)
            if replay and path.exists():
                continue
            if replay:
                log.warning("batch %d: the changes of dataset %s recorded for it are missing (%s); the batch runs with "
                            "those of its pin now", batch_id, c.dataset, path)
            entries, new, old = journals.get(c.dataset, ([], None, None))
            wm = watermark_ms * 1000 if watermark_ms else None
            start = NO_BOUND_START if wm is None else wm - c.horizon_us
            if new is None:
                table = pa.schema([pa.field(k, pa.null()) for k in c.key] + _FIELDS).empty_table()
            else:
                table = changes(entries, new, old, c.key, c.columns, start,
                                wm + self.delay_us if wm is not None else None)
            write_bytes_atomic(path, to_ipc(table))
            results = table.column("result").to_pylist()
            self.counts.update((c.dataset, r) for r in results if r != "timely")
            if "beyond_horizon" in results:
                at = results.index("beyond_horizon")
                warn_beyond(c.dataset, table.column(KEY_BYTES)[at].as_py().decode("utf-8", "replace"),
                            table.column("valid_from")[at].as_py(), start, self.warned)
        for f in self.dir.glob("*.arrow"):
            if int(f.name.split(".", 1)[0]) <= batch_id - self.keep:
                f.unlink(missing_ok=True)


def warn_beyond(dataset: str, key: str, valid_from: int, start: int, warned: set[str]) -> None:
    """Log, once per dataset (``warned``: the datasets logged so far this run), that ``key`` changed
    as of ``valid_from``, before the horizon's ``start`` (both UTC microseconds)."""
    if dataset in warned:
        return
    warned.add(dataset)
    log.warning("dataset %s: key %s changed as of %s, before the corrections' horizon (from %s): the events older "
                "than the horizon keep what they were written with (logged once per dataset and run)", dataset, key,
                contract.format_time(_time(valid_from)), contract.format_time(_time(start)))


_FIELDS = [pa.field(KEY_BYTES, pa.binary()), pa.field("valid_from", pa.int64()), pa.field("start", pa.int64()),
           pa.field("end", pa.int64()), pa.field("partition", pa.int32()), pa.field("offset", pa.int64()),
           pa.field("result", pa.string())]


def _time(us: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=us)

"""One bucket's devices, one micro-batch of their events: gaps opened, closed and retracted.

Pure (no Spark): the state step calls :func:`advance` once per bucket and micro-batch (every bucket,
every trigger: the tick source) with the bucket's gap table, its events and the time each source
partition has reached. Semantics (docs/gaps.md):

* A device's *threshold* is ``last_seen + after x expected_every`` (the interval its latest event
  carried: as of that event's time with an as-of join). A gap **opens** when the time the device's
  partition has reached (the greatest event time read from it, any device's: :class:`PartitionTimes`)
  is at or past the threshold: the device is silent while the others on its partition are not. A
  partition that goes quiet opens no gap.
* A gap **closes** when the device reports after the threshold; two events of a device further apart
  than its threshold are a gap that opened and closed (a backlog read at once).
* A gap is **retracted** when events arrive that show the device was not silent: an event within
  the threshold of the open gap's start withdraws it (a new one opens from the new ``last_seen`` if
  the partition is past that threshold too); an event inside a closed gap withdraws it, and its parts
  still longer than the threshold are gaps of their own (opened and closed).
* Every event with a key and a time counts, late ones too (the device spoke then); dead letters do
  not. A device whose latest interval is null (no reference row, or a null value) gets no gap and is
  counted. A device's row goes when the watermark passes ``last_seen + ttl`` (the state's); a gap
  open then stays open in the output.

``gap_id`` is a hash of the device's key and the gap's start (and end, for a part of a split gap):
the same records on a replay, and a retraction names what it withdraws.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["KINDS", "RESERVED", "TIMES_PROPERTY", "Advanced", "GapSpec", "advance", "every_us", "gap_id", "partition_times", "records"]

#: The records' kinds: a device's gap, and a source partition's silence.
KINDS = ("opened", "closed", "retracted", "source_idle", "source_resumed")
KEY, TS, PARTITION, EVERY = "_key", "_ts", "_partition", "_every"
LAST, OPEN, OPENED_AT, START, END = "last_seen", "gap_id", "opened_at", "start", "end"
_US = pa.timestamp("us", tz="UTC")
#: Names the records and the engine's tables use for their own fields: a reference column or a
#: ``state.key`` of one of these names is refused at planning (a join's ``prefix:`` renames it).
RESERVED = frozenset({KEY, TS, PARTITION, EVERY, "gap_id", "kind", "last_seen", "expected_every_s", "opened_at",
                      "start", "end", "duration_s", "topic", "partition", "since", "at"})
#: The Spark local property the driver sets for a batch's tasks when the job has ``gaps:``: JSON
#: ``{"times": {partition: time}, "now_us": the batch's time}``: the greatest event time
#: (microseconds) each source partition reached in the batches before, recorded in the checkpoint,
#: and the batch's wall-clock time from Spark's offset log, so that a replay judges alike.
TIMES_PROPERTY = "refstream.gaps.times"


@dataclass(frozen=True)
class GapSpec:
    """What the engine needs, resolved against the events reaching the state step; picklable.
    ``key``: the state key's column (named so in the records), ``after``: intervals of silence that
    open a gap, ``every_us``: a fixed interval, else ``every_column`` (seconds or an interval),
    ``refs``: the device's reference columns the records carry (its latest event's values),
    ``ttl_us``: the state's ttl, ``topic``: the events topic (the source records')."""

    key: str
    key_type: pa.DataType
    after: float
    every_us: int | None = None
    every_column: str | None = None
    refs: tuple[tuple[str, pa.DataType], ...] = ()
    ttl_us: int = 0
    topic: str = ""

    def event_schema(self) -> pa.Schema:
        """The events :func:`advance` takes."""
        return pa.schema([pa.field(KEY, self.key_type), pa.field(TS, pa.int64()), pa.field(PARTITION, pa.int32()),
                          pa.field(EVERY, pa.int64()), *[pa.field(n, t) for n, t in self.refs]])

    def table_schema(self) -> pa.Schema:
        """A bucket's devices: one row each, the open gap's id and time when one is open."""
        return pa.schema([pa.field(KEY, self.key_type), pa.field(PARTITION, pa.int32()), pa.field(LAST, pa.int64()),
                          pa.field(EVERY, pa.int64()), pa.field(OPEN, pa.string()), pa.field(OPENED_AT, pa.int64()),
                          *[pa.field(n, t) for n, t in self.refs]])

    def closed_schema(self) -> pa.Schema:
        """A bucket's closed gaps that events may still split (within ``ttl`` of their end)."""
        return pa.schema([pa.field(KEY, self.key_type), pa.field(OPEN, pa.string()), pa.field(START, pa.int64()),
                          pa.field(END, pa.int64()), pa.field(EVERY, pa.int64()), pa.field(PARTITION, pa.int32()),
                          *[pa.field(n, t) for n, t in self.refs]])

    def record_schema(self) -> pa.Schema:
        """The records written (one wide shape: the fields a kind does not have are null)."""
        return pa.schema([pa.field("gap_id", pa.string(), False), pa.field("kind", pa.string(), False),
                          pa.field(self.key, self.key_type), pa.field("last_seen", _US),
                          pa.field("expected_every_s", pa.float64()), pa.field("opened_at", _US),
                          pa.field("start", _US), pa.field("end", _US), pa.field("duration_s", pa.float64()),
                          pa.field("topic", pa.string()), pa.field("partition", pa.int32()),
                          pa.field("since", _US), pa.field("at", _US),
                          *[pa.field(n, t) for n, t in self.refs if n != self.key]])

    def threshold(self, every_us: int) -> int:
        """How long a silence opens a gap, in microseconds."""
        return int(math.ceil(self.after * every_us))


@dataclass(frozen=True)
class Advanced:
    """:func:`advance`'s result: the bucket's new tables, the batch's records (in a fixed order),
    the devices with events whose interval is null and the partitions' times the events reached."""

    table: pa.Table
    closed: pa.Table
    records: pa.Table
    no_interval: int
    #: The greatest time the events brought each partition to (capped at the batch's time): the
    #: bucket's report to the driver, which carries the partitions' times to the next batch.
    reached: dict[int, int] = dataclasses.field(default_factory=dict)


def gap_id(key: Any, start_us: int, end_us: int | None = None) -> str:
    """A gap's stable id: its device and start (and end: a part of a split gap), hashed from a
    canonical text of the key (not ``repr``, which for a timestamp names its time zone's library)."""
    text = f"{_canonical(key)}|{start_us}" + (f"|{end_us}" if end_us is not None else "")
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def _canonical(key: Any) -> str:
    if isinstance(key, tuple):
        return "(" + ",".join(_canonical(k) for k in key) + ")"
    if isinstance(key, str):
        return "s:" + key
    if isinstance(key, bytes):
        return "b:" + key.hex()
    if isinstance(key, bool):
        return "o:" + str(int(key))
    if isinstance(key, int):
        return "i:" + str(key)
    if isinstance(key, datetime):
        aware = key if key.tzinfo is not None else key.replace(tzinfo=UTC)
        return "t:" + str(int(round(aware.timestamp() * 1_000_000)))
    if isinstance(key, date):
        return "d:" + key.isoformat()
    return f"{type(key).__name__}:{key}"


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A stored gap table as ``schema``: kept under another plan (the joins before the step added,
    dropped or retyped a reference column), a column it lacks is null, one ``schema`` lacks left
    out, a type cast (null where the cast cannot be made)."""
    if table.schema == schema:
        return table
    out = []
    for f in schema:
        if f.name not in table.column_names:
            out.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        try:
            out.append(col.cast(f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            out.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(out, schema=schema)


def partition_times(pinned: Mapping[int, int], events: pa.Table, now_us: int | None = None) -> dict[int, int]:
    """The time each partition has reached: ``pinned`` (the batches before, recorded by the driver)
    and the greatest time of ``events`` per partition, each taken at most ``now_us`` (the batch's
    wall-clock time): a device whose clock runs ahead moves its partition no further than now, so it
    opens no gap for the others on it."""
    out = dict(pinned)
    if events.num_rows:
        ts = events.column(TS) if now_us is None else pc.min_element_wise(events.column(TS), pa.scalar(now_us))
        got = pa.table({PARTITION: events.column(PARTITION), TS: ts}).group_by(
            PARTITION, use_threads=False).aggregate([(TS, "max")])
        for p, t in zip(got.column(PARTITION).to_pylist(), got.column(f"{TS}_max").to_pylist(), strict=True):
            out[p] = max(out.get(p, t), t)
    return out


def advance(spec: GapSpec, table: pa.Table | None, closed: pa.Table | None, events: pa.Table,
            pinned: Mapping[int, int], watermark_us: int | None, now_us: int | None = None) -> Advanced:
    """The bucket's gap ``table`` and ``closed`` gaps (None: none stored) after ``events`` (columns
    ``_key``, ``_ts``, ``_partition``, ``_every`` (microseconds, null: none), the ``refs``; no null
    key or time) against the partitions' times (``pinned`` and the events' own, taken at most
    ``now_us``: :func:`partition_times`).

    Vectorised for the devices whose events only move ``last_seen`` on (the steady state); a device
    whose events close, retract or split a gap, or hold a silence, goes through :func:`_device`."""
    schema = spec.table_schema()
    table = conform(table, schema) if table is not None else schema.empty_table()
    closed = conform(closed, spec.closed_schema()) if closed is not None else spec.closed_schema().empty_table()
    reached = partition_times({}, events, now_us)
    times = dict(pinned)
    for p, t in reached.items():
        times[p] = max(times.get(p, t), t)
    out = _Records(spec)
    no_interval = 0
    if events.num_rows:
        ev = events.take(pc.sort_indices(events, [(KEY, "ascending"), (TS, "ascending")]))
        n = ev.num_rows
        keys = ev.column(KEY).combine_chunks()
        first = np.ones(n, dtype=bool)
        if n > 1:
            first[1:] = pc.not_equal(keys.slice(1), keys.slice(0, n - 1)).fill_null(True).to_numpy(
                zero_copy_only=False)
        starts = np.flatnonzero(first)
        lasts = np.append(starts[1:] - 1, n - 1)
        at = pc.index_in(keys, value_set=table.column(KEY).combine_chunks())
        known = pc.is_valid(at).to_numpy(zero_copy_only=False)
        ts = ev.column(TS).to_numpy(zero_copy_only=False).astype(np.int64)
        every = _floats(ev.column(EVERY))
        prev, prev_every = np.empty(n, dtype=np.int64), np.empty(n)
        prev[1:], prev_every[1:] = ts[:-1], every[:-1]
        prev[first] = _ints(table.column(LAST).take(at))[first]
        prev_every[first] = _floats(table.column(EVERY).take(at))[first]
        has_prev = ~first | known
        limit = np.ceil(spec.after * np.nan_to_num(prev_every, nan=0.0))
        silence = has_prev & ~np.isnan(prev_every) & (ts - prev >= limit)
        back = has_prev & (ts <= prev)  # before, or at, the last: the per-device path decides
        open_before = first & known & pc.is_valid(table.column(OPEN).take(at)).to_numpy(zero_copy_only=False)
        slow = np.maximum.reduceat((silence | back | open_before).astype(np.int8), starts).astype(bool)
        no_interval = int(np.isnan(every[lasts]).sum())
        rows = [table.filter(pc.invert(pc.is_in(table.column(KEY), value_set=keys)))]
        fast = lasts[~slow]
        if len(fast):
            moved = ev.take(pa.array(fast))
            rows.append(pa.table({KEY: moved.column(KEY), PARTITION: moved.column(PARTITION), LAST: moved.column(TS),
                                  EVERY: moved.column(EVERY), OPEN: pa.nulls(len(fast), pa.string()),
                                  OPENED_AT: pa.nulls(len(fast), pa.int64()),
                                  **{c: moved.column(c) for c, _ in spec.refs}}).cast(schema))
        slow_keys = keys.take(pa.array(starts[slow]))
        done: list[dict[str, Any]] = []
        kept: list[dict[str, Any]] = []
        if len(slow_keys):
            stored = {r[KEY]: r for r in table.filter(pc.is_in(table.column(KEY), value_set=slow_keys)).to_pylist()}
            gaps: dict[Any, list[dict[str, Any]]] = {}
            for g in closed.filter(pc.is_in(closed.column(KEY), value_set=slow_keys)).to_pylist():
                gaps.setdefault(g[KEY], []).append(g)
            ref_names = [c for c, _ in spec.refs]
            for a, b in zip(starts[slow], lasts[slow] + 1, strict=True):
                part = ev.slice(int(a), int(b - a)).to_pydict()
                key = part[KEY][0]
                row, device = _device(spec, key, stored.get(key), gaps.get(key, []), part, ref_names, out)
                done.append(row)
                kept += device
            rows.append(pa.Table.from_pylist(done, schema=schema))
            closed = pa.concat_tables([closed.filter(pc.invert(pc.is_in(closed.column(KEY), value_set=slow_keys))),
                                       pa.Table.from_pylist(kept, schema=spec.closed_schema())])
        table = pa.concat_tables(rows).combine_chunks()
    if watermark_us is not None and spec.ttl_us:
        table = table.filter(pc.greater(pc.add(table.column(LAST), spec.ttl_us), watermark_us))
        closed = closed.filter(pc.and_(pc.greater(pc.add(closed.column(END), spec.ttl_us), watermark_us),
                                       pc.is_in(closed.column(KEY), value_set=table.column(KEY))))
    table = _open(spec, table, times, out)
    return Advanced(table, closed, out.table(), no_interval, reached)


def _open(spec: GapSpec, table: pa.Table, times: Mapping[int, int], out: _Records) -> pa.Table:
    """The gaps whose threshold the device's partition has reached opened (in the table's order)."""
    if not table.num_rows or not times:
        return table
    reached = _reached(_ints(pc.fill_null(table.column(PARTITION), -1)), times)
    every = _floats(table.column(EVERY))
    last = _ints(table.column(LAST))
    limit = np.ceil(spec.after * np.nan_to_num(every, nan=0.0)).astype(np.int64)
    due = (~np.isnan(every) & pc.is_null(table.column(OPEN)).to_numpy(zero_copy_only=False)
           & (reached >= last + limit))
    if not due.any():
        return table
    ids = table.column(OPEN).to_pylist()
    opened_at = table.column(OPENED_AT).to_pylist()
    for i, r in zip(np.flatnonzero(due), table.take(pa.array(np.flatnonzero(due))).to_pylist(), strict=True):
        ids[i] = gap_id(r[KEY], r[LAST])
        opened_at[i] = r[LAST] + int(limit[i])
        out.opened(r[KEY], ids[i], r[LAST], opened_at[i], r)
    table = table.set_column(table.schema.get_field_index(OPEN), OPEN, pa.array(ids, pa.string()))
    return table.set_column(table.schema.get_field_index(OPENED_AT), OPENED_AT, pa.array(opened_at, pa.int64()))


def _reached(parts: np.ndarray, times: Mapping[int, int]) -> np.ndarray:
    """Each row's partition's time (the least int64 where none is known)."""
    known = np.array(sorted(times), dtype=np.int64)
    at = np.minimum(np.searchsorted(known, parts), len(known) - 1)
    values = np.array([times[int(p)] for p in known], dtype=np.int64)
    return np.where(known[at] == parts, values[at], np.iinfo(np.int64).min)


def _ints(a: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(pc.fill_null(a, 0).to_numpy(zero_copy_only=False), dtype=np.int64)


def _floats(a: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """int64 microseconds as float64 with NaN for null (exact below 2**53: 285 years)."""
    return np.asarray(pc.cast(a, pa.float64()).to_numpy(zero_copy_only=False), dtype=np.float64)


def _device(spec: GapSpec, key: Any, row: dict[str, Any] | None, device: list[dict[str, Any]],
            part: dict[str, list[Any]], refs: list[str], out: _Records) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One device's events in time order (``part``) against its stored ``row`` and closed gaps."""
    cur = dict(row) if row is not None else None
    for i, t in enumerate(part[TS]):
        here = {PARTITION: part[PARTITION][i], EVERY: part[EVERY][i], **{n: part[n][i] for n in refs}}
        if cur is None:
            cur = {KEY: key, LAST: t, OPEN: None, OPENED_AT: None, **here}
            continue
        last = cur[LAST]
        if t < last:
            _split(spec, key, t, part[EVERY][i], device, out)
            continue
        if t == last:
            continue
        silent = cur[EVERY] is not None and t - last >= spec.threshold(cur[EVERY])
        if cur[OPEN] is not None:  # the open gap: real if the event is past its threshold
            if silent:
                out.closed(key, cur[OPEN], last, t, cur)
                device.append(_closed(cur, cur[OPEN], last, t, refs))
            else:
                out.retracted(key, cur[OPEN], cur, last, None)
            cur[OPEN] = cur[OPENED_AT] = None
        elif silent:  # silent between two events read at once: opened and closed
            gid = gap_id(key, last)
            out.opened(key, gid, last, last + spec.threshold(cur[EVERY]), cur)
            out.closed(key, gid, last, t, cur)
            device.append(_closed(cur, gid, last, t, refs))
        cur.update(here)
        cur[LAST] = t
    assert cur is not None
    return cur, device


def _closed(cur: Mapping[str, Any], gid: str, start: int, end: int, refs: list[str]) -> dict[str, Any]:
    return {KEY: cur[KEY], OPEN: gid, START: start, END: end, EVERY: cur[EVERY], PARTITION: cur[PARTITION],
            **{n: cur[n] for n in refs}}


def _split(spec: GapSpec, key: Any, t: int, every: int | None, device: list[dict[str, Any]], out: _Records) -> None:
    """An event at ``t`` before the device's last one: a closed gap it falls in is withdrawn, and its
    parts still past the threshold are gaps of their own (opened and closed)."""
    for g in list(device):
        if not g[START] < t < g[END]:
            continue
        device.remove(g)
        out.retracted(key, g[OPEN], g, g[START], g[END])
        parts = [(g[START], t, g[EVERY]), (t, g[END], every)]
        for s, e, ev in parts:
            if ev is not None and e - s >= spec.threshold(ev):
                piece = {**g, OPEN: gap_id(key, s, e), START: s, END: e, EVERY: ev}
                out.opened(key, piece[OPEN], s, s + spec.threshold(ev), piece)
                out.closed(key, piece[OPEN], s, e, piece)
                device.append(piece)
        return


class _Records:
    """The batch's records, in the order they are made."""

    def __init__(self, spec: GapSpec) -> None:
        self.spec, self.rows = spec, list[dict[str, Any]]()

    def _base(self, kind: str, key: Any, gid: str, device: Mapping[str, Any]) -> dict[str, Any]:
        every = device.get(EVERY)
        return {"gap_id": gid, "kind": kind, self.spec.key: key, "topic": self.spec.topic,
                "partition": device.get(PARTITION),
                "expected_every_s": every / 1e6 if every is not None else None,
                **{n: device.get(n) for n, _ in self.spec.refs if n != self.spec.key}}

    def opened(self, key: Any, gid: str, last: int, at: int, device: Mapping[str, Any]) -> None:
        self.rows.append({**self._base("opened", key, gid, device), "last_seen": last, "opened_at": at})

    def closed(self, key: Any, gid: str, start: int, end: int, device: Mapping[str, Any]) -> None:
        self.rows.append({**self._base("closed", key, gid, device), "last_seen": start, "start": start, "end": end,
                          "duration_s": (end - start) / 1e6})

    def retracted(self, key: Any, gid: str, device: Mapping[str, Any], start: int, end: int | None) -> None:
        """The gap withdrawn: its ``start`` and, a closed one's, ``end``."""
        self.rows.append({**self._base("retracted", key, gid, device), "start": start, "end": end})

    def table(self) -> pa.Table:
        return records(self.spec, self.rows)


def records(spec: GapSpec, rows: list[dict[str, Any]]) -> pa.Table:
    """``rows`` (dicts, times in microseconds) as records of :meth:`GapSpec.record_schema`."""
    schema = spec.record_schema()
    times = ("last_seen", "opened_at", "start", "end", "since", "at")
    cols = {}
    for f in schema:
        values = [r.get(f.name) for r in rows]
        cols[f.name] = pa.array(values, pa.int64()).cast(_US) if f.name in times else pa.array(values, f.type)
    return pa.table(cols, schema=schema)


#: The longest expected interval taken (about 31 years); a longer one, or one not positive, is none:
#: a threshold must stay within int64 microseconds.
MAX_EVERY_S = 1e9


def every_us(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """An interval column as microseconds (int64): seconds (a number) or a duration; null where null,
    not a positive finite number, under a microsecond, or longer than :data:`MAX_EVERY_S`."""
    a = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if pa.types.is_duration(a.type):
        a = pc.divide(pc.cast(pc.cast(a, pa.duration("us")), pa.int64()).cast(pa.float64()), 1e6)
    f = pc.cast(a, pa.float64())
    ok = pc.and_(pc.and_(pc.is_finite(f), pc.greater(f, 0)), pc.less_equal(f, MAX_EVERY_S))
    us = pc.cast(pc.round(pc.multiply(pc.if_else(ok, f, 0.0), 1e6)), pa.int64())
    return pc.if_else(pc.and_(ok, pc.greater(us, 0)), us, pa.scalar(None, pa.int64()))

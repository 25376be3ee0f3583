"""The per-device state engine: one bucket of devices, one micro-batch of their events, in Arrow.

Pure and vectorised (no Spark, no per-row Python): the stateful operator calls :func:`apply` once per
hash bucket of devices per micro-batch with the bucket's state table, and :func:`evict` when an
event-time timer fires for a bucket that got no events.

Semantics (docs/state.md):

* The events of a batch are applied per device in event-time order, ties by the tie columns (the
  Kafka partition and offset); batches are applied in the order they come.
* An event whose time is at or before the watermark (``ts <= watermark``) is *late*: it is not
  applied, its ``state`` is null and its late flag true. So is an event with a null key or time
  (``state`` null, late flag false): the job sends those to the dead-letter topic before this step.
* A device's state is dropped once the watermark reaches ``last_seen + ttl``; dropping comes before
  the batch's events are applied, so an event after that starts a fresh state.
* The ``state`` of an applied event covers the device's state including that event: ``events``
  (count), ``first_seen``/``last_seen`` (least/greatest event time), and ``<column>_<agg>``: ``last``
  (latest non-null value in application order), ``min``, ``max``, ``mean`` (float64 over the non-null
  values). Nulls - and NaN and +-Infinity, which JSON cannot carry - are ignored by every aggregate;
  an aggregate of no values is null.

A device's aggregates depend on its own events only, never on the other devices of its bucket, and
the same batches give the same bytes (replays are byte-identical). ``mean`` keeps a sum and a count;
the sum is accumulated per device with compensated (Kahan) summation within a batch, so the last
bits of a mean may differ between two different splits of the same events into batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from enrich.ipc import from_ipc, to_ipc

#: Names of the state table's own columns; the aggregates' accumulators are ``<column>_<agg>``
#: (``mean`` keeps ``<column>_sum`` and ``<column>_count``), which never start with an underscore
#: followed by these words alone.
KEY, FIRST_SEEN, LAST_SEEN, EVENTS = "_key", "_first_seen", "_last_seen", "_events"
#: Aggregates the engine keeps, and the accumulator columns each one needs.
AGGS = ("last", "min", "max", "mean")


@dataclass(frozen=True)
class StateSpec:
    """What the engine needs to know, resolved against the enriched events' schema; picklable.

    ``aggregates`` holds ``(column, aggs, arrow type of the column)``; ``ties`` the columns that order
    events of one device with the same time."""

    key: str
    key_type: pa.DataType
    timestamp: str
    ttl_us: int
    aggregates: tuple[tuple[str, tuple[str, ...], pa.DataType], ...] = ()
    ties: tuple[str, ...] = ("_partition", "_offset")
    timestamp_type: pa.DataType = field(default_factory=lambda: pa.timestamp("us", tz="UTC"))

    def __post_init__(self) -> None:
        for column, aggs, typ in self.aggregates:
            bad = [a for a in aggs if a not in AGGS]
            if bad:
                raise ValueError(f"state aggregate(s) {bad} of {column!r} are not among {AGGS}")
            if any(a != "last" for a in aggs) and not _numeric(typ):
                raise ValueError(f"min, max and mean need a numeric column; {column!r} is {typ}")

    def state_schema(self) -> pa.Schema:
        """The schema of a bucket's state table: one row per device."""
        fields = [pa.field(KEY, self.key_type, False), pa.field(FIRST_SEEN, self.timestamp_type, False),
                  pa.field(LAST_SEEN, self.timestamp_type, False), pa.field(EVENTS, pa.int64(), False)]
        for column, aggs, typ in self.aggregates:
            for agg in aggs:
                if agg == "mean":
                    fields += [pa.field(f"{column}_sum", pa.float64()), pa.field(f"{column}_count", pa.int64())]
                else:
                    fields.append(pa.field(f"{column}_{agg}", typ))
        return pa.schema(fields)

    def output_type(self) -> pa.StructType:
        """The type of the ``state`` column every event gets."""
        fields = [pa.field("events", pa.int64()), pa.field("first_seen", self.timestamp_type),
                  pa.field("last_seen", self.timestamp_type)]
        for column, aggs, typ in self.aggregates:
            fields += [pa.field(f"{column}_{a}", pa.float64() if a == "mean" else typ) for a in aggs]
        return pa.struct(fields)

    def empty(self) -> pa.Table:
        return self.state_schema().empty_table()


@dataclass(frozen=True)
class Applied:
    """:func:`apply`'s result: the bucket's new state table, and per event (in input order) its
    ``state`` struct (null where not applied) and its late flag; counts for the batch log. What
    changed, for storing only that (:func:`merge`): the table's last ``touched`` rows are the
    devices the events touched, ``removed`` the keys of the devices dropped (expired)."""

    state: pa.Table
    column: pa.StructArray
    late: pa.BooleanArray
    applied: int
    late_count: int
    evicted: int
    touched: int = 0
    removed: pa.Array | None = None
    #: Per event (input order), the accumulators :func:`apply` was asked for as they were before it;
    #: a null row where it was not applied or started a fresh state.
    before: pa.Table | None = None


def _numeric(typ: pa.DataType) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ)


def _micros(arr: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Event times as int64 microseconds since the epoch (nulls as 0: callers mask them)."""
    a = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if pa.types.is_timestamp(a.type):
        if a.type.unit != "us":
            a = pc.cast(a, pa.timestamp("us", tz=a.type.tz))
        a = a.view(pa.int64())
    else:
        a = pc.cast(a, pa.int64())
    return np.asarray(a.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)


def evict(spec: StateSpec, state: pa.Table, watermark_us: int | None) -> tuple[pa.Table, int]:
    """Drop the devices whose ``last_seen + ttl`` the watermark has reached; returns the rest and the
    number dropped."""
    rest, removed = evict_keys(spec, state, watermark_us)
    return rest, len(removed)


def evict_keys(spec: StateSpec, state: pa.Table, watermark_us: int | None) -> tuple[pa.Table, pa.Array]:
    """:func:`evict`, returning the keys of the devices dropped."""
    none = pa.array([], spec.key_type)
    if watermark_us is None or state.num_rows == 0:
        return state, none
    keep = _micros(state.column(LAST_SEEN)) + spec.ttl_us > watermark_us
    if keep.all():
        return state, none
    return state.filter(pa.array(keep)), state.column(KEY).combine_chunks().filter(pa.array(~keep))


def merge(spec: StateSpec, state: pa.Table, rows: pa.Table, removed: pa.Array | pa.ChunkedArray) -> pa.Table:
    """The table a stored change turns ``state`` into: without the devices of ``rows`` and
    ``removed``, then ``rows``. For ``rows`` the last ``touched`` rows of an :class:`Applied` state
    and ``removed`` its keys, it gives that state from the table :func:`apply` was given."""
    if isinstance(removed, pa.ChunkedArray):
        removed = removed.combine_chunks()
    keys = pa.concat_arrays([rows.column(KEY).combine_chunks(), removed.cast(spec.key_type)])
    if not len(keys) or not state.num_rows:
        return rows if not state.num_rows else state
    keep = pc.invert(pc.is_in(state.column(KEY), value_set=keys))
    return pa.concat_tables([state.filter(keep), rows.cast(state.schema)]).combine_chunks()


def next_expiry(spec: StateSpec, state: pa.Table) -> int | None:
    """The event time (microseconds) at which the watermark drops the bucket's next device: the time
    of the event-time timer to keep registered for the bucket; None for an empty bucket."""
    if state.num_rows == 0:
        return None
    return int(_micros(state.column(LAST_SEEN)).min()) + spec.ttl_us


def apply(spec: StateSpec, state: pa.Table, events: pa.Table, watermark_us: int | None,
          late_at_read: np.ndarray | None = None, before: tuple[str, ...] = ()) -> Applied:
    """Apply one micro-batch of one bucket's events to the bucket's state (see the module docstring).

    ``events`` holds at least the key, the timestamp, the tie columns and the aggregated columns;
    ``watermark_us`` is the batch's watermark in microseconds (None: nothing is late, nothing expires).
    ``late_at_read``: which events are late, as judged when they were read (events held for
    completeness, ``enrich.state.wait``, are judged against the watermark of the batch that read
    them, not the one that releases them); None: judged against ``watermark_us``. ``before``: the
    accumulators (names of :meth:`StateSpec.state_schema`) to give each applied event as they were
    before it (:attr:`Applied.before`), which corrections refold the device's aggregates from.
    """
    state, removed = evict_keys(spec, state, watermark_us)
    evicted = len(removed)
    n = events.num_rows
    key = events.column(spec.key).combine_chunks()
    ts_col = events.column(spec.timestamp).combine_chunks()
    ts = _micros(ts_col)
    valid = key.is_valid().to_numpy(zero_copy_only=False) & ts_col.is_valid().to_numpy(zero_copy_only=False)
    if late_at_read is not None:
        late = valid & late_at_read
    else:
        late = valid & (ts <= watermark_us) if watermark_us is not None else np.zeros(n, dtype=bool)
    use = np.flatnonzero(valid & ~late)
    out_type = spec.output_type()
    if len(use) == 0:
        nulls = pa.nulls(n, out_type)
        types = {f.name: f.type for f in spec.state_schema()}
        held = pa.table({name: pa.nulls(n, types[name]) for name in before}) if before else None
        return Applied(state, nulls, pa.array(late, pa.bool_()), 0, int(late.sum()), evicted, 0, removed, held)

    # Sort the applied events by device, time, ties; the sort is stable, so equal ties keep input order.
    sub = events.select([spec.key, spec.timestamp, *spec.ties]).take(pa.array(use))
    order = pc.sort_indices(sub, [(spec.key, "ascending"), (spec.timestamp, "ascending"),
                                  *[(t, "ascending") for t in spec.ties]]).to_numpy()
    rows = use[order]                      # input positions, in application order
    m = len(rows)
    skey = key.take(pa.array(rows))
    starts = np.flatnonzero(np.concatenate(
        [[True], pc.not_equal(skey[1:], skey[:-1]).to_numpy(zero_copy_only=False)])) if m > 1 \
        else np.zeros(1, dtype=np.int64)
    groups = len(starts)
    gkeys = skey.take(pa.array(starts))
    if state.num_rows:
        found = pc.index_in(gkeys, value_set=state.column(KEY).combine_chunks())
        seed_of = found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        seed_of = np.full(groups, -1, dtype=np.int64)
    seeded = seed_of >= 0

    sizes = np.diff(np.append(starts, m))
    seed_rows = seed_of[seeded]
    seeds = state.take(pa.array(seed_rows)) if len(seed_rows) else None
    seq = _Sequence(starts, sizes, seeded)

    def seeds_col(name: str) -> pa.Array | None:
        return seeds.column(name).combine_chunks() if seeds is not None else None

    sts = ts[rows]
    out: dict[str, pa.Array] = {}
    count = seq.combined(np.ones(m, dtype=np.int64), seeds_col(EVENTS), pa.int64())
    out[EVENTS] = pa.array(seq.cumsum_int(count.to_numpy()), pa.int64())
    # Times ascend within a group's events: the running least time is the seed's or the first
    # event's, the running greatest the seed's or the event's own.
    first = seq.combined(sts, _seed_micros(seeds_col(FIRST_SEEN)), pa.int64()).to_numpy().copy()
    first_event = sts[starts]
    first[seq.ev_pos] = np.minimum(np.repeat(first[seq.cstart], sizes), np.repeat(first_event, sizes))
    out[FIRST_SEEN] = pa.array(first, pa.int64())
    last = seq.combined(sts, _seed_micros(seeds_col(LAST_SEEN)), pa.int64()).to_numpy().copy()
    seed_last = np.where(seeded, last[seq.cstart], np.iinfo(np.int64).min)
    last[seq.ev_pos] = np.maximum(sts, seed_last[seq.ev_group])
    out[LAST_SEEN] = pa.array(last, pa.int64())
    values = {column: events.column(column).combine_chunks().take(pa.array(rows)) for column, _, _ in spec.aggregates}
    out.update(_fold(spec, values, seq, seeds_col))
    ev_pos = seq.ev_pos

    # Per event: its row of the combined sequence, back in input order.
    at = np.full(n, -1, dtype=np.int64)
    at[rows] = ev_pos
    pick = pa.array(at, mask=at < 0)
    column = _output(spec, out, pick, at < 0)
    held = None
    if before:  # each applied event's accumulators before it, in input order (null: a fresh start)
        prior = seq.prior(out, before)
        app = np.full(n, -1, dtype=np.int64)
        app[rows] = np.arange(m)
        held = prior.take(pa.array(app, mask=app < 0))

    # The new state: the untouched devices in their stored order, then each touched device's last
    # combined row in key order (a layout that only depends on the state and the events: replays
    # store the same bytes).
    ends_idx = pa.array(ev_pos[np.append(starts[1:], m) - 1])
    schema = spec.state_schema()
    touched_cols: list[pa.Array] = [gkeys.cast(spec.key_type)]
    for f in schema:
        if f.name == KEY:
            continue
        col = out[f.name].take(ends_idx)
        touched_cols.append(col.cast(f.type))
    touched = pa.Table.from_arrays(touched_cols, schema=schema)
    if state.num_rows:
        untouched = np.ones(state.num_rows, dtype=bool)
        untouched[seed_rows] = False
        new_state = pa.concat_tables([state.filter(pa.array(untouched)).cast(schema), touched])
    else:
        new_state = touched
    return Applied(new_state.combine_chunks(), column, pa.array(late, pa.bool_()), m, int(late.sum()), evicted,
                   groups, removed, held)


class _Sequence:
    """The combined sequence of a fold: per group (a device), its seed row (the state it starts
    from) if ``seeded``, then its ``sizes`` events in application order; groups contiguous."""

    def __init__(self, starts: np.ndarray, sizes: np.ndarray, seeded: np.ndarray) -> None:
        groups, m = len(starts), int(sizes.sum())
        shift = np.cumsum(seeded)                                  # seed rows up to and including group g
        self.ev_pos = np.arange(m) + np.repeat(shift, sizes)       # where each event lands
        self.seed_pos = starts[seeded] + shift[seeded] - 1         # where each seed row lands
        self.total = m + int(seeded.sum())
        self.gid = np.empty(self.total, dtype=np.int64)
        self.gid[self.ev_pos] = np.repeat(np.arange(groups), sizes)
        self.gid[self.seed_pos] = np.flatnonzero(seeded)
        self.csizes = sizes + seeded
        self.cstart = starts + shift - seeded                      # each group's first row in the sequence
        self.ev_group = np.repeat(np.arange(groups), sizes)        # each event's group, in application order
        self.seeded = seeded

    def combined(self, event_values: np.ndarray | pa.Array, seed_values: np.ndarray | pa.Array | None,
                 typ: pa.DataType | None = None) -> pa.Array:
        """One column over the combined sequence, from its event values (in application order) and
        its seed values."""
        parts = [pa.array(event_values, typ) if not isinstance(event_values, pa.Array) else event_values]
        idx = [self.ev_pos]
        if seed_values is not None and len(self.seed_pos):
            parts.append(pa.array(seed_values, parts[0].type) if not isinstance(seed_values, pa.Array)
                         else seed_values.cast(parts[0].type))
            idx.append(self.seed_pos)
        place = np.concatenate(idx)
        inverse = np.empty(self.total, dtype=np.int64)
        inverse[place] = np.arange(self.total)
        return pa.concat_arrays(parts).take(pa.array(inverse))

    def cumsum_int(self, values: np.ndarray) -> np.ndarray:
        total_so_far = np.cumsum(values)
        return total_so_far - np.repeat(total_so_far[self.cstart] - values[self.cstart], self.csizes)

    def prior(self, out: dict[str, pa.Array], names: tuple[str, ...]) -> pa.Table:
        """Per event (application order), the accumulators ``names`` of ``out`` before it: its
        group's row before it, null for a group's first event without a seed."""
        has = self.ev_pos > self.cstart[self.ev_group]
        idx = pa.array(np.where(has, self.ev_pos - 1, 0), mask=~has)
        return pa.table({name: out[name].take(idx) for name in names})


def _fold(spec: StateSpec, values: dict[str, pa.Array], seq: _Sequence,
          seeds_col: Callable[[str], pa.Array | None]) -> dict[str, pa.Array]:
    """The aggregates' accumulators over the combined sequence ``seq``: ``values`` the aggregated
    columns' values in application order, ``seeds_col`` a seed accumulator's values per seed row."""
    out: dict[str, pa.Array] = {}
    for column, aggs, typ in spec.aggregates:
        vals = _ignored_as_null(values[column])
        if vals.type != typ:
            vals = pc.cast(vals, typ)
        for agg in aggs:
            name = f"{column}_{agg}"
            if agg == "last":
                out[name] = _running_last(seq.combined(vals, seeds_col(name)), seq.cstart, seq.csizes)
            elif agg in ("min", "max"):
                out[name] = _running_extreme(seq.combined(vals, seeds_col(name)), agg, seq.cstart, seq.csizes)
            else:
                ok = vals.is_valid()
                s = seq.combined(pc.cast(vals, pa.float64()).fill_null(0.0), seeds_col(f"{column}_sum"), pa.float64())
                c = seq.combined(pc.cast(ok, pa.int64()), seeds_col(f"{column}_count"), pa.int64())
                # pandas sums floats per group with compensated (Kahan) summation.
                out[f"{column}_sum"] = pa.array(pd.Series(s.to_numpy(zero_copy_only=False)).groupby(seq.gid, sort=False)
                                                .cumsum().to_numpy())
                out[f"{column}_count"] = pa.array(seq.cumsum_int(c.to_numpy(zero_copy_only=False)), pa.int64())
    return out


def _agg_fields(spec: StateSpec, out: dict[str, pa.Array], pick: pa.Array) -> list[pa.Array]:
    """The aggregates' fields of the ``state`` struct at the sequence's rows ``pick`` (``mean``
    finalised from its sum and count)."""
    fields: list[pa.Array] = []
    for column, aggs, _typ in spec.aggregates:
        for agg in aggs:
            if agg == "mean":
                total_sum = out[f"{column}_sum"].take(pick)
                total_n = out[f"{column}_count"].take(pick)
                mean = pc.divide(total_sum, pc.cast(total_n, pa.float64()))
                fields.append(pc.if_else(pc.greater(total_n, 0), mean, pa.scalar(None, pa.float64())))
            else:
                fields.append(out[f"{column}_{agg}"].take(pick))
    return fields


def _output(spec: StateSpec, out: dict[str, pa.Array], pick: pa.Array, missing: np.ndarray) -> pa.StructArray:
    """The ``state`` struct per event: its row ``pick`` of the combined sequence (null: ``missing``)."""
    tstype = spec.timestamp_type
    fields: list[pa.Array] = [out[EVENTS].take(pick), out[FIRST_SEEN].take(pick).cast(tstype),
                              out[LAST_SEEN].take(pick).cast(tstype), *_agg_fields(spec, out, pick)]
    return pa.StructArray.from_arrays(fields, fields=list(spec.output_type()), mask=pa.array(missing))


def accumulators(spec: StateSpec) -> tuple[str, ...]:
    """The aggregates' accumulator columns (:meth:`StateSpec.state_schema`'s after the device's own)."""
    return tuple(f.name for f in spec.state_schema() if f.name not in (KEY, FIRST_SEEN, LAST_SEEN, EVENTS))


@dataclass(frozen=True)
class Refolded:
    """:func:`refold`'s result, per event in the order given: ``fields``, the aggregates' fields of
    its ``state`` (by ``<column>_<agg>``), and ``before``, its accumulators before it; per run,
    ``final``, the accumulators after its last event."""

    fields: dict[str, pa.Array]
    before: pa.Table
    final: pa.Table


def refold(spec: StateSpec, values: pa.Table, starts: np.ndarray, seeds: pa.Table) -> Refolded:
    """The aggregates of ``spec`` folded again over ``values`` (the aggregated columns, events in
    application order): runs beginning at ``starts``, each from its row of ``seeds`` (the
    accumulators it starts from, :func:`accumulators`; a null row: a fresh state). What a
    correction recomputes when a join column's values changed under a device's events."""
    m = values.num_rows
    sizes = np.diff(np.append(starts, m))
    names = accumulators(spec)
    seeded = ~np.asarray(seeds.column(names[0]).is_null().to_numpy(zero_copy_only=False), bool) if names else \
        np.zeros(len(starts), bool)
    if names:  # a run's seed row is whole or absent: every accumulator of a fresh state is null
        for n in names[1:]:
            seeded |= ~np.asarray(seeds.column(n).is_null().to_numpy(zero_copy_only=False), bool)
    seq = _Sequence(np.asarray(starts, np.int64), sizes, seeded)
    kept = seeds.filter(pa.array(seeded))

    def seeds_col(name: str) -> pa.Array | None:
        return kept.column(name).combine_chunks() if kept.num_rows else None

    out = _fold(spec, {c: values.column(c).combine_chunks() for c, _, _ in spec.aggregates}, seq, seeds_col)
    pick = pa.array(seq.ev_pos)
    labels = [f"{c}_{a}" for c, aggs, _ in spec.aggregates for a in aggs]
    ends = pa.array(seq.ev_pos[np.append(starts[1:], m) - 1])
    return Refolded(dict(zip(labels, _agg_fields(spec, out, pick), strict=True)), seq.prior(out, names),
                    pa.table({n: out[n].take(ends) for n in names}))


def _seed_micros(a: pa.Array | None) -> np.ndarray | None:
    return None if a is None else _micros(a)


def _ignored_as_null(a: pa.Array) -> pa.Array:
    """Values the aggregates ignore (NaN and +-Infinity: ``1e400`` parses as one) as nulls: one such
    reading would otherwise hold a device's max or mean at infinity for good, and a database column
    (MariaDB's DOUBLE) refuse every later row of the device."""
    if pa.types.is_floating(a.type):
        odd = pc.invert(pc.is_finite(a)).fill_null(False)
        if pc.any(odd).as_py():
            return pc.if_else(odd, pa.scalar(None, a.type), a)
    return a


def _running_extreme(a: pa.Array, how: str, starts: np.ndarray, sizes: np.ndarray) -> pa.Array:
    """Per position, the least (``how="min"``) or greatest value of its group so far, nulls ignored
    (null until the group's first value); the groups are contiguous, as in :func:`_running_last`.
    A log-step (Hillis-Steele) scan over the whole array: exact, and no per-group Python."""
    floating = pa.types.is_floating(a.type)
    wide = pc.cast(a, pa.float64() if floating else pa.int64())
    if floating:
        sentinel = np.inf if how == "min" else -np.inf
    else:
        sentinel = np.iinfo(np.int64).max if how == "min" else np.iinfo(np.int64).min
    values = np.array(wide.fill_null(sentinel).to_numpy(zero_copy_only=False))
    op = np.minimum if how == "min" else np.maximum
    first = np.repeat(starts, sizes)                 # each position's group start
    behind = np.arange(len(values)) - first          # positions of its group before it
    step, longest = 1, int(sizes.max()) if len(sizes) else 0
    while step < longest:
        at = np.flatnonzero(behind >= step)
        values[at] = op(values[at], values[at - step])
        step *= 2
    ran = pa.array(values, wide.type)
    seen = pc.is_valid(_running_last(wide, starts, sizes))
    return pc.cast(pc.if_else(seen, ran, pa.scalar(None, wide.type)), a.type)


def _running_last(a: pa.Array, starts: np.ndarray, sizes: np.ndarray) -> pa.Array:
    """Per position, the latest non-null value of its group so far; the groups are contiguous, the
    ``sizes`` long runs beginning at ``starts``."""
    pos = np.where(a.is_valid().to_numpy(zero_copy_only=False), np.arange(len(a)), -1)
    latest = np.maximum.accumulate(pos) if len(a) else pos
    latest = np.where(latest >= np.repeat(starts, sizes), latest, -1)
    return a.take(pa.array(latest, mask=latest < 0))


def finalize(spec: StateSpec, state: pa.Table) -> pa.StructArray:
    """Per device of a bucket's state table, its ``state`` struct as the device's last applied event
    carried it (``mean`` finalised from its sum and count): what ``enrich lookup --state`` prints."""
    fields: list[pa.Array] = [state.column(EVENTS).combine_chunks(),
                              state.column(FIRST_SEEN).combine_chunks().cast(spec.timestamp_type),
                              state.column(LAST_SEEN).combine_chunks().cast(spec.timestamp_type)]
    for column, aggs, _typ in spec.aggregates:
        for agg in aggs:
            if agg == "mean":
                total = state.column(f"{column}_sum").combine_chunks()
                n = state.column(f"{column}_count").combine_chunks()
                mean = pc.divide(total, pc.cast(n, pa.float64()))
                fields.append(pc.if_else(pc.greater(n, 0), mean, pa.scalar(None, pa.float64())))
            else:
                fields.append(state.column(f"{column}_{agg}").combine_chunks())
    return pa.StructArray.from_arrays(fields, fields=list(spec.output_type()))


def state_to_ipc(table: pa.Table) -> bytes:
    """A bucket's state table as bytes (Arrow IPC stream), the value kept in Spark's state store."""
    return to_ipc(table)


def state_from_ipc(data: bytes, spec: StateSpec) -> pa.Table:
    """The inverse of :func:`state_to_ipc`; a table of another schema is refused (the checkpoint's
    state was written with other ``state:`` settings, which the job checks before it gets here)."""
    table = from_ipc(data)
    if table.schema != spec.state_schema():
        raise ValueError(f"stored device state has schema {table.schema}, expected {spec.state_schema()}")
    return table


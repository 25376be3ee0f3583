"""Events to partial aggregates, and partial aggregates merged: a rollup's window tables, in Arrow.

A window table (:meth:`RollupSpec.window_schema`) holds one row per (``by`` values, window) with
what the window's metrics need, and nothing of its events: counts and sums to add, least and
greatest values, the latest value with the (event time, partition, offset) that orders it, a KLL
sketch and the set of distinct values. :func:`partials` builds one from a micro-batch's events,
:func:`merge` combines two, and merging is all the engine ever does with them, so a window's metrics
do not depend on how its events were split into batches, nor on the order the batches came in:
``last`` is the value of the latest event by event time (ties by partition, then offset), not the
last to arrive. The one exception is a percentile over more than ``KLL_K`` values, whose sketch
compacts at random (within its rank error; :mod:`enrich.rollups.sketch`). ``sum`` and ``mean`` add
floats, whose last bits depend on the order they are added in.

Nulls, NaN and +-Infinity are ignored by every metric (an aggregate of no values is null, a count 0);
events with a null event time belong to no window and are left out. The rows come sorted by the
``by`` columns (nulls last) and the window start.

Pure and vectorised: events are sorted once by group, and the aggregates are Arrow group-bys and
numpy reductions over the sorted runs; only sketches of many values are built and merged one
group at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from enrich.columns import TS_US
from enrich.rollups import sketch
from enrich.rollups.spec import EVENTS, WINDOW_START, RollupSpec, accumulators

#: The columns that order events of the same time (the Kafka partition and offset).
TIES = ("_partition", "_offset")


def _column(table: pa.Table, name: str) -> pa.Array:
    return table.column(name).combine_chunks()


def as_numpy(a: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An Arrow column as a numpy array (a copy where Arrow's layout needs one)."""
    return np.asarray(a.to_numpy(zero_copy_only=False))


def _int64(a: pa.Array) -> np.ndarray:
    """An integer or timestamp column as int64 (nulls as 0: callers mask them)."""
    if pa.types.is_timestamp(a.type):
        if a.type.unit != "us":
            a = pc.cast(a, pa.timestamp("us", tz=a.type.tz))
        a = a.view(pa.int64())
    elif a.type != pa.int64():
        a = pc.cast(a, pa.int64())
    return np.asarray(as_numpy(a.fill_null(0)), dtype=np.int64)


def _ignored_as_null(a: pa.Array) -> pa.Array:
    """NaN and +-Infinity as nulls: one such reading would hold a window's max or mean at infinity
    (as in ``enrich.state.engine``)."""
    if pa.types.is_floating(a.type):
        odd = pc.invert(pc.is_finite(a)).fill_null(False)
        if pc.any(odd).as_py():
            return pc.if_else(odd, pa.scalar(None, a.type), a)
    return a


def _differs(a: pa.Array) -> np.ndarray:
    """Per position after the first, whether it differs from the one before, a null equal to a null
    (and a NaN to a NaN: a by value of its own, as a null is)."""
    if len(a) < 2:
        return np.zeros(0, dtype=bool)
    cur, prev = a.slice(1), a.slice(0, len(a) - 1)
    out = as_numpy(pc.not_equal(cur, prev).fill_null(False))
    if pa.types.is_floating(a.type):
        out &= ~as_numpy(pc.and_(pc.is_nan(cur), pc.is_nan(prev)).fill_null(False))
    if a.null_count:
        out |= as_numpy(cur.is_valid()) != as_numpy(prev.is_valid())
    return out


def sort_groups(table: pa.Table, keys: Sequence[str],
                then: Sequence[str] = ()) -> tuple[np.ndarray, np.ndarray]:
    """``table``'s rows sorted by ``keys`` (nulls last, Arrow's default; ``then`` orders the rows
    within a group): the sort's row indices, and where each group of equal keys starts in that order."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = as_numpy(pc.sort_indices(table.select([*keys, *then]),
                                sort_keys=[(k, "ascending") for k in (*keys, *then)])).astype(np.int64)
    new = np.zeros(n, dtype=bool)
    new[0] = True
    taken = table.select(list(keys)).take(pa.array(order))
    for k in keys:
        new[1:] |= _differs(_column(taken, k))
    return order, np.flatnonzero(new)


def _latest(starts: np.ndarray, n: int, valid: np.ndarray, ts: np.ndarray, p: np.ndarray,
            o: np.ndarray) -> pa.Array:
    """Per group (contiguous runs at ``starts``), the row of its greatest (ts, p, o) among the
    ``valid`` rows; null for a group with none."""
    gid = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, n)))
    # Groups stay where they are (the group is the primary key and already sorted), valid rows
    # after invalid ones: each group's last row in this order is its latest valid row, if any.
    order = np.lexsort((o, p, ts, valid, gid))
    last = order[np.append(starts[1:], n) - 1]
    return pa.array(last, pa.int64(), mask=~valid[last])


def _distinct(gid: np.ndarray, values: pa.Array, groups: int, typ: pa.DataType) -> pa.ListArray:
    """Per group, its distinct non-null ``values`` (``gid``: each value's group), sorted: the same
    set is always the same list, whatever order its values came in."""
    keep = as_numpy(values.is_valid())
    values, gid = values.filter(pa.array(keep)), gid[keep]
    if pa.types.is_floating(typ):
        values = pc.add(values, pa.scalar(0.0, typ))  # -0.0 + 0.0 is 0.0: one zero, as == has it
    t = pa.table({"g": pa.array(gid, pa.int64()), "v": values})
    t = t.take(pc.sort_indices(t, sort_keys=[("g", "ascending"), ("v", "ascending")]))
    first = np.ones(t.num_rows, dtype=bool)
    if t.num_rows:
        first[1:] = _differs(_column(t, "g")) | _differs(_column(t, "v"))
    kept_g = as_numpy(_column(t, "g"))[first]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(kept_g, minlength=groups))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                    _column(t, "v").filter(pa.array(first)), type=pa.list_(typ))


def _sketches(starts: np.ndarray, n: int, valid: np.ndarray, values: np.ndarray) -> pa.Array:
    """Per group, a serialized sketch of its ``valid`` values (null for none)."""
    counts = np.add.reduceat(valid.astype(np.int64), starts) if len(starts) else np.zeros(0, np.int64)
    return sketch.build_groups(values[valid], counts)


def _aggregate(g: np.ndarray, columns: dict[str, pa.Array], aggs: list[tuple[str, str]]) -> pa.Table:
    """An Arrow group-by of ``columns`` by the (sorted) group ids ``g``, one row per group in order."""
    t = pa.table({"_g": pa.array(g, pa.int64()), **columns})
    return t.group_by("_g", use_threads=False).aggregate(aggs).sort_by("_g")


def partials(spec: RollupSpec, events: pa.Table) -> pa.Table:
    """One micro-batch's events (the ``by`` columns, ``_ts_us``, ``_partition``, ``_offset`` and the
    metric columns) as a window table: one row per (``by`` values, window) they fall in."""
    schema = spec.window_schema()
    if events.column(TS_US).null_count:
        events = events.filter(pc.is_valid(events.column(TS_US)))
    n = events.num_rows
    if n == 0:
        return schema.empty_table()
    ts = _int64(_column(events, TS_US))
    start = np.floor_divide(ts, spec.window_us) * spec.window_us
    p, o = (_int64(_column(events, c)) for c in TIES)
    by = [_column(events, b).cast(t) for b, t in zip(spec.by, spec.by_types, strict=True)]
    # Sorted by group, then event time, partition, offset: a sketch sees its values in event order.
    # (Names of their own: a by column may be called anything.)
    keys = [f"k{i}" for i in range(len(by))] + ["start"]
    keyed = pa.Table.from_arrays([*by, pa.array(start), pa.array(ts), pa.array(p), pa.array(o)],
                                 names=[*keys, "ts", "p", "o"])
    order, starts = sort_groups(keyed, keys, ["ts", "p", "o"])
    take = pa.array(order)
    sizes = np.diff(np.append(starts, n))
    gid = np.repeat(np.arange(len(starts)), sizes)
    ts, p, o = ts[order], p[order], o[order]
    heads = order[starts]

    out: dict[str, pa.Array] = {b: a.take(pa.array(heads)) for b, a in zip(spec.by, by, strict=True)}
    out[WINDOW_START] = pa.array(start[heads])
    out[EVENTS] = pa.array(sizes, pa.int64())
    for column, metrics, typ in spec.metrics:
        values = _ignored_as_null(_column(events, column).cast(typ).take(take))
        valid = as_numpy(values.is_valid())
        accs = accumulators(metrics)
        wide = pc.cast(values, pa.float64()) if {"sum", "kll"} & set(accs) else None
        # The count, sum (of the values as float64), least and greatest value per group in one pass.
        reductions = [("f" if a == "sum" else "v", a) for a in accs if a in ("sum", "min", "max")]
        agg = _aggregate(gid, {"v": values, **({"f": wide} if wide is not None else {})},
                         [("v", "count"), *reductions])
        for acc in accs:
            name = f"{column}.{acc}"
            if acc == "n":
                out[name] = _column(agg, "v_count")
            elif acc in ("sum", "min", "max"):
                out[name] = _column(agg, f"{'f' if acc == 'sum' else 'v'}_{acc}")
            elif acc == "last":
                at = _latest(starts, n, valid, ts, p, o)
                out[name] = values.take(at)
                for suffix, src in (("ts", ts), ("p", p), ("o", o)):
                    out[f"{column}.last_{suffix}"] = pa.array(src).take(at)
            elif acc == "kll":
                assert wide is not None
                out[name] = _sketches(starts, n, valid, as_numpy(wide.fill_null(0.0)))
            elif acc == "set":
                out[name] = _distinct(gid, values, len(starts), typ)
    return pa.Table.from_arrays([out[f.name].cast(f.type) for f in schema], schema=schema)


def merge(spec: RollupSpec, a: pa.Table, b: pa.Table) -> pa.Table:
    """Two window tables as one: a window in both gets its accumulators combined (counts and sums
    added, the least and greatest values, the latest value by (time, partition, offset), the sketches
    merged, the sets united); a window in one of them is kept as it is."""
    schema = spec.window_schema()
    table = pa.concat_tables([a.cast(schema), b.cast(schema)])
    order, starts = sort_groups(table, [*spec.by, WINDOW_START])
    return combine_sorted(spec, table.take(pa.array(order)), starts)


def combine_sorted(spec: RollupSpec, table: pa.Table, starts: np.ndarray) -> pa.Table:
    """A window table whose windows may have several rows, sorted so that each window's rows are a
    run beginning at ``starts`` (:func:`sort_groups`), with one row per window."""
    schema = spec.window_schema()
    n = table.num_rows
    if len(starts) == n:  # one row each: nothing to combine (sketches keep their bytes)
        return table.cast(schema)
    groups = len(starts)
    gid = np.repeat(np.arange(groups), np.diff(np.append(starts, n)))
    heads = pa.array(starts)

    sums: dict[str, pa.Array] = {EVENTS: _column(table, EVENTS)}
    aggs: list[tuple[str, str]] = [(EVENTS, "sum")]
    for column, metrics, _typ in spec.metrics:
        for acc in (a for a in accumulators(metrics) if a in ("n", "sum", "min", "max")):
            sums[f"{column}.{acc}"] = _column(table, f"{column}.{acc}")
            aggs.append((f"{column}.{acc}", "max" if acc == "max" else "min" if acc == "min" else "sum"))
    agg = _aggregate(gid, sums, aggs)

    out: dict[str, pa.Array] = {b: _column(table, b).take(heads) for b in spec.by}
    out[WINDOW_START] = _column(table, WINDOW_START).take(heads)
    out[EVENTS] = _column(agg, f"{EVENTS}_sum")
    for column, metrics, typ in spec.metrics:
        for acc in accumulators(metrics):
            name = f"{column}.{acc}"
            if acc in ("n", "sum", "min", "max"):
                out[name] = _column(agg, f"{name}_{'sum' if acc == 'n' else acc}")
            elif acc == "last":
                last = _column(table, name)
                ts, p, o = (_int64(_column(table, f"{column}.last_{s}")) for s in ("ts", "p", "o"))
                at = _latest(starts, n, as_numpy(last.is_valid()), ts, p, o)
                for col in (name, f"{column}.last_ts", f"{column}.last_p", f"{column}.last_o"):
                    out[col] = _column(table, col).take(at)
            elif acc == "kll":
                out[name] = sketch.merge_groups(_column(table, name), starts)
            elif acc == "set":
                sets = _column(table, name)
                parents = as_numpy(pc.list_parent_indices(sets)).astype(np.int64)
                out[name] = _distinct(gid[parents], pc.list_flatten(sets), groups, typ)
    return pa.Table.from_arrays([out[f.name].cast(f.type) for f in schema], schema=schema)

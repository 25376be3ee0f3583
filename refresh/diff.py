"""Vectorised change detection between two snapshots (pyarrow compute, no Python work per row).

Both tables are first normalised to the contract's canonical Arrow types (:func:`normalize`), so the
stored snapshot and a fresh read compare column by column. Rows are matched on the
key columns with a hash join of (key columns + row index) only; the non-key columns of matched rows
are then compared vectorised. A key change falls out as a delete of the old key plus an insert of the
new one; a delete and a re-insert between two refreshes as an update (or nothing, if equal).

Given the times a changed row would be valid from (``fresh``) and those the published rows were
valid from, the diff also gives each row of the new snapshot its time: an unchanged row keeps the
published one, any other row takes its fresh one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from refresh.errors import DuplicateKey
from refresh.stores.abc import SnapshotRows
from refstream.contract import TIME_TYPE, encode_key, type_from_arrow
from refstream.errors import ContractError, DataError

__all__ = [
    "COMPARE_SLICE",
    "ChangeSet",
    "canonical_schema",
    "canonical_type",
    "check_keys",
    "diff",
    "normalize",
    "take_rows",
    "upsert_into",
    "within",
]

_OLD, _NEW = "__refresh_old_row", "__refresh_new_row"


@dataclass(frozen=True)
class ChangeSet:
    """What to publish: ``upserts`` (whole rows of the new snapshot), ``deletes`` (key columns)."""

    upserts: pa.Table
    deletes: pa.Table
    inserts: int
    updates: int
    #: Per upsert, the time its row is valid from (``timestamp[us, UTC]``); None: not computed.
    valid_from: pa.Array | None = None
    #: Per row of the diff's new snapshot, the time it is valid from; None: not computed.
    snapshot_valid_from: pa.Array | None = None

    @property
    def delete_count(self) -> int:
        return self.deletes.num_rows

    @property
    def messages(self) -> int:
        return self.upserts.num_rows + self.deletes.num_rows

    def __bool__(self) -> bool:
        return self.messages > 0


# ------------------------------------------------------------------------------------ normalising

def canonical_type(t: pa.DataType) -> pa.DataType:
    """The Arrow type every value of contract type ``type_from_arrow(t)`` is held in."""
    if pa.types.is_dictionary(t):
        return canonical_type(t.value_type)
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_floating(t):
        return pa.float64()
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t) or pa.types.is_null(t):
        return pa.string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) \
            or pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_date(t):
        return pa.date32()
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    if pa.types.is_time(t):
        return pa.time64("us")
    if pa.types.is_duration(t):
        return pa.duration("us")
    type_from_arrow(t)  # raises ContractError for types without an encoding (lists, structs...)
    return t


def canonical_schema(schema: pa.Schema, dataset: str = "") -> pa.Schema:
    """``schema`` with every field in its canonical type: what :func:`normalize` makes of a table
    of that schema, without building one."""
    fields = []
    for f in schema:
        try:
            fields.append(pa.field(f.name, canonical_type(f.type)))
        except ContractError as exc:
            raise DataError(f"dataset {dataset}: column {f.name}: {exc}") from None
    return pa.schema(fields)


def normalize(table: pa.Table, dataset: str = "") -> pa.Table:
    """``table`` with every column in its canonical type (no copy for columns already there).
    A column without a changelog encoding (list, struct...) is a :class:`DataError` naming it."""
    fields, cols, changed = [], [], False
    for f, col in zip(table.schema, table.columns, strict=True):
        try:
            t = canonical_type(f.type)
        except ContractError as exc:
            raise DataError(f"dataset {dataset}: column {f.name}: {exc}") from None
        if t != f.type:
            changed = True
            if pa.types.is_timestamp(f.type) and f.type.tz and f.type.tz != "UTC":
                col = pc.cast(col, pa.timestamp(f.type.unit, tz="UTC"))
            col = pc.cast(col, t, safe=False) if pa.types.is_timestamp(t) else pc.cast(col, t)
        fields.append(pa.field(f.name, t))
        cols.append(col)
    if not changed and table.schema.metadata is None:
        return table
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


# ------------------------------------------------------------------------------------------ keys

def check_keys(dataset: str, table: pa.Table, key: Sequence[str]) -> None:
    """Refuse missing key columns, NULL keys and duplicate keys (naming the first duplicate)."""
    missing = [k for k in key if k not in table.column_names]
    if missing:
        raise DataError(f"dataset {dataset}: key column(s) {missing} not in the data "
                        f"(columns: {table.column_names})")
    for k in key:
        nulls = table.column(k).null_count
        if nulls:
            raise DataError(f"dataset {dataset}: key column {k} is NULL in {nulls} row(s)")
    if table.num_rows < 2:
        return
    if len(key) == 1 and _ascending(table.column(key[0])):
        return  # strictly ascending (a table read in key order): no duplicates, no hashing needed
    counts = table.select(list(key)).group_by(list(key), use_threads=False).aggregate([([], "count_all")])
    if counts.num_rows == table.num_rows:
        return
    dups = counts.filter(pc.greater(counts.column("count_all"), 1))
    first = dups.slice(0, 1).to_pylist()[0]
    raise DuplicateKey(f"dataset {dataset}: duplicate key {encode_key(key, first).decode()} "
                       f"({first['count_all']} rows; {dups.num_rows} duplicated key(s) in all)")


def _int64(values: np.ndarray) -> pa.Array:
    """An int64 numpy array as an Arrow array, zero-copy."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def _int_values(arr: pa.Array) -> np.ndarray:
    """The values of a NULL-free int64 Arrow array as numpy, zero-copy."""
    if len(arr) == 0:
        return np.zeros(0, np.int64)
    return np.frombuffer(arr.buffers()[1], np.int64, len(arr), arr.offset * 8)


def _bools(arr: pa.Array) -> np.ndarray:
    """A NULL-free boolean Arrow array as a numpy bool array (from its bitmap)."""
    bits = np.unpackbits(np.frombuffer(arr.buffers()[1], np.uint8), bitorder="little")
    return bits[arr.offset:arr.offset + len(arr)].view(bool)


def _ascending(col: pa.ChunkedArray | pa.Array) -> bool:
    """Is a NULL-free column strictly ascending? (False for types without an order.)"""
    n = len(col)
    if n < 2:
        return True
    try:
        return bool(pc.all(pc.greater(col.slice(1), col.slice(0, n - 1))).as_py())
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        return False


def _int_keys(col: pa.ChunkedArray | pa.Array) -> np.ndarray | None:
    """A NULL-free integer key column as a strictly ascending int64 numpy array, or None."""
    if not pa.types.is_integer(col.type) or col.null_count:
        return None
    keys = _int_values((col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col).cast(pa.int64()))
    if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
        return None
    return keys


def _merge_match(old_keys: np.ndarray, new_keys: np.ndarray) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array]:
    """:func:`_match` for two strictly ascending integer key columns: a binary search per new key
    instead of a hash join (snapshots are written in the order the table was read, usually its key
    order, so this is the common case for integer primary keys)."""
    if len(old_keys) == 0:
        pos = np.zeros(len(new_keys), np.int64)
        hit = np.zeros(len(new_keys), bool)
    else:
        pos = np.minimum(np.searchsorted(old_keys, new_keys), len(old_keys) - 1)
        hit = old_keys[pos] == new_keys
    mn = np.flatnonzero(hit)
    mo = pos[hit].astype(np.int64)
    seen = np.zeros(len(old_keys), bool)
    seen[mo] = True
    return _int64(np.flatnonzero(~hit)), _int64(np.flatnonzero(~seen)), _int64(mn), _int64(mo)


def _indexed_keys(table: pa.Table | SnapshotRows, key: Sequence[str], name: str) -> pa.Table:
    idx = _int64(np.arange(table.num_rows, dtype=np.int64))
    return table.select(list(key)).append_column(name, idx)


def _same_key_types(old: pa.Table | SnapshotRows, new: pa.Table, key: Sequence[str]) -> bool:
    return all(old.schema.field(k).type == new.schema.field(k).type for k in key)


def _match(old: pa.Table | SnapshotRows, new: pa.Table, key: Sequence[str]) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array]:
    """(inserted new rows, deleted old rows, matched new rows, matched old rows) as row indices."""
    if not _same_key_types(old, new, key):
        # A retyped key column encodes to different key bytes: every old key is gone.
        empty = _int64(np.arange(0))
        return _int64(np.arange(new.num_rows)), _int64(np.arange(old.num_rows)), empty, empty
    if len(key) == 1:
        new_keys = _int_keys(new.column(key[0]))
        if new_keys is not None:
            old_keys = _int_keys(old.select(list(key)).column(0))
            if old_keys is not None:
                return _merge_match(old_keys, new_keys)
    j = _indexed_keys(new, key, _NEW).join(_indexed_keys(old, key, _OLD), list(key),
                                           join_type="full outer", use_threads=True)
    n, o = j.column(_NEW), j.column(_OLD)
    n_null, o_null = pc.is_null(n), pc.is_null(o)
    both = pc.invert(pc.or_(n_null, o_null))
    return (_arr(n.filter(o_null)), _arr(o.filter(n_null)), _arr(n.filter(both)), _arr(o.filter(both)))


def _arr(c: pa.ChunkedArray) -> pa.Array:
    return c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c


def _differs(a: pa.ChunkedArray | pa.Array, b: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Per row: do ``a`` and ``b`` hold different values (NULL = NULL, NaN = NaN)?"""
    ne = pc.not_equal(a, b)
    an, bn = pc.is_null(a), pc.is_null(b)
    ne = pc.if_else(pc.or_(an, bn), pc.xor(an, bn), ne)
    if pa.types.is_floating(a.type):
        both = pc.and_(pc.is_nan(a), pc.is_nan(b))
        both_nan = pc.and_kleene(both, pc.is_valid(both))  # NULL -> False
        ne = pc.and_(ne, pc.invert(both_nan))
    return ne


# ------------------------------------------------------------------------------------------ diff

#: Matched rows are compared this many at a time, so the copies ``take`` and ``filter`` make stay
#: small: freed buffers of this size are reused by the allocator, where 1M-row buffers were new memory
#: every time. In a fresh process (every ``refresh run``), the 1M-row diff at 1% changed took 0.72 s
#: with 1M-row slices and 0.15 s with these, most of the difference page faults.
COMPARE_SLICE = 1 << 18


def _changed_rows(old: pa.Table | SnapshotRows, new: pa.Table, key: Sequence[str], mn: pa.Array,
                  mo: pa.Array) -> pa.Array:
    """The rows of ``mn`` (new-row indices, matched with old rows ``mo``) whose values differ.
    Each old column is fetched once (a lazy snapshot reads it from disk then); when ``mo`` ascends (a
    key-ordered match) a lazy snapshot is read one part (row group) of a column at a time instead."""
    values = [name for name in new.column_names if name not in key]
    if not values:
        return _int64(np.arange(0))
    parts = getattr(old, "column_parts", None)
    if parts is not None and len(mo) > 1:
        o, n = _int_values(mo), _int_values(mn)
        if bool(np.all(o[1:] > o[:-1])) and bool(np.all(n[1:] > n[:-1])):
            return _changed_rows_ordered(parts, new, values, n, o)
    slices = [(mn.slice(i, COMPARE_SLICE), mo.slice(i, COMPARE_SLICE)) for i in range(0, len(mn), COMPARE_SLICE)]
    changed: list[pa.Array | None] = [None] * len(slices)
    for name in values:
        old_col, new_col = old.column(name), new.column(name)
        for i, (n, o) in enumerate(slices):
            d = _differs(new_col.take(n), old_col.take(o))
            changed[i] = d if changed[i] is None else pc.or_(changed[i], d)
        del old_col
    return pa.concat_arrays([_arr(n.filter(c)) for (n, _), c in zip(slices, changed, strict=True)])


def _changed_rows_ordered(parts: Callable[[str], Iterator[tuple[int, pa.ChunkedArray]]], new: pa.Table,
                          values: list[str], mn: np.ndarray, mo: np.ndarray) -> pa.Array:
    """:func:`_changed_rows` for ascending ``mn`` and ``mo``: the pairs matched with one part of the
    old column are a contiguous range of both, so only that part of the old column and a contiguous
    range of the new one are needed at a time. (``take`` on a many-chunk column would concatenate
    the whole column first: slow, and a copy of it.)"""
    changed = np.zeros(len(mo), bool)
    for name in values:
        new_col = new.column(name)
        for start, part in parts(name):
            lo, hi = (int(i) for i in np.searchsorted(mo, [start, start + len(part)]))
            old_part = _arr(part)
            del part
            for i in range(lo, hi, COMPARE_SLICE):
                j = min(hi, i + COMPARE_SLICE)
                first = int(mn[i])
                new_part = _arr(new_col.slice(first, int(mn[j - 1]) + 1 - first))
                d = _differs(_pick(new_part, mn[i:j] - first), _pick(old_part, mo[i:j] - start))
                changed[i:j] |= _bools(_arr(d))
            del old_part
    return _int64(mn[changed])


def _pick(values: pa.Array, rows: np.ndarray) -> pa.Array:
    """``values.take(rows)`` for strictly ascending ``rows``: a slice when they are contiguous, else a
    filter, which copies runs of kept rows a block at a time where ``take`` copies value by value
    (4-5x faster on a string column; most matched rows of two snapshots are runs)."""
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    part = values.slice(lo, hi - lo) if lo or hi != len(values) else values
    if hi - lo == len(rows):
        return part
    mask = np.zeros(hi - lo, bool)
    mask[rows - lo] = True
    return part.filter(pa.array(mask))


def take_rows(table: pa.Table, rows: pa.Array) -> pa.Table:
    """``table.take(rows)`` without concatenating a many-chunk table first (which ``take`` does: a
    copy of every column of a 10M-row snapshot to pick a few thousand rows). Order preserved."""
    if table.num_columns == 0 or table.column(0).num_chunks <= 1 or len(rows) == 0 or rows.null_count:
        return table.take(rows)
    idx = _int_values(rows.cast(pa.int64()))
    if idx.min() < 0 or idx.max() >= table.num_rows:
        return table.take(rows)  # raises the usual error
    batches = table.to_batches()
    starts = np.cumsum([0] + [b.num_rows for b in batches])
    order = np.argsort(idx, kind="stable")
    ordered = idx[order]
    bounds = np.searchsorted(ordered, starts)
    picked = [batches[k].take(_int64(ordered[bounds[k]:bounds[k + 1]] - starts[k]))
              for k in range(len(batches)) if bounds[k + 1] > bounds[k]]
    out = pa.Table.from_batches(picked, schema=table.schema).combine_chunks()
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return out.take(_int64(inverse))


def _times(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """NULL-free times as int64 microseconds, in a numpy array of their own (written to)."""
    arr = values.cast(TIME_TYPE).cast(pa.int64())
    return _int_values(_arr(arr) if isinstance(arr, pa.ChunkedArray) else arr).copy()


def _timestamps(values: np.ndarray) -> pa.Array:
    return _int64(values).cast(TIME_TYPE)


def diff(dataset: str, old: pa.Table | SnapshotRows | None, new: pa.Table, key: Sequence[str], *,
         republish_all: bool = False, on_change: Callable[[], None] | None = None,
         fresh: pa.Array | None = None, old_valid_from: pa.Array | pa.ChunkedArray | None = None) -> ChangeSet:
    """Changes that turn ``old`` (the published snapshot, or None) into ``new``.

    Both must be normalised and ``new`` key-checked. ``old`` may be read lazily (:class:`SnapshotRows`):
    its key columns once, then one value column at a time. When the column sets differ (a schema change)
    every matched row counts as updated, since its published value changes shape. ``republish_all``
    sends every row of ``new`` (``--full``) while still counting the real changes. ``on_change`` is
    called once the keys show that there are changes (rows inserted or deleted, or a schema change),
    before the values of the matched rows are compared: the caller can start work that only a run with
    changes needs.

    ``fresh`` (per row of ``new``, NULL-free) is when each row would be valid from if it changed now;
    with it the result carries ``valid_from`` (per upsert) and ``snapshot_valid_from`` (per row of
    ``new``): ``old_valid_from`` (per row of ``old``) for an unchanged row, ``fresh`` for the others.
    Without ``old_valid_from`` (a snapshot written before valid-from times were kept) every row takes
    its fresh time.
    """
    key = list(key)
    if old is None or old.num_rows == 0:
        times = None if fresh is None else fresh.cast(TIME_TYPE)
        return ChangeSet(new, new.select(key).slice(0, 0), new.num_rows, 0, times, times)
    ins, dels, mn, mo = _match(old, new, key)
    comparable = old.schema == new.schema
    if on_change is not None and (len(ins) or len(dels) or (not comparable and len(mn))):
        on_change()
    if comparable and len(mn):
        upd = _changed_rows(old, new, key, mn, mo)
    else:
        upd = mn
    deletes = old.select(key).take(dels)
    rows = pa.concat_arrays([ins, upd])
    upserts = new if republish_all else take_rows(new, rows)
    valid_from = snapshot_valid_from = None
    if fresh is not None:
        now = _times(fresh)
        times = now.copy()
        if old_valid_from is not None and len(mn):
            # Matched rows keep their published time, then the changed ones among them take fresh.
            times[_int_values(mn)] = _times(old_valid_from)[_int_values(mo)]
            changed = _int_values(upd)
            times[changed] = now[changed]
        snapshot_valid_from = _timestamps(times)
        valid_from = snapshot_valid_from if republish_all else fresh.take(rows).cast(TIME_TYPE)
    # Tombstones keep the old key types: they must carry the key bytes that were published.
    return ChangeSet(upserts, deletes, len(ins), len(upd), valid_from, snapshot_valid_from)


def within(old: pa.Table | None, rows: pa.Table, key: Sequence[str]) -> pa.Table | None:
    """The rows of ``old`` whose key occurs in ``rows`` (what an incremental window is compared with)."""
    if old is None or old.num_rows == 0 or rows.num_rows == 0:
        return old
    key = list(key)
    if not _same_key_types(old, rows, key):
        return old.slice(0, 0)
    hit = _indexed_keys(old, key, _OLD).join(rows.select(key), key, join_type="left semi")
    idx = _arr(hit.column(_OLD))
    return old.take(pc.take(idx, pc.sort_indices(idx)))


def upsert_into(old: pa.Table | None, rows: pa.Table, key: Sequence[str]) -> pa.Table:
    """``old`` with ``rows`` replacing the rows of the same key (incremental mode's new snapshot)."""
    if old is None or old.num_rows == 0:
        return rows
    if rows.num_rows == 0:
        return old
    key = list(key)
    keep = _indexed_keys(old, key, _OLD).join(rows.select(key), key, join_type="left anti")
    idx = _arr(keep.column(_OLD))
    kept = old.take(pc.take(idx, pc.sort_indices(idx)))
    return pa.concat_tables([kept, rows.select(old.column_names).cast(old.schema)])

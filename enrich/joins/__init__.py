"""The lookup join of events with dimensions, vectorised with Arrow inside ``mapInArrow``.

Driver side: :func:`plan` resolves the configured joins against the published schemas (names the
join and column at fault) and :func:`enricher` makes the ``mapInArrow`` function the query runs
(:mod:`enrich.query`). Executor side: :class:`Enricher` looks every event key up in the overlay
(latest changes) and then the base of a dimension through a hash index
(:func:`refstream.compat.key_index`: pandas' hash tables) built once per Python worker and version,
then ``take``s the dimension columns. No per-row Python on the hot path.

Every join adds its (prefixed) dimension columns and ``_<prefix><dataset>_matched`` (false: no
reference row - its columns are null). ``how: inner`` drops unmatched events, except dead-letter
rows (``error_column`` set), which must reach the dead-letter topic.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.accumulators import Accumulator
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import BooleanType, StructField, StructType

from enrich.columns import DELETED, KIND, KIND_CORRECTION, RETRACTED, SLOW, VALID_FROM
from enrich.config import JoinConfig
from enrich.dimension.ship import Shipped
from enrich.events import FastEvents
from enrich.events.fastparse import FastParser
from enrich.ipc import from_ipc
from enrich.joins.asof import CLIPPED, VersionIndex, micros, pick
from enrich.worker import settle
from refstream.compat import key_index, spark_schema
from refstream.contract import DatasetSchema
from refstream.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinSpec:
    """One join resolved against a published schema; picklable for the executors."""

    dataset: str
    pairs: tuple[tuple[str, str], ...]        # (input column, key column), in the key's declared order
    key_types: tuple[pa.DataType, ...]        # Arrow types of the key columns
    columns: tuple[tuple[str, str], ...]      # (dimension column, output column)
    out_types: tuple[pa.DataType, ...]        # Arrow types the output columns are sent to Spark as
    matched: str
    inner: bool
    #: An as-of join's event time column (``state.timestamp``); None: the latest version.
    time: str | None = None


def resolve(joins: Sequence[JoinConfig], schemas: Mapping[str, DatasetSchema], input_schema: StructType,
         *, timezone: str = "UTC", source: str = "config",
         time_column: str | None = None) -> tuple[list[JoinSpec], StructType]:
    """Resolve ``joins`` in order; returns the specs and the output schema of the enriched rows.
    ``time_column`` is the events' time (``state.timestamp``), which as-of joins look rows up at;
    the first of them adds :data:`~enrich.joins.asof.CLIPPED` after its columns."""
    fields = list(input_schema.fields)
    names = {f.name for f in fields}
    specs = []
    for i, j in enumerate(joins):
        where = f"{source}: joins[{i}] ({j.dataset})"
        schema = schemas[j.dataset]
        if all(k is None for _, k in j.on):
            if len(schema.key) != len(j.on):
                raise ConfigError(f"{where}: on: names {len(j.on)} column(s) but the dataset's key is "
                                  f"{list(schema.key)}; use on: {{event_col: key_col}}")
            pairs = list(zip([e for e, _ in j.on], schema.key, strict=True))
        else:
            by_key = {k: e for e, k in j.on}
            if set(by_key) != set(schema.key) or len(by_key) != len(j.on):
                raise ConfigError(f"{where}: on: key columns {[k for _, k in j.on]} must be exactly the "
                                  f"dataset's key {list(schema.key)}")
            pairs = [(by_key[k], k) for k in schema.key]
        for ev, _ in pairs:
            if ev not in names:
                raise ConfigError(f"{where}: on: column {ev!r} is neither an event field nor added by an "
                                  f"earlier join (have: {', '.join(sorted(names))})")
        wanted = list(j.columns) if j.columns is not None else [c for c in schema.names if c not in schema.key]
        unknown = [c for c in wanted if c not in schema.names]
        if unknown:
            raise ConfigError(f"{where}: columns: {unknown} not in the published schema {schema.names}")
        dim_struct = spark_schema(schema.spark_ddl(wanted)) if wanted else StructType([])
        out_fields = []
        for f in dim_struct.fields:
            name = j.prefix + f.name
            if name in names:
                raise ConfigError(f"{where}: column {name!r} already exists; select other columns: or "
                                  f"set prefix:")
            out_fields.append(StructField(name, f.dataType, True))
            names.add(name)
        if j.matched_column in names:
            raise ConfigError(f"{where}: column {j.matched_column!r} already exists")
        out_fields.append(StructField(j.matched_column, BooleanType(), False))
        names.add(j.matched_column)
        arrow_out = to_arrow_schema(StructType(out_fields[:-1]), timezone=timezone)
        if j.as_of:
            if time_column is None or time_column not in names:
                raise ConfigError(f"{where}: as_of: the event time column {time_column!r} (state.timestamp) "
                                  "is not among the columns")
            if CLIPPED not in names:
                out_fields.append(StructField(CLIPPED, BooleanType(), False))
                names.add(CLIPPED)
        fields.extend(out_fields)
        arrow_dim = schema.arrow_schema()
        specs.append(JoinSpec(
            dataset=j.dataset, pairs=tuple(pairs),
            key_types=tuple(arrow_dim.field(k).type for _, k in pairs),
            columns=tuple((c, j.prefix + c) for c in wanted),
            out_types=tuple(f.type for f in arrow_out),
            matched=j.matched_column, inner=j.how == "inner", time=time_column if j.as_of else None))
    return specs, StructType(fields)


#: A step before the joins in their pass: one Arrow batch of the pass's input to a table of events.
Step = Callable[[pa.RecordBatch], pa.Table]


def enricher(specs: Sequence[JoinSpec], shipped: Mapping[str, Shipped], error_column: str | None = None,
             parser: FastParser | None = None, parsed_schema: StructType | None = None, first: Step | None = None,
             unmatched: Accumulator[dict[int, int]] | None = None, *, timezone: str = "UTC") -> Enricher | None:
    """The ``mapInArrow`` function of the join pass (:func:`enrich.query.apply_joins` runs it), or None
    when it has nothing to do.

    With a ``parser``, its input holds the Kafka columns (``events.source_columns``) and the events are
    parsed in the same pass into ``parsed_schema`` (``events.fast_schema``, times in ``timezone``)
    before the joins. With a ``first`` step, each Arrow batch goes through it before the joins (the
    state step's packed rows: ``enrich.state.stream.Unpack``). ``unmatched``: an accumulator of
    :class:`enrich.accumulators.KeyedCounts` each task adds its good events some join found no row
    for to, by partition (exact when a task is retried or its stage recomputed)."""
    if parser is not None:
        assert parsed_schema is not None and error_column is not None
        first = FastEvents(parser, to_arrow_schema(parsed_schema, timezone=timezone))
    if not specs and first is None:
        return None
    return Enricher(tuple(specs), dict(shipped), error_column, first, unmatched)


# ------------------------------------------------------------------------------------ executors

class Lookup:
    """A dimension version as executors use it: the table and a hash index over its key.

    The index is built once and probed per batch (:func:`refstream.compat.key_index`).
    """

    def __init__(self, table: pa.Table, key: Sequence[str]) -> None:
        self.table = table.combine_chunks()
        values, _ = _key_values([self.table.column(k).combine_chunks() for k in key])
        self.index = key_index(values)
        self.deleted = (self.table.column(DELETED).to_numpy(zero_copy_only=False)
                        if DELETED in self.table.column_names else None)

    def find(self, values: np.ndarray) -> np.ndarray:
        """Row position of every value in the table, -1 where it has none."""
        return self.index.find(values)


class AsOfLookup(Lookup):
    """An as-of dimension's versions as executors use them (:mod:`enrich.joins.asof`): every version of a
    key with its ``__valid_from`` and ``__deleted``, indexed by key and time."""

    def __init__(self, table: pa.Table, key: Sequence[str]) -> None:
        self.table = table.combine_chunks()
        values, _ = _key_values([self.table.column(k).combine_chunks() for k in key])
        self.versions = VersionIndex(values, self.table.column(VALID_FROM).to_numpy(zero_copy_only=False))
        self.gone: np.ndarray = self.table.column(DELETED).to_numpy(zero_copy_only=False)
        self.deleted = self.gone


def make_lookup(table: pa.Table, key: Sequence[str]) -> Lookup:
    """The lookup of a shipped or stored version: as-of when it holds versions (``__valid_from``)."""
    return AsOfLookup(table, key) if VALID_FROM in table.column_names else Lookup(table, key)


# Reused Python workers keep these across micro-batches: an unchanged version costs a dict lookup.
_BASES: OrderedDict[str, Lookup] = OrderedDict()
_OVERLAYS: OrderedDict[str, Lookup] = OrderedDict()


def _cached(cache: OrderedDict[str, Lookup], ident: str, bc: object, key: Sequence[str], keep: int) -> Lookup:
    """The lookup of version ``ident``, built from ``bc.value`` (a broadcast's bytes) at first use."""
    hit = cache.get(ident)
    if hit is not None:
        cache.move_to_end(ident)
        return hit
    lookup = make_lookup(from_ipc(bc.value), key)  # type: ignore[attr-defined]
    cache[ident] = lookup
    while len(cache) > keep:
        cache.popitem(last=False)
    return lookup


def _key_values(arrays: Sequence[pa.Array]) -> tuple[np.ndarray, np.ndarray]:
    """Hashable key values (int64 or objects) and a null mask; composite keys become one string."""
    if len(arrays) == 1:
        a = arrays[0]
        nulls = a.is_null().to_numpy(zero_copy_only=False)
        if pa.types.is_integer(a.type):
            return a.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False), nulls
        if not (pa.types.is_string(a.type) or pa.types.is_large_string(a.type) or pa.types.is_binary(a.type)):
            a = pc.cast(a, pa.string())
        return a.to_numpy(zero_copy_only=False), nulls
    joined = pc.binary_join_element_wise(*[pc.cast(a, pa.string()) for a in arrays], "\x1f")
    return joined.to_numpy(zero_copy_only=False), joined.is_null().to_numpy(zero_copy_only=False)


def event_keys(t: pa.Table, spec: JoinSpec) -> tuple[np.ndarray, np.ndarray]:
    """Every event's key of join ``spec`` as the lookup hashes it (its ``on`` columns in the key's
    types), and the null mask."""
    return _key_values([_align(t.column(ev).combine_chunks(), typ)
                        for (ev, _), typ in zip(spec.pairs, spec.key_types, strict=True)])


def row_keys(t: pa.Table, key: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Every dimension row's key (columns ``key``) as :func:`event_keys` gives an event's, and the null mask."""
    return _key_values([t.column(k).combine_chunks() for k in key])


def _align(arr: pa.Array, typ: pa.DataType) -> pa.Array:
    """The event's key column in the dimension key's type; values that do not convert match nothing."""
    if arr.type == typ:
        return arr
    try:
        return pc.cast(arr, typ)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        out = []
        for v in arr:
            try:
                out.append(pc.cast(pa.array([v.as_py()], arr.type), typ)[0].as_py())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                out.append(None)
        return pa.array(out, typ)


def _indices(idx: np.ndarray) -> pa.Array:
    return pa.array(idx, pa.int64(), mask=idx < 0)


def join_table(t: pa.Table, spec: JoinSpec, base: Lookup, overlay: Lookup | None,
               error_column: str | None = None) -> pa.Table:
    """Apply one join to ``t`` (one Arrow batch of events)."""
    values, nulls = event_keys(t, spec)
    take_ov: pa.Array | None = None
    pick_ov: pa.Array | None = None
    clipped: np.ndarray | None = None
    if spec.time is not None:
        take_base, take_ov, pick_ov, matched, clipped = _as_of(t, spec.time, values, nulls, base, overlay)
    else:
        take_base, take_ov, pick_ov, matched = _latest(values, nulls, base, overlay)
    for (col, name), typ in zip(spec.columns, spec.out_types, strict=True):
        vals = base.table.column(col).take(take_base)
        if overlay is not None:
            assert take_ov is not None and pick_ov is not None
            vals = pc.if_else(pick_ov, overlay.table.column(col).take(take_ov), vals)
        if vals.type != typ:
            vals = pc.cast(vals, typ)
        t = t.append_column(name, vals)
    t = t.append_column(spec.matched, pa.array(matched, pa.bool_()))
    if clipped is not None:
        t = _with_clipped(t, clipped)
    if spec.inner:
        keep = matched
        if error_column is not None:
            keep = keep | t.column(error_column).is_valid().to_numpy(zero_copy_only=False)
        if SLOW in t.column_names:  # not parsed: the task leaves its rows to the from_json pass
            keep = keep | t.column(SLOW).to_numpy(zero_copy_only=False)
        if RETRACTED in t.column_names:  # a correction without a match retracts its event: it goes on, saying so
            fixed = pc.fill_null(pc.equal(t.column(KIND), KIND_CORRECTION), False).to_numpy(zero_copy_only=False)
            lost = fixed & ~matched
            if lost.any():
                i = t.schema.get_field_index(RETRACTED)
                before = pc.fill_null(t.column(i), False).to_numpy(zero_copy_only=False)
                t = t.set_column(i, RETRACTED, pa.array(before | lost, pa.bool_()))
            keep = keep | fixed
        t = t.filter(pa.array(keep))
    return t


def _latest(values: np.ndarray, nulls: np.ndarray, base: Lookup, overlay: Lookup | None
            ) -> tuple[pa.Array, pa.Array | None, pa.Array | None, np.ndarray]:
    """The newest row of every key: the overlay's change, else the base's row."""
    bi = base.find(values)
    bi[nulls] = -1
    if overlay is None:
        return _indices(bi), None, None, bi >= 0
    oi = overlay.find(values)
    oi[nulls] = -1
    from_ov = oi >= 0
    assert overlay.deleted is not None
    gone = np.zeros(len(oi), dtype=bool)
    gone[from_ov] = overlay.deleted[oi[from_ov]]
    matched = np.where(from_ov, ~gone, bi >= 0)
    bi = np.where(from_ov, -1, bi)
    oi = np.where(gone, -1, oi)
    return _indices(bi), _indices(oi), pa.array(from_ov), matched


def _as_of(t: pa.Table, time: str, values: np.ndarray, nulls: np.ndarray, base: Lookup, overlay: Lookup | None
           ) -> tuple[pa.Array, pa.Array | None, pa.Array | None, np.ndarray, np.ndarray]:
    """The version of every key valid at the event's ``time`` (:mod:`enrich.joins.asof`); a tombstone
    valid then is no match. Also returns the clipped flags."""
    if not isinstance(base, AsOfLookup) or (overlay is not None and not isinstance(overlay, AsOfLookup)):
        raise TypeError("an as-of join got a dimension version without valid-from times")
    times, time_nulls = micros(t.column(time))
    found_ov = overlay.versions.find(values, nulls, times, time_nulls) if overlay is not None else None
    from_ov, row, clipped = pick(base.versions.find(values, nulls, times, time_nulls), found_ov)
    has = row >= 0
    gone = np.zeros(len(row), dtype=bool)
    in_base = has & ~from_ov
    gone[in_base] = base.gone[row[in_base]]
    if overlay is not None:
        in_ov = has & from_ov
        gone[in_ov] = overlay.gone[row[in_ov]]
    matched = has & ~gone
    take_base = _indices(np.where(matched & ~from_ov, row, -1))
    if overlay is None:
        return take_base, None, None, matched, clipped
    return take_base, _indices(np.where(matched & from_ov, row, -1)), pa.array(from_ov), matched, clipped


def _with_clipped(t: pa.Table, clipped: np.ndarray) -> pa.Table:
    """``t`` with :data:`CLIPPED` set where ``clipped`` (or where an earlier as-of join set it)."""
    if CLIPPED in t.column_names:
        i = t.schema.get_field_index(CLIPPED)
        before = pc.fill_null(t.column(i), False).to_numpy(zero_copy_only=False)
        return t.set_column(i, CLIPPED, pa.array(before | clipped, pa.bool_()))
    return t.append_column(CLIPPED, pa.array(clipped, pa.bool_()))


class Enricher:
    """The ``mapInArrow`` function: every join, in order, on every batch of events."""

    def __init__(self, specs: tuple[JoinSpec, ...], shipped: dict[str, Shipped], error_column: str | None,
                 parse: Step | None = None, unmatched: Accumulator[dict[int, int]] | None = None) -> None:
        self.specs, self.shipped, self.error_column, self.parse = specs, shipped, error_column, parse
        self.unmatched = unmatched

    def lookups(self) -> dict[str, tuple[Lookup, Lookup | None]]:
        out = {}
        for ds, s in self.shipped.items():
            base = _cached(_BASES, s.base_id, s.base, s.key, keep=2 * len(self.shipped))
            overlay = (_cached(_OVERLAYS, s.overlay_id, s.overlay, s.key, keep=2 * len(self.shipped))
                       if s.overlay_id is not None else None)
            out[ds] = (base, overlay)
        return out

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        settle()
        lookups: dict[str, tuple[Lookup, Lookup | None]] | None = None
        unmatched = 0
        for b in batches:
            if lookups is None:  # a task without rows fetches no version
                lookups = self.lookups()
            t = self.join(self.parse(b) if self.parse is not None else pa.Table.from_batches([b]), lookups)
            if self.unmatched is not None:
                unmatched += self.count_unmatched(t)
            yield from t.to_batches()
        if self.unmatched is not None:
            from pyspark import TaskContext

            ctx = TaskContext.get()
            self.unmatched.add({ctx.partitionId() if ctx is not None else 0: unmatched})

    def count_unmatched(self, t: pa.Table) -> int:
        """The good events of ``t`` (joined) some join found no row for."""
        if not self.specs:
            return 0
        missed = functools.reduce(pc.or_, [pc.invert(pc.fill_null(t.column(s.matched), True)) for s in self.specs])
        if self.error_column is not None:
            missed = pc.and_(missed, pc.is_null(t.column(self.error_column)))
        if KIND in t.column_names:  # a correction is not an event written
            missed = pc.and_(missed, pc.not_equal(t.column(KIND), KIND_CORRECTION))
        return int(pc.sum(pc.cast(missed, pa.int64())).as_py() or 0)

    def join(self, t: pa.Table, lookups: Mapping[str, tuple[Lookup, Lookup | None]]) -> pa.Table:
        """Every join, in order, on the events ``t``, with the versions of :meth:`lookups`."""
        for spec in self.specs:
            base, overlay = lookups[spec.dataset]
            t = join_table(t, spec, base, overlay, self.error_column)
        return t


# ------------------------------------------------------------------------------ in the streaming plan

#: The local property through which the driver tells a batch's tasks which dimension versions it
#: pinned (set in ``foreachBatch`` before the batch's action, so the plan's stages see it too).
PINNED_PROPERTY = "refstream.pinned"


def pinned_property(shipped: Mapping[str, Shipped], files: str | None,
                    wait: Mapping[str, object] | None = None, corrections: Mapping[str, object] | None = None) -> str:
    """The value of :data:`PINNED_PROPERTY` for one batch: every version's ids and key, the
    directory the shipper wrote them to (None: not written, no join in the plan reads them),
    when a join waits for completeness, the batch's facts (``enrich.state.wait.BatchFacts``), and
    with corrections where the batch's late versions are (``enrich.dimension.corrections``)."""
    value: dict[str, object] = {"files": files, "dims": {ds: [list(s.key), s.base_id, s.overlay_id]
                                                         for ds, s in shipped.items()}}
    if wait is not None:
        value["wait"] = dict(wait)
    if corrections is not None:
        value["corrections"] = dict(corrections)
    return json.dumps(value)


class _FileBytes:
    """A shipped version read from its file (what a broadcast's ``.value`` would give)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def value(self) -> bytes:
        return self.path.read_bytes()


class PlanEnricher(Enricher):
    """The ``mapInArrow`` function of joins placed in the streaming plan (before the state step):
    like :class:`Enricher`, but the versions come from the batch's :data:`PINNED_PROPERTY` and the
    shipper's files, since the plan's Python functions cannot get broadcasts made after it was built."""

    def __init__(self, specs: tuple[JoinSpec, ...], error_column: str | None) -> None:
        super().__init__(specs, {}, error_column)

    def lookups(self) -> dict[str, tuple[Lookup, Lookup | None]]:
        from pyspark import TaskContext

        from enrich.dimension.ship import file_of

        ctx = TaskContext.get()
        raw = ctx.getLocalProperty(PINNED_PROPERTY) if ctx is not None else None
        if raw is None:
            raise RuntimeError(f"no {PINNED_PROPERTY} local property in this task: the in-plan joins ran "
                               "outside a batch the job pinned")
        pinned = json.loads(raw)
        out = {}
        wanted = {s.dataset for s in self.specs}
        for ds, (key, base_id, overlay_id) in pinned["dims"].items():
            if ds not in wanted:
                continue
            keep = 2 * len(pinned["dims"])
            base = _cached(_BASES, base_id, _FileBytes(file_of(pinned["files"], base_id)), key, keep=keep)
            overlay = (_cached(_OVERLAYS, overlay_id, _FileBytes(file_of(pinned["files"], overlay_id)), key, keep=keep)
                       if overlay_id is not None else None)
            out[ds] = (base, overlay)
        return out

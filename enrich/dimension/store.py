"""One dimension's state on the driver: an Arrow *base* plus an *overlay* of changes since it.

Applying a change is O(1) (a dict entry per key; the last record of a key wins). A snapshot for
the executors is the base (unchanged since it was last shipped) and the overlay decoded to Arrow
(typed rows for upserts, key columns plus ``__deleted`` for tombstones). When the overlay grows past
a fraction of the base it is folded into a new base (``compact``), so a changed batch never ships
more than that fraction.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from enrich.columns import DELETED, KEY_BYTES
from enrich.dimension.abc import Record
from refstream import contract
from refstream.errors import ContractError

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Snapshot:
    """What executors need for one version: ``base`` and ``overlay`` hold the key columns and the
    requested columns; ``overlay`` adds ``__deleted`` and is None when there are no changes."""

    dataset: str
    schema: contract.DatasetSchema
    base_gen: int
    overlay_gen: int
    base: pa.Table
    overlay: pa.Table | None


class DimensionState:
    def __init__(self, dataset: str, *, compact_min: int = 10_000, compact_fraction: float = 0.05) -> None:
        self.dataset = dataset
        self.schema: contract.DatasetSchema | None = None
        self.base: pa.Table | None = None
        self.overlay: dict[bytes, bytes | None] = {}
        self.base_gen = 0
        self.overlay_gen = 0
        self._base_key: tuple[str, ...] | None = None  # the key the base was built under
        self.compact_min, self.compact_fraction = compact_min, compact_fraction
        #: The highest ``version`` header among the applied changes, and the publish time (Kafka
        #: timestamp, ms) of the newest applied record: what ``enrich status`` reports per batch.
        self.version = 0
        self.changed_ms: int | None = None
        self._rows: tuple[tuple[int, int], int] | None = None  # (generations, live rows) cache
        #: Per changelog partition, the greatest ``complete_as_of`` of the heartbeats applied.
        self.heartbeats: dict[int, datetime] = {}

    def __len__(self) -> int:
        return (self.base.num_rows if self.base is not None else 0) + len(self.overlay)

    def complete_as_of(self, partitions: Iterable[int]) -> datetime | None:
        """How complete the applied changes are (:func:`refstream.contract.complete_as_of` over the
        topic's ``partitions``): None until a heartbeat with a completeness arrived on each."""
        return contract.complete_as_of(self.heartbeats, partitions)

    def live_rows(self) -> int:
        """Rows of the dimension now: the base less the keys the overlay deletes, plus the overlay's
        new keys (computed once per generation)."""
        gens = (self.base_gen, self.overlay_gen)
        if self._rows is not None and self._rows[0] == gens:
            return self._rows[1]
        base = self.base.num_rows if self.base is not None else 0
        rows = base
        if self.overlay:
            # Each overlay key replaces (or deletes) its base row, if any; each upsert is a row.
            if self.base is not None and base:
                keys = pa.array(list(self.overlay), pa.binary())
                rows -= int(pc.sum(pc.is_in(keys, value_set=self.base.column(KEY_BYTES))).as_py() or 0)
            rows += sum(1 for v in self.overlay.values() if v is not None)
        self._rows = (gens, rows)
        return rows

    # --------------------------------------------------------------------------------- applying

    def apply(self, records: Iterable[Record]) -> int:
        """Apply records in offset order; returns how many changed the state."""
        n = 0
        for rec in records:
            try:
                ch = contract.decode(rec.key, rec.value, rec.headers)
            except ContractError as exc:
                log.error("dataset %s: skipping changelog record at partition %d offset %d: %s",
                          self.dataset, rec.partition, rec.offset, exc)
                continue
            if rec.timestamp_ms is not None:
                self.changed_ms = max(self.changed_ms or 0, rec.timestamp_ms)
            self.version = max(self.version, ch.version)
            if ch.op == contract.OP_HEARTBEAT:
                if ch.complete_as_of is not None and (
                        rec.partition not in self.heartbeats or ch.complete_as_of > self.heartbeats[rec.partition]):
                    self.heartbeats[rec.partition] = ch.complete_as_of
                continue  # current as of its run (changed_ms above); no row changes
            if ch.op == contract.OP_SCHEMA:
                assert ch.schema is not None
                if not ch.schema.same_columns(self.schema):
                    self._set_schema(ch.schema)
                    n += 1
                continue
            self._put(ch, rec)
            n += 1
        if n:
            self.overlay_gen += 1
        return n

    def _put(self, ch: contract.Change, rec: Record) -> None:
        """Keep one upsert or tombstone (the last change of a key replaces the one before)."""
        self.overlay.pop(ch.key, None)  # re-insert: the dict keeps the last change of a key last
        self.overlay[ch.key] = ch.value

    def _set_schema(self, schema: contract.DatasetSchema) -> None:
        log.info("dataset %s: schema %s (key %s)", self.dataset, schema.spark_ddl(), list(schema.key))
        if self.schema is not None and self.base is not None:
            self.compact()
            assert self.base is not None
            self.base = _conform(self.base, schema)
            self.base_gen += 1
        self.schema = schema

    def needs_compaction(self) -> bool:
        if self.schema is not None and self.base is not None and self._base_key != self.schema.key:
            # A re-key: executors look rows up by the new key, which the old rows' tombstones (keyed by
            # the old one) cannot hide in an overlay; only folding them into the base removes them.
            return True
        base_rows = self.base.num_rows if self.base is not None else 0
        return self.base is None or len(self.overlay) > max(self.compact_min, base_rows * self.compact_fraction)

    def compact(self) -> None:
        """Fold the overlay into a new base."""
        if self.schema is None:
            return
        upserts = [(k, v) for k, v in self.overlay.items() if v is not None]
        fresh = self._decode(upserts)
        fresh = fresh.append_column(KEY_BYTES, pa.array([k for k, _ in upserts], pa.binary()))
        if self.base is None:
            base = fresh
        elif self.overlay:
            keep = pc.invert(pc.is_in(self.base.column(KEY_BYTES), value_set=pa.array(list(self.overlay), pa.binary())))
            base = pa.concat_tables([self.base.filter(keep), fresh])
        else:
            base = self.base
        self.base = base.combine_chunks()
        self._base_key = self.schema.key
        self.overlay = {}
        self.base_gen += 1
        self.overlay_gen += 1

    # -------------------------------------------------------------------------------- snapshots

    def snapshot(self, columns: Sequence[str] | None = None) -> Snapshot:
        """The current version for executors, restricted to the key and ``columns``."""
        wanted = self._compacted_columns(columns)
        assert self.schema is not None and self.base is not None
        overlay = None
        if self.overlay:
            items = list(self.overlay.items())
            # A tombstone's key is a JSON object of the key columns: decoding it gives typed keys.
            values = [v if v is not None else k for k, v in items]
            table = self._decode(list(zip([k for k, _ in items], values, strict=True)))
            overlay = table.select(wanted).append_column(
                DELETED, pa.array([v is None for _, v in items], pa.bool_()))
        return Snapshot(self.dataset, self.schema, self.base_gen, self.overlay_gen,
                        self.base.select(wanted), overlay)

    def _compacted_columns(self, columns: Sequence[str] | None) -> list[str]:
        """Compact if due, then the key and ``columns`` (default: all) a snapshot selects, each
        checked against the published schema."""
        if self.schema is None:
            raise ContractError(f"dataset {self.dataset}: no schema record on its changelog yet")
        if self.needs_compaction():
            self.compact()
        wanted = list(self.schema.key) + [c for c in (columns or self.schema.names) if c not in self.schema.key]
        missing = [c for c in wanted if c not in self.schema.names]
        if missing:
            # A schema record dropped (or renamed) a column a join selects: the output schema is fixed
            # at start, so the job cannot go on silently; name what to change.
            raise ContractError(
                f"dataset {self.dataset}: column(s) {', '.join(missing)} selected by a join are no longer "
                f"in the published schema ({', '.join(self.schema.names)}); remove them from the join's "
                f"columns: and restart the job")
        return wanted

    def _decode(self, items: list[tuple[bytes, bytes]]) -> pa.Table:
        assert self.schema is not None
        return decode_rows(self.schema, items)


def decode_rows(schema: contract.DatasetSchema, items: Sequence[tuple[bytes, bytes]]) -> pa.Table:
    """``(key, value)`` records decoded to a table of ``schema``: in bulk, else one by one so that a
    value that does not fit is logged with its key and its row keeps only its key columns."""
    values = [v for _, v in items]
    try:
        return contract.decode_values(schema, values)
    except ContractError:
        pass
    rows = []
    for k, v in items:  # slow path: name the record at fault, keep the others
        try:
            rows.append(contract.decode_values(schema, [v]))
        except ContractError as exc:
            log.error("dataset %s: key %s: %s; its other columns stay null", schema.dataset, k[:200], exc)
            rows.append(contract.decode_values(schema, [k]))
    return pa.concat_tables(rows) if rows else schema.arrow_schema().empty_table()


def _conform(table: pa.Table, schema: contract.DatasetSchema) -> pa.Table:
    """``table`` with the columns of ``schema`` (new ones null, changed types cast when possible)."""
    cols = []
    for f in schema.arrow_schema():
        if f.name in table.column_names:
            try:
                cols.append(pc.cast(table.column(f.name), f.type))
                continue
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                log.warning("dataset %s: column %s cannot be cast to %s; nulls until rows are re-published",
                            schema.dataset, f.name, f.type)
        cols.append(pa.nulls(table.num_rows, f.type))
    extra = [c for c in table.column_names if c not in schema.names and c.startswith("__")]  # KEY_BYTES, ...
    return pa.Table.from_arrays(cols + [table.column(c) for c in extra], names=schema.names + extra)

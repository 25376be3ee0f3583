"""An as-of dimension on the driver: every key's versions, pruned to the join's ``history``.

A version is one changelog record of a key: its row (an upsert) or its absence (a tombstone), valid
from the record's ``valid_from`` header (a record without one: from its publish time). Like
:class:`~enrich.dimension.store.DimensionState`, the state is a *base* table and the changes since
(here every version, not the last per key); executors look both up (:mod:`enrich.joins.asof`), and
compaction folds the changes into a new base and prunes it (:func:`prune`).

Pruning keeps, per key, every version valid at some time within ``history`` counted back from the
key's newest ``valid_from``: the versions from the cut on, and the one valid at the cut. So the
oldest kept version always stays, and an event older than the cut gets that version, clipped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from enrich.columns import DELETED, KEY_BYTES, VALID_FROM
from enrich.dimension.abc import Record
from enrich.dimension.corrections import Entry
from enrich.dimension.store import DimensionState, Snapshot, decode_rows
from refstream import contract

log = logging.getLogger(__name__)

__all__ = ["HistoryState", "Journal", "micros_of", "prune", "version_table"]

_MAX = np.iinfo(np.int64).max

#: What :meth:`HistoryState.end_journal` gives: the versions applied, and the versions of their keys
#: after and before them.
Journal = tuple[list[Entry], pa.Table | None, pa.Table | None]


def micros_of(t: datetime) -> int:
    """An aware time as UTC microseconds since the epoch."""
    return (t - datetime(1970, 1, 1, tzinfo=t.tzinfo)) // timedelta(microseconds=1)


def prune(table: pa.Table, history: timedelta) -> pa.Table:
    """The versions of ``table`` (``__key``, ``__valid_from`` and any other columns; rows in changelog
    order) a key keeps: those valid at some time within ``history`` back from its newest
    ``valid_from``, sorted by key, then time. Of versions of one key with equal times only the last
    in the changelog stays (it is the one valid then)."""
    if table.num_rows == 0:
        return table
    codes, _ = pd.factorize(table.column(KEY_BYTES).to_numpy(zero_copy_only=False))
    vf = table.column(VALID_FROM).to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.lexsort((np.arange(len(vf)), vf, codes))
    c, v = codes[order], vf[order]
    same_next = np.append(c[1:] == c[:-1], False)
    next_v = np.append(v[1:], _MAX)
    group = np.cumsum(np.concatenate([[True], c[1:] != c[:-1]])) - 1
    newest = v[np.flatnonzero(~same_next)][group]
    cut = newest - history // timedelta(microseconds=1)
    # A version holds until the key's next one: it was valid within the window when that is after the cut.
    keep = ~same_next | ((next_v > cut) & (next_v != v))
    return table.take(pa.array(order[keep]))


def version_table(schema: contract.DatasetSchema, keys: Sequence[bytes], values: Sequence[bytes | None],
                  valid_from: Sequence[int] | np.ndarray) -> pa.Table:
    """Versions as a table: the schema's columns (a tombstone: its key columns, decoded from the key
    JSON), ``__key``, ``__valid_from`` and ``__deleted``."""
    rows = decode_rows(schema, [(k, v if v is not None else k) for k, v in zip(keys, values, strict=True)])
    return (rows.append_column(KEY_BYTES, pa.array(list(keys), pa.binary()))
            .append_column(VALID_FROM, pa.array(np.asarray(valid_from, dtype=np.int64), pa.int64()))
            .append_column(DELETED, pa.array([v is None for v in values], pa.bool_())))


def _live(versions: pa.Table) -> int:
    """Keys of a pruned version table (sorted by key, then time) whose newest version is a row."""
    if versions.num_rows == 0:
        return 0
    keys = versions.column(KEY_BYTES).to_numpy(zero_copy_only=False)
    last = np.append(keys[1:] != keys[:-1], True)
    gone = versions.column(DELETED).to_numpy(zero_copy_only=False)
    return int((last & ~gone).sum())


class HistoryState(DimensionState):
    """A :class:`DimensionState` that keeps versions for as-of joins (see the module doc)."""

    def __init__(self, dataset: str, history: timedelta, **kwargs: int | float) -> None:
        super().__init__(dataset, **kwargs)  # type: ignore[arg-type]
        self.history = history
        self.pending: list[tuple[bytes, bytes | None, int]] = []  # (key, value, valid_from) since the base
        self._base_live: tuple[int, int] | None = None  # (base generation, its live keys)
        # While a journal is open (begin_journal): the records applied since, and the state before them.
        self._journal: list[Entry] | None = None
        self._mark = (0, 0)

    def __len__(self) -> int:
        return (self.base.num_rows if self.base is not None else 0) + len(self.pending)

    def _put(self, ch: contract.Change, rec: Record) -> None:
        if ch.valid_from is not None:
            at = micros_of(ch.valid_from)
        else:  # written before valid-from times existed: valid from its publish time
            at = rec.timestamp_ms * 1000 if rec.timestamp_ms is not None else 0
        self.pending.append((ch.key, ch.value, at))
        if self._journal is not None:
            self._journal.append(Entry(ch.key, at, ch.value is None, rec.partition, rec.offset))

    def begin_journal(self) -> None:
        """Record the versions applied from now on (:meth:`end_journal`); a journal still open (an
        attempt that failed before it was ended) goes on."""
        if self._journal is None:
            self._journal, self._mark = [], (self.base_gen, len(self.pending))

    def end_journal(self, *, close: bool = True) -> Journal:
        """The versions applied since :meth:`begin_journal` (in changelog order), and the versions of
        their keys after them and before them (None when a compaction since hides what was before;
        both None when there are none), as :func:`version_table` gives them; the journal stays open
        unless ``close``."""
        entries = self._journal or []
        if close:
            self._journal = None
        if not entries or self.schema is None:
            return entries, None, None
        keys = {e.key for e in entries}
        gen, upto = self._mark
        before = self.versions_of(keys, upto) if gen == self.base_gen else None
        return entries, self.versions_of(keys), before

    def versions_of(self, keys: set[bytes], pending: int | None = None) -> pa.Table:
        """Every version kept of ``keys`` (the base's, then the first ``pending`` changes since it; None:
        all), in changelog order, as :func:`version_table` gives them."""
        assert self.schema is not None
        changes = self.pending if pending is None else self.pending[:pending]
        mine = [c for c in changes if c[0] in keys]
        fresh = version_table(self.schema, [k for k, _, _ in mine], [v for _, v, _ in mine], [t for _, _, t in mine])
        if self.base is None or self.base.num_rows == 0:
            return fresh
        old = self.base.filter(pc.is_in(self.base.column(KEY_BYTES), value_set=pa.array(list(keys), pa.binary())))
        return pa.concat_tables([old, fresh.select(old.column_names)]) if mine else old

    def live_rows(self) -> int:
        """Keys whose newest version is a row (not a tombstone): the base's count, computed once per
        base, corrected for the keys the changes since touched (a scan of the base for those)."""
        gens = (self.base_gen, self.overlay_gen)
        if self._rows is not None and self._rows[0] == gens:
            return self._rows[1]
        if self._base_live is None or self._base_live[0] != self.base_gen:
            self._base_live = (self.base_gen, _live(self.base) if self.base is not None else 0)
        rows = self._base_live[1]
        if self.pending:
            touched = pa.array(list({k for k, _, _ in self.pending}), pa.binary())
            frames = [pd.DataFrame({"k": [k for k, _, _ in self.pending], "t": [t for _, _, t in self.pending],
                                    "gone": [v is None for _, v, _ in self.pending]})]
            if self.base is not None and self.base.num_rows:
                old = self.base.filter(pc.is_in(self.base.column(KEY_BYTES), value_set=touched))
                rows -= _live(old)
                frames.insert(0, pd.DataFrame({"k": old.column(KEY_BYTES).to_pylist(),
                                               "t": old.column(VALID_FROM).to_pylist(),
                                               "gone": old.column(DELETED).to_pylist()}))
            newest = pd.concat(frames).sort_values("t", kind="stable").drop_duplicates("k", keep="last")
            rows += int((~newest["gone"].astype(bool)).sum())
        self._rows = (gens, rows)
        return rows

    def needs_compaction(self) -> bool:
        if self.schema is not None and self.base is not None and self._base_key != self.schema.key:
            return True
        base_rows = self.base.num_rows if self.base is not None else 0
        return self.base is None or len(self.pending) > max(self.compact_min, base_rows * self.compact_fraction)

    def _pending_table(self) -> pa.Table:
        assert self.schema is not None
        return version_table(self.schema, [k for k, _, _ in self.pending], [v for _, v, _ in self.pending],
                             [t for _, _, t in self.pending])

    def compact(self) -> None:
        """Fold the changes into a new base and prune it to ``history``."""
        if self.schema is None:
            return
        fresh = self._pending_table()
        if self.base is not None and self.pending:
            both = pa.concat_tables([self.base, fresh.select(self.base.column_names)])
        else:
            both = self.base if self.base is not None else fresh
        self.base = prune(both, self.history).combine_chunks()
        self._base_key = self.schema.key
        self.pending = []
        self.base_gen += 1
        self.overlay_gen += 1

    def snapshot(self, columns: Sequence[str] | None = None) -> Snapshot:
        """The versions for executors: the key, ``columns``, ``__valid_from`` and ``__deleted`` of the base
        and of the changes since it (None when there are none)."""
        wanted = self._compacted_columns(columns) + [VALID_FROM, DELETED]
        assert self.schema is not None and self.base is not None
        overlay = self._pending_table().select(wanted) if self.pending else None
        return Snapshot(self.dataset, self.schema, self.base_gen, self.overlay_gen, self.base.select(wanted), overlay)


"""The as-of lookup: for each event, the version of its key valid at the event's time.

A dimension's versions are rows with the key columns, the selected columns, ``__valid_from`` (UTC
microseconds) and ``__deleted`` (a tombstone: the key has no row from then on). :class:`VersionIndex`
sorts them once by key and time; :meth:`VersionIndex.find` answers a whole batch of events with
numpy: the version with the greatest ``valid_from`` at or before the event's time (of equal times,
the one later in the changelog), else - the event is older than every version kept of its key - the
oldest version, flagged as *clipped*. No per-row Python.

With few versions per key (at most :attr:`VersionIndex.SCAN`) an event's time is compared with each
of its key's versions, sorted by time: the count at or before it is the position. With more, the
versions' distinct times are ranked once and each version gets the composite ``key_code * S +
rank + 1``, sorted; an event of key code ``g`` whose time has ``r`` distinct version times at or
before it probes ``g * S + r``: the last version at or below that is the one valid at the event's
time when it is of key ``g``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from refstream.compat import key_index

__all__ = ["CLIPPED", "Found", "VersionIndex", "micros", "pick"]

#: The output column saying that an as-of join gave an event the oldest version it keeps of its key
#: because the event is older than that (false on every other event).
CLIPPED = "_as_of_clipped"

_NONE = np.iinfo(np.int64).min


def micros(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A timestamp column (any unit, any zone: instants) as int64 UTC microseconds, and its null mask."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_timestamp(arr.type):
        arr = pc.cast(arr, pa.timestamp("us", tz=arr.type.tz))
    nulls = arr.is_null().to_numpy(zero_copy_only=False)
    return pc.cast(arr, pa.int64()).fill_null(0).to_numpy(zero_copy_only=False), nulls


@dataclass(frozen=True)
class Found:
    """What :meth:`VersionIndex.find` found per event: ``pos`` the version valid at the event's time
    (row of the indexed table, -1: none), ``first`` the key's oldest version (-1: the key has none),
    and their ``valid_from`` times (:data:`_NONE` where absent)."""

    pos: np.ndarray
    first: np.ndarray
    pos_time: np.ndarray
    first_time: np.ndarray


class VersionIndex:
    """The versions of a dimension (``keys``: hashable key values, ``valid_from``: int64 microseconds,
    both one per row in changelog order) indexed for as-of probes. Built once per version shipped."""

    #: Up to this many versions per key, a probe compares an event's time with each of its key's
    #: versions (a few gathers per event); beyond, it uses one ``searchsorted`` over every version.
    SCAN = 8

    def __init__(self, keys: np.ndarray, valid_from: np.ndarray) -> None:
        n = len(keys)
        codes, uniques = pd.factorize(keys, sort=False)
        codes = codes.astype(np.int64)
        self.valid_from = np.asarray(valid_from, dtype=np.int64)
        # By key, then time, then changelog order: the last of equal times wins a probe.
        self.order = np.lexsort((np.arange(n), self.valid_from, codes))
        sorted_codes = codes[self.order]
        self.sorted_times = self.valid_from[self.order]
        self.starts = np.searchsorted(sorted_codes, np.arange(len(uniques), dtype=np.int64))
        self.counts = np.diff(np.append(self.starts, n))
        self.most = int(self.counts.max()) if len(self.counts) else 0
        self.index = key_index(np.asarray(uniques))
        self.composite: np.ndarray | None = None
        if self.most > self.SCAN:
            sorted_all = np.sort(self.sorted_times)
            self.times = sorted_all[np.concatenate([[True], sorted_all[1:] != sorted_all[:-1]])] if n else sorted_all
            self.stride = len(self.times) + 1
            if len(uniques) * self.stride >= 1 << 62:
                raise ValueError(f"{len(uniques)} keys x {len(self.times)} distinct times overflow the as-of index")
            self.composite = sorted_codes * self.stride + np.searchsorted(self.times, self.sorted_times) + 1

    def find(self, values: np.ndarray, nulls: np.ndarray, times: np.ndarray, time_nulls: np.ndarray) -> Found:
        """Probe every event: key ``values`` (null where ``nulls``), times in microseconds (unknown
        where ``time_nulls``: such an event finds no version and is not clipped)."""
        g = self.index.find(values)
        g[nulls | time_nulls] = -1
        has = g >= 0
        gs = np.where(has, g, 0)
        if not len(self.order):
            none = np.full(len(g), -1, dtype=np.int64)
            return Found(none, none, np.full(len(g), _NONE), np.full(len(g), _NONE))
        start = self.starts[gs]
        if self.composite is None:
            # How many of the key's versions (sorted by time) hold from at or before the event's time.
            count = np.where(has, self.counts[gs], 0)
            below = np.zeros(len(g), dtype=np.int64)
            for j in range(self.most):
                within = j < count
                at = np.where(within, start + j, 0)
                below += within & (self.sorted_times[at] <= times)
            p = start + below - 1
        else:
            probe = gs * self.stride + np.searchsorted(self.times, times, side="right")
            p = np.searchsorted(self.composite, probe, side="right") - 1
        ok = has & (p >= start)
        pos = np.where(ok, self.order[np.where(ok, p, 0)], -1)
        first = np.where(has, self.order[start], -1)
        return Found(pos, first, np.where(ok, self.sorted_times[np.where(ok, p, 0)], _NONE),
                     np.where(has, self.sorted_times[start], _NONE))


def pick(base: Found, overlay: Found | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Combine the probes of a base and an overlay of newer changes: per event, which table holds its
    version (true: the overlay), the row there (-1: none), and whether it was clipped. Of equal
    times the overlay's wins (it is later in the changelog)."""
    if overlay is None:
        found = base.pos >= 0
        clipped = ~found & (base.first >= 0)
        return np.zeros(len(base.pos), dtype=bool), np.where(found, base.pos, base.first), clipped
    from_ov = (overlay.pos >= 0) & (overlay.pos_time >= base.pos_time)
    found = (base.pos >= 0) | (overlay.pos >= 0)
    row = np.where(from_ov, overlay.pos, base.pos)
    # Older than every kept version: the oldest of either table (the overlay's on a tie).
    has_first = (base.first >= 0) | (overlay.first >= 0)
    first_ov = (overlay.first >= 0) & ((base.first < 0) | (overlay.first_time <= base.first_time))
    clipped = ~found & has_first
    from_ov = np.where(found, from_ov, first_ov)
    row = np.where(found, row, np.where(first_ov, overlay.first, base.first))
    return from_ov, row, clipped

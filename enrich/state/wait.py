"""Waiting for completeness (``joins[].wait: complete``): which of a bucket's events the state step
holds, and which it releases, each micro-batch. Pure and vectorised; the processor
(:mod:`enrich.state.processor`) keeps the held rows in its bucket's state.

Each batch is decided against the facts the driver recorded for it once, before its first attempt
(:class:`BatchFacts`: the batch's time and each waited-for dataset's ``complete_as_of``, from the
dimension version log), so a replayed batch holds and releases exactly the same events.

* An event is held while some waited-for dataset is not complete as of its time (no completeness
  yet, or ``complete_as_of`` < the event's time) and that dataset's ``max_wait`` has not expired.
  ``max_wait`` counts from the time of the batch that first read the event (wall clock: downtime
  included).
* Released once every dataset is complete as of its time (the join is *final*) or has expired
  (``_provisional: true`` when some dataset is still not complete). Completeness is checked first,
  so when both hold (after a restart, say) the event is final.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from refstream import contract

__all__ = ["READ_MS", "BatchFacts", "Split", "WaitSpec", "admit", "incomplete", "split"]

#: A held event's extra column: the time (epoch ms) of the batch that first read it.
READ_MS = "_read_ms"


@dataclass(frozen=True)
class WaitSpec:
    """The waited-for datasets and their ``max_wait`` in milliseconds; picklable."""

    max_wait_ms: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, waits: Mapping[str, Any]) -> WaitSpec:
        """From ``EnrichConfig.waits`` (dataset -> ``max_wait`` timedelta)."""
        return cls(tuple((ds, int(d.total_seconds() * 1000)) for ds, d in sorted(waits.items())))

    @property
    def datasets(self) -> tuple[str, ...]:
        return tuple(ds for ds, _ in self.max_wait_ms)


@dataclass(frozen=True)
class BatchFacts:
    """What one micro-batch is decided against: its time (epoch ms) and each dataset's completeness
    (epoch microseconds; None: none known yet)."""

    time_ms: int
    complete_us: Mapping[str, int | None]

    @classmethod
    def of(cls, time_ms: int, complete: Mapping[str, str | None]) -> BatchFacts:
        """From the recorded ``complete_as_of`` texts (ISO 8601 UTC)."""
        return cls(time_ms, {ds: None if t is None else _us(contract.parse_time(t)) for ds, t in complete.items()})

    def to_json(self) -> dict[str, Any]:
        return {"time_ms": self.time_ms, "complete_us": dict(self.complete_us)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> BatchFacts:
        return cls(int(raw["time_ms"]), {str(k): None if v is None else int(v) for k, v in raw["complete_us"].items()})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _us(t: datetime) -> int:
    return (t - _EPOCH) // timedelta(microseconds=1)


@dataclass(frozen=True)
class Split:
    """:func:`split`'s answer: the rows released (in the pool's order) with, per row, whether its
    release is provisional, and the rows still held."""

    released: pa.Table
    provisional: np.ndarray
    held: pa.Table
    release: np.ndarray  # per row of the pool, whether it was released


def admit(events: pa.Table, facts: BatchFacts) -> pa.Table:
    """``events`` first read in the batch of ``facts``: with :data:`READ_MS` set to its time."""
    return events.append_column(READ_MS, pa.array(np.full(events.num_rows, facts.time_ms, dtype=np.int64)))


def incomplete(spec: WaitSpec, facts: BatchFacts, ts: np.ndarray) -> np.ndarray:
    """Which of the event times ``ts`` (int64 microseconds) some waited-for dataset is not complete
    past at ``facts``: the events a fresh job would hold now, and release provisional at ``max_wait``."""
    out = np.zeros(len(ts), dtype=bool)
    for ds, _ in spec.max_wait_ms:
        at = facts.complete_us.get(ds)
        out |= np.ones(len(ts), dtype=bool) if at is None else np.asarray(ts, dtype=np.int64) > at
    return out


def split(spec: WaitSpec, facts: BatchFacts, pool: pa.Table, ts_us: str) -> Split:
    """Decide ``pool`` (the rows held so far and this batch's admitted events; ``ts_us``: their time
    column, int64 microseconds, never null) against ``facts``: see the module doc."""
    n = pool.num_rows
    ts = np.asarray(pool.column(ts_us).to_numpy(), dtype=np.int64) if n else np.zeros(0, np.int64)
    read = np.asarray(pool.column(READ_MS).to_numpy(), dtype=np.int64) if n else np.zeros(0, np.int64)
    release = np.ones(n, dtype=bool)
    for ds, max_wait in spec.max_wait_ms:
        at = facts.complete_us.get(ds)
        complete = np.zeros(n, dtype=bool) if at is None else ts <= at
        expired = facts.time_ms - read >= max_wait
        release &= complete | expired
    provisional = incomplete(spec, facts, ts) & release
    mask = pa.array(release)
    return Split(pool.filter(mask), provisional[release], pool.filter(pc.invert(mask)), release)

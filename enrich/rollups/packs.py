"""What the rollup steps' packed values hold (``PACK_KIND`` beside each; :mod:`enrich.state.rollups`)."""

from __future__ import annotations

import pyarrow as pa

__all__ = ["BEYOND", "COUNTS", "COUNTS_SCHEMA", "DEAD", "EVENTS", "IDLE_PROPERTY", "RESULTS", "TICK", "move_kind",
           "partial_kind", "rows_kind"]

#: Events (as the state step emits them), dead letters (``enrich.sinks.deadletter.COLUMNS``) and
#: counts (:data:`COUNTS_SCHEMA`).
EVENTS, DEAD, COUNTS = "events", "dead", "counts"
#: A value that only calls its rollup bucket (a trigger without events: idle finalization).
TICK = "tick"
#: The Spark local property the driver sets for a batch's tasks when a rollup has ``idle_finalize``:
#: JSON ``{"time_ms": the batch's time, "read_ms": the time of the last batch that read events
#: (null: none known)}``, both from Spark's offset log, so a replay decides alike.
IDLE_PROPERTY = "refstream.rollups.idle"
#: The dead-letter reason of an event beyond a rollup's correction horizon (the rollups named after it).
BEYOND = "beyond the rollup horizon"
#: What became of a rollup's events: in a window not final yet, in a final one (a correction), or
#: beyond its horizon (a dead letter).
RESULTS = ("counted", "corrected", "beyond_horizon")
COUNTS_SCHEMA = pa.schema([pa.field("rollup", pa.string(), False), pa.field("result", pa.string(), False),
                           pa.field("events", pa.int64(), False)])


def partial_kind(i: int, source: int) -> str:
    """Rollup ``i``'s partial aggregates (a window table) from state bucket ``source`` to the rollup
    step, which merges a batch's in the order of their source (the same on a replay)."""
    return f"partial:{i}:{source}"


def move_kind(i: int, source: int) -> str:
    """Rollup ``i``'s moves from state bucket ``source`` (a window table with the part's source and
    the move's cause: :func:`enrich.rollups.engine.move`), which replace that bucket's parts."""
    return f"move:{i}:{source}"


def rows_kind(i: int) -> str:
    """Rollup ``i``'s rows written (its output schema), from the rollup step to the job's batch."""
    return f"rollup:{i}"

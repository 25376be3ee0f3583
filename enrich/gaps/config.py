"""The ``gaps:`` section of enrich.yaml as a frozen dataclass (the semantics: docs/gaps.md)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from enrich.gaps.engine import MAX_EVERY_S
from refstream.config import Section, parse_duration

__all__ = ["GapsConfig", "parse_gaps"]

#: The most intervals of silence ``after`` takes (a threshold must stay within int64 microseconds).
MAX_AFTER = 1000.0
_COLUMN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class GapsConfig:
    """``expected_every``: a duration (``every``) or a column the events carry when they reach the
    state step (``every_column``: seconds, or an interval); a gap opens when the device's partition
    reaches ``last_seen + after x expected_every`` without an event of it; ``idle_after`` of wall
    clock without a record makes a partition ``source idle``; the records go to ``kafka`` (a topic,
    keyed by ``gap_id``) and/or ``database`` (``enrich.config.DatabaseOutput``: a row per record)."""

    every: timedelta | None = None
    every_column: str | None = None
    after: float = 3.0
    idle_after: timedelta = timedelta(minutes=5)
    kafka: str | None = None
    database: Any = None

    @property
    def columns(self) -> tuple[str, ...]:
        """The event columns the gaps read (the expected interval's column, if it is one)."""
        return (self.every_column,) if self.every_column is not None else ()


def parse_gaps(top: Section, has_state: bool, database: Callable[[Section], Any] | None = None) -> GapsConfig | None:
    """The ``gaps:`` section of ``top`` (None: absent); a :class:`ConfigError` naming the key at fault."""
    if top.raw("gaps", None) is None:
        return None
    sec = top.section("gaps")
    if not has_state:
        raise top.error("gaps need a state: section (its key is the device, its timestamp the events' time)", "gaps")
    raw = sec.raw("expected_every")
    every = column = None
    if isinstance(raw, str) and _COLUMN.match(raw):
        column = raw
    else:
        try:
            every = parse_duration(raw)
        except (ValueError, OverflowError):
            raise sec.error(f"expected a duration (30s, 5m) or a column name, got {raw!r}", "expected_every") from None
        if every <= timedelta(0) or every.total_seconds() > MAX_EVERY_S:
            raise sec.error(f"must be positive and at most {MAX_EVERY_S:g}s", "expected_every")
    after = sec.get("after", float, 3.0)
    if not 0 < after <= MAX_AFTER:
        raise sec.error(f"must be positive and at most {MAX_AFTER:g} (how many expected intervals of silence open a "
                        "gap)", "after")
    idle = sec.duration("idle_after", timedelta(minutes=5))
    if idle <= timedelta(0):
        raise sec.error("must be positive", "idle_after")
    out = sec.section("output")
    if not any(out.has(k) for k in ("kafka", "database")):
        raise out.error("gaps need an output: kafka: {topic: ...} and/or database: {url: ..., table: ...}")
    kafka = db = None
    if out.has("kafka"):
        kafka = out.topic("kafka")
    if out.has("database") and database is not None:
        db = database(out.section("database"))
    out.done()
    sec.done()
    return GapsConfig(every=every, every_column=column, after=after, idle_after=idle, kafka=kafka, database=db)

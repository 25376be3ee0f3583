"""The ``rollups:`` section of enrich.yaml as frozen dataclasses (the semantics: docs/rollups.md)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

from enrich.rollups.spec import METRICS, Metric
from refstream.config import Section

__all__ = ["FILLED", "FINALS", "PARTS", "STATE_ENDINGS", "RollupConfig", "RollupOutput", "overlap", "parse_rollups"]

#: The endings of the state variables a rollup keeps beside its own (:mod:`enrich.state.rollups`):
#: the last window end a bucket filled by keys to, its final windows, and (a rollup whose rows a
#: late reference version moves) each window's part from each state bucket.
FILLED, FINALS, PARTS = "_filled", "_finals", "_parts"
STATE_ENDINGS = (FILLED, FINALS, PARTS)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class RollupOutput:
    """Where a rollup's rows go, one or both: ``parquet`` a directory of the rollup's own (every
    revision appended, a ``batch_id=<N>`` directory per micro-batch); ``kafka`` a topic, keyed by
    the rollup's keys and ``window_start`` and compacted, written exactly once per batch."""

    parquet: Path | None = None
    kafka: str | None = None
    #: The database table (``enrich.config.DatabaseOutput``): a row per (keys, window), upserted.
    database: Any = None


@dataclass(frozen=True, kw_only=True)
class RollupConfig:
    """One rollup: events grouped by the ``by`` columns (event fields or columns a join adds) and a
    tumbling event-time ``window`` aligned to the epoch, ``metrics`` per column, corrected for
    ``correct_for`` after a window's end (None: the state's ttl); ``fill``: a row with count 0 for
    every empty window between a key's first and last window; ``idle_finalize``: the wall-clock time
    without any event after which open windows are made final (None: never)."""

    name: str
    by: tuple[str, ...]
    window: timedelta
    metrics: tuple[tuple[str, tuple[Metric, ...]], ...]
    output: RollupOutput
    correct_for: timedelta | None = None
    fill: bool = False
    idle_finalize: timedelta | None = None

    @property
    def columns(self) -> tuple[str, ...]:
        """Every event column the rollup reads: its ``by`` columns, then its metrics' columns."""
        return (*self.by, *[c for c, _ in self.metrics if c not in self.by])


def overlap(a: Path, b: Path) -> bool:
    """Whether directories ``a`` and ``b`` are the same or one holds the other (resolved)."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def parse_rollups(top: Section, has_state: bool,
                  database: Callable[[Section], Any] | None = None) -> tuple[RollupConfig, ...]:
    """The ``rollups:`` list of ``top``; a :class:`ConfigError` naming the rollup and key at fault.
    ``database`` reads an ``output.database`` section (the job's reader of its own, in ``enrich.config``)."""
    raw = top.raw("rollups", [])
    if not isinstance(raw, list):
        raise top.error(f"expected a list of rollups, got {raw!r}", "rollups")
    if raw and not has_state:
        raise top.error("rollups need a state: section (its timestamp is the events' time, its watermark "
                        "says when a window is final)", "rollups")
    rollups = tuple(_rollup(Section(r, f"rollups[{i}]", top.source), database) for i, r in enumerate(raw))
    for i, r in enumerate(rollups):
        if any(o.name == r.name for o in rollups[:i]):
            raise top.error(f"rollup name {r.name!r} is used twice", f"rollups[{i}].name")
        # A rollup keeps state variables named after it with these endings (enrich.state.rollups).
        clash = next((o.name for o in rollups if any(r.name == o.name + e for e in STATE_ENDINGS)), None)
        if clash is not None:
            raise top.error(f"rollup name {r.name!r} is taken by rollup {clash!r}'s state; give it another",
                            f"rollups[{i}].name")
        for o in rollups[:i]:
            if r.output.parquet is not None and o.output.parquet is not None \
                    and overlap(o.output.parquet, r.output.parquet):
                raise top.error(f"rollups {o.name!r} and {r.name!r} write the same or nested directories; give "
                                "each its own", f"rollups[{i}].output.parquet")
            if r.output.kafka is not None and o.output.kafka == r.output.kafka:
                raise top.error(f"rollups {o.name!r} and {r.name!r} write the same topic; give each its own",
                                f"rollups[{i}].output.kafka")
            if r.output.database is not None and o.output.database is not None \
                    and (o.output.database.url, o.output.database.table) == (r.output.database.url,
                                                                               r.output.database.table):
                raise top.error(f"rollups {o.name!r} and {r.name!r} write the same table; give each its own",
                                f"rollups[{i}].output.database.table")
    return rollups


def _rollup(sec: Section, database: Callable[[Section], Any] | None) -> RollupConfig:
    name = sec.get("name", str)
    if not _NAME.match(name):
        raise sec.error(f"{name!r} is not a name (letters, digits and _, not first a digit)", "name")
    by = tuple(sec.str_list("by"))
    if not by or len(set(by)) != len(by):
        raise sec.error(f"expected one or more distinct columns, got {list(by)}", "by")
    window = sec.duration("window")
    if window <= timedelta(0) or window % timedelta(milliseconds=1):
        raise sec.error("must be a positive whole number of milliseconds", "window")
    correct_for = sec.duration("correct_for") if sec.has("correct_for") else None
    if correct_for is not None and correct_for <= timedelta(0):
        raise sec.error("must be positive", "correct_for")
    metrics = _metrics(sec.section("metrics"))
    out = sec.section("output")
    if not any(out.has(k) for k in ("parquet", "kafka", "database")):
        raise out.error("a rollup needs an output: parquet: {path: ...}, kafka: {topic: ...} and/or "
                        "database: {url: ..., table: ...}")
    parquet = kafka = db = None
    if out.has("database") and database is not None:
        db = database(out.section("database"))
    if out.has("parquet"):
        pq = out.section("parquet")
        parquet = Path(pq.get("path", str))
        pq.done()
    if out.has("kafka"):
        kafka = out.topic("kafka")
    output = RollupOutput(parquet=parquet, kafka=kafka, database=db)
    out.done()
    idle = sec.duration("idle_finalize") if sec.has("idle_finalize") else None
    if idle is not None and idle <= timedelta(0):
        raise sec.error("must be positive", "idle_finalize")
    cfg = RollupConfig(name=name, by=by, window=window, metrics=metrics, output=output, correct_for=correct_for,
                       fill=sec.get("fill", bool, False), idle_finalize=idle)
    sec.done()
    return cfg


def _metrics(sec: Section) -> tuple[tuple[str, tuple[Metric, ...]], ...]:
    out = cast("list[tuple[str, tuple[Metric, ...]]]", sec.choice_lists("metric", METRICS))
    if not out:
        raise sec.error("expected at least one column and its metrics")
    sec.done()
    return tuple(out)

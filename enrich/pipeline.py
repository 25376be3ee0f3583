"""The enrichment job's plan: its stages in the order the data flows, built once from the config,
the events' schema and the published schemas of the datasets it joins.

::

    read      Kafka records of events.topic                                  (the streaming plan)
    parse     JSON against events.schema: the event fields and _error         (the streaming plan)
    join      the broadcast joins the state needs (their columns are          (the streaming plan,
              aggregated, or other such joins join on them)                    before the state step)
    state     the keyed state step: the partitioned joins, then the device    (the state step)
              state; + state, _late; the devices' gaps (enrich.gaps)
    rollup    each rollup's windows (enrich.rollups)                          (the rollup step)
    join      the other broadcast joins                                       (the join pass, in foreachBatch)
    sink      Kafka, Parquet or the console; dead letters to their topic

Without ``state:`` there is no state step: every join is a broadcast join of the join pass. Every
consumer of the plan takes it from here: the running query (:mod:`enrich.query`), the job
(:mod:`enrich.job`), ``enrich validate --explain`` and ``enrich lookup --state``. This is
the only module that calls :func:`enrich.joins.resolve`.

Building a plan needs an active SparkContext (Spark parses ``events.schema`` and the published
types) but no query, broker or executor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_type
from pyspark.sql.types import BooleanType, IntegerType, StringType, StructField, StructType

from enrich import events, joins
from enrich.calls.fields import columns as call_columns
from enrich.calls.step import CallStep
from enrich.calls.template import STATE as STATE_SCOPE
from enrich.checkpoint import CheckpointLayout
from enrich.columns import (
    BATCH_TIME,
    BUCKET,
    CAUSE,
    FLAT,
    INTERNAL,
    KIND,
    MAX_TS,
    PROVISIONAL,
    RETRACTED,
    REVISION,
    TS_US,
)
from enrich.config import EnrichConfig, JoinConfig
from enrich.gaps.engine import RESERVED, GapSpec
from enrich.joins import JoinSpec
from enrich.joins.asof import CLIPPED
from enrich.joins.partitioned import PartitionedDim, partitioned_dim
from enrich.rollups.spec import RollupSpec
from enrich.state.corrections import CAUSE_TYPE, Corrects, join_again
from enrich.state.engine import StateSpec
from enrich.state.spec import output_fields, resolve
from refstream.contract import DatasetSchema
from refstream.errors import ConfigError

__all__ = ["JoinPass", "Pipeline", "Stage", "StatePlan"]

#: The columns the state step adds to the events on their way through it (an event field of that
#: name would be overwritten).
STEP_COLUMNS = frozenset({BUCKET, TS_US, MAX_TS, BATCH_TIME, PROVISIONAL})
#: What a stage does.
StageKind = Literal["read", "parse", "join", "state", "rollup", "gaps", "sink"]


@dataclass(frozen=True)
class Stage:
    """One step of the plan: what it is, where it runs, and the columns it adds."""

    kind: StageKind
    name: str
    where: str
    adds: tuple[str, ...] = ()

    def line(self) -> str:
        adds = f": + {', '.join(self.adds)}" if self.adds else ""
        return f"{self.kind} {self.name} ({self.where}){adds}"


@dataclass(frozen=True)
class JoinPass:
    """The broadcast joins of the join pass, resolved against the published schemas of one moment
    (a dataset's schema may change while the job runs: the job plans its pass again then)."""

    schemas: Mapping[str, DatasetSchema]
    specs: tuple[JoinSpec, ...]
    columns: tuple[str, ...]        # the output's columns (internal ones left out)
    schema: StructType              # the pass's output rows
    fast_schema: StructType         # the same when the pass parses the events itself (enrich.events.fastparse)


@dataclass(frozen=True)
class StatePlan:
    """The state step and what runs in the streaming plan around it."""

    spec: StateSpec
    before: tuple[JoinConfig, ...]      # broadcast joins run in the plan, before the step
    before_specs: tuple[JoinSpec, ...]  # their specs, inner off: the step counts every event first
    inner: tuple[str, ...]              # the ``matched`` columns of the inner ones among them
    joined: StructType                  # parsed events and the ``before`` joins' columns: the step's input
    dims: tuple[PartitionedDim, ...]    # the partitioned joins, inside the step
    passed: tuple[StructField, ...]     # the columns the step passes through: ``joined``'s, the dims'
    schema: StructType                  # the step's output: ``passed``, the calls' columns, ``state``, ``_late``
    calls: CallStep | None = None       # the external calls, inside the step (enrich.calls)
    rollups: tuple[RollupSpec, ...] = ()  # the rollups: partials in the step, windows in the rollup step
    gaps: GapSpec | None = None         # the devices' gaps, judged in the step (enrich.gaps)


@dataclass(frozen=True)
class Pipeline:
    """The job's plan (see the module doc). Build it with :meth:`build`."""

    cfg: EnrichConfig
    timezone: str
    events: StructType                  # the event fields (events.schema)
    parsed: StructType                  # events.parse's columns
    state: StatePlan | None
    after: tuple[JoinConfig, ...]       # the broadcast joins of the join pass
    join_pass: JoinPass                 # as planned against the schemas the plan was built with
    checkpoint: CheckpointLayout
    corrected: tuple[Corrects, ...] = ()  # the joins with corrections, in join order

    @classmethod
    def build(cls, cfg: EnrichConfig, schemas: Mapping[str, DatasetSchema], *, timezone: str = "UTC") -> Pipeline:
        """The plan of ``cfg`` against ``schemas`` (every joined dataset's published schema); a
        :class:`ConfigError` naming the key and column at fault when the config does not fit them."""
        missing = [ds for ds in cfg.datasets if ds not in schemas]
        if missing:
            raise ValueError(f"no published schema given for dataset(s) {missing}")
        event_schema = events.event_schema(cfg.events.schema, cfg.events.required, cfg.source)
        parsed = events.parsed_schema(event_schema)
        state = _state_plan(cfg, parsed, schemas, timezone) if cfg.state is not None else None
        after = tuple(j for j in cfg.broadcast_joins if state is None or j not in state.before)
        first = _join_pass(cfg, after, schemas, state.schema if state is not None else parsed, timezone)
        corrected = _corrected(cfg, state, after, first, schemas)
        return cls(cfg=cfg, timezone=timezone, events=event_schema, parsed=parsed, state=state, after=after,
                   join_pass=first, checkpoint=CheckpointLayout(cfg.checkpoint), corrected=corrected)

    @property
    def broadcast_datasets(self) -> dict[str, str]:
        """dataset -> changelog topic of the datasets the driver pins and ships."""
        return self.cfg.broadcast_datasets

    def replan(self, schemas: Mapping[str, DatasetSchema]) -> JoinPass:
        """The join pass against ``schemas`` (the broadcast datasets' current published schemas):
        :attr:`join_pass` when they are the ones it was planned with."""
        if all(self.join_pass.schemas.get(ds) == s for ds, s in schemas.items()):
            return self.join_pass
        before = self.state.schema if self.state is not None else self.parsed
        return _join_pass(self.cfg, self.after, {**self.join_pass.schemas, **schemas}, before, self.timezone)

    def stages(self) -> list[Stage]:
        """The plan's stages in the order the data flows."""
        cfg = self.cfg
        ev = cfg.events
        out = [Stage("read", ev.topic, f"Kafka, starting {ev.starting_offsets}, at most "
                                       f"{cfg.max_events_per_batch:,} events per batch"),
               Stage("parse", "events.schema", "pyarrow where exact, else from_json" if ev.parser == "auto"
                     else "from_json", tuple(self.events.fieldNames()))]
        if self.state is not None:
            st = self.state
            for j, s in zip(st.before, st.before_specs, strict=True):
                out.append(_join_stage(j, s, "broadcast, in the plan before the state step"))
            for d in st.dims:
                j = cfg.partitioned_joins[d.index]
                out.append(_join_stage(j, d.join, "partitioned, in the state step"))
            assert cfg.state is not None
            held = "".join(f", holds events until {ds} is complete as of their time (at most "
                           f"{_seconds(w)})" for ds, w in cfg.waits.items())
            out.append(Stage("state", f"keyed by {cfg.state.key}", f"{cfg.state.buckets} buckets, ttl "
                             f"{_seconds(cfg.state.ttl)}, watermark {_seconds(cfg.state.watermark)}{held}",
                             ("state", "_late", *((PROVISIONAL,) if cfg.waits else ()))))
            for r, rc in zip(st.rollups, cfg.rollups, strict=True):
                metrics = ", ".join(f"{c} {'/'.join(ms)}" for c, ms, _ in r.metrics)
                to = [f"Parquet in {rc.output.parquet}"] if rc.output.parquet is not None else []
                to += [f"Kafka topic {rc.output.kafka}"] if rc.output.kafka is not None else []
                out.append(Stage("rollup", r.name, f"by {', '.join(r.by)} per {_seconds(rc.window)} window, "
                                 f"{metrics}, corrected for {r.correct_for_us / 1e6:g}s; to {' and '.join(to)}"))
            if st.gaps is not None and cfg.gaps is not None:
                g = cfg.gaps
                every = g.every_column if g.every_column is not None else _seconds(g.every or timedelta(0))
                to = [f"Kafka topic {g.kafka}"] if g.kafka is not None else []
                to += [g.database.describe().replace("one row per event", "one row per record")] \
                    if g.database is not None else []
                out.append(Stage("gaps", f"after {g.after:g} x {every}", f"in the state step, against each source "
                                 f"partition's time; source idle after {_seconds(g.idle_after)}; to "
                                 f"{' and '.join(to)}"))
        for j, s in zip(self.after, self.join_pass.specs, strict=True):
            out.append(_join_stage(j, s, "broadcast, in the join pass"))
        o = cfg.output
        target = {"kafka": f"Kafka topic {o.topic}, exactly once per batch", "parquet": f"Parquet files in {o.path}",
                  "console": f"the console, {o.rows} rows per batch", "database": ""}[o.kind]
        if o.database is not None:
            target = "; ".join(t for t in (o.database.describe(), target) if t)
        out.append(Stage("sink", o.kind, f"{target}; dead letters to {cfg.dead_letter_topic}"))
        return out

    def explain(self) -> list[str]:
        """:meth:`stages` as numbered lines, then the output's columns."""
        lines = [f"{self.cfg.source}: the job's plan, in order"]
        lines += [f"  {i}. {s.line()}" for i, s in enumerate(self.stages(), 1)]
        lines.append(f"  output columns: {', '.join(self.join_pass.columns)}")
        return lines


def _join_stage(j: JoinConfig, spec: JoinSpec, where: str) -> Stage:
    on = ", ".join(f"{e} = {k}" for e, k in spec.pairs)
    adds = (*[out for _, out in spec.columns], spec.matched)
    if spec.time is not None:  # every as-of join sets the flag; the first one adds it
        where = f"as of {spec.time} (history {_seconds(j.history)}), {where}"
        adds = (*adds, CLIPPED)
    if j.corrections is not None:
        where = f"{where}, late versions corrected for {_seconds(j.corrections)}"
    return Stage("join", j.dataset, f"{j.how}, on {on}, {where}", adds)


def _time(cfg: EnrichConfig) -> str | None:
    """The events' time column, which as-of joins look their rows up at."""
    return cfg.state.timestamp if cfg.state is not None else None


def _seconds(d: timedelta) -> str:
    return f"{d.total_seconds():g}s"


def _join_pass(cfg: EnrichConfig, passed: Sequence[JoinConfig], schemas: Mapping[str, DatasetSchema],
               before: StructType, timezone: str) -> JoinPass:
    specs, out_schema = joins.resolve(passed, schemas, before, timezone=timezone, source=cfg.source, time_column=_time(cfg))
    _, fast_schema = joins.resolve(passed, schemas, events.fast_schema(before), timezone=timezone, source=cfg.source, time_column=_time(cfg))
    columns = tuple(f.name for f in out_schema.fields if f.name not in INTERNAL)
    return JoinPass({ds: schemas[ds] for ds in cfg.broadcast_datasets}, tuple(specs), columns, out_schema,
                    fast_schema)


def _corrected(cfg: EnrichConfig, state: StatePlan | None, after: Sequence[JoinConfig], first: JoinPass,
               schemas: Mapping[str, DatasetSchema]) -> tuple[Corrects, ...]:
    """The joins with corrections: each in the join pass, on columns the state step writes (its
    buckets keep what they wrote and find the events a late version corrects)."""
    out = []
    for i, j in enumerate(cfg.joins):
        if j.corrections is None:
            continue
        where = f"{cfg.source}: joins[{i}].corrections"
        if state is not None and j.strategy == "partitioned":
            out.append(_corrected_dim(cfg, state, j, where, schemas))
            continue
        if state is not None and j in state.before:
            out.append(_corrected_before(cfg, state, j, where, schemas))
            continue
        if state is None:
            raise ConfigError(f"{where}: corrections need a state: section (the state step keeps what it wrote)")
        spec = first.specs[list(after).index(j)]
        outside = [e for e, _ in spec.pairs if e not in state.schema.fieldNames()]
        if outside:
            raise ConfigError(f"{where}: its on: column(s) {outside} come from another join of the join pass; "
                              "corrections need the join's key among the columns the state step writes")
        joined = tuple(c for c, _ in spec.columns)
        out.append(Corrects(spec, tuple(schemas[j.dataset].key), j.corrections // timedelta(microseconds=1), joined))
    db = cfg.output.database
    rerun = _rerun(cfg, state) if state is not None else set()
    inner = [k for k, a in enumerate(cfg.joins) if a.how == "inner" and (a in after or k in rerun
                                                                          or a.corrections is not None)]
    if out and db is not None and db.write == "state" and inner:
        raise ConfigError(f"{cfg.source}: joins[{inner[0]}].how: inner with corrections and output.database "
                          "write: state: a correction that retracts the event a device's row holds would leave "
                          "no row a fresh job writes; use how: left, or write: events")
    return tuple(out)


def _rerun(cfg: EnrichConfig, state: StatePlan) -> set[int]:
    """The indexes (in ``cfg.joins``) of the joins before the state step a correction runs again."""
    corrected = [j.dataset for j in state.before if j.corrections is not None]
    return {cfg.joins.index(state.before[i]) for i in join_again(state.before_specs, corrected)}


def _refuse_uses(cfg: EnrichConfig, adds: set[str], where: str, what: str) -> None:
    """A corrected join's columns (``adds``) that the state step keys or times devices by, or a gap
    uses, refused: what the step made of them would stay as first made. The state's aggregates over
    them are folded again, a rollup over them is kept right (the buckets move the events between its
    windows), and a call reading them is made again."""
    assert cfg.state is not None
    users = [("state: (its key or timestamp)", {cfg.state.key, cfg.state.timestamp}),
             ("gaps:", set(cfg.gaps.columns) if cfg.gaps is not None else set())]
    for who, names in users:
        used = sorted(adds & names)
        if used:
            raise ConfigError(f"{where}: column(s) {used} of {what} are used by {who}, which the corrections do not "
                              "recompute; remove corrections or those uses (docs/state.md)")


def _corrected_before(cfg: EnrichConfig, state: StatePlan, j: JoinConfig, where: str,
                      schemas: Mapping[str, DatasetSchema]) -> Corrects:
    """A broadcast join before the state step with corrections: its buckets join the corrected events
    again with the batch's pinned versions, and the joins before the step on its columns too."""
    assert cfg.state is not None and j.corrections is not None
    at = list(state.before).index(j)
    chain = [state.before_specs[i] for i in join_again(state.before_specs, [j.dataset])]
    adds = {o for s in chain for _, o in s.columns} | {s.matched for s in chain}
    _refuse_uses(cfg, adds, where, "this join (or a join before the state step on them)")
    spec = state.before_specs[at]
    return Corrects(spec, tuple(schemas[j.dataset].key), j.corrections // timedelta(microseconds=1),
                    tuple(c for c, _ in spec.columns), before=True)


def _corrected_dim(cfg: EnrichConfig, state: StatePlan, j: JoinConfig, where: str,
                   schemas: Mapping[str, DatasetSchema]) -> Corrects:
    """A partitioned join with corrections: its buckets find their late versions themselves (they
    hold the key's versions and its events). A gap over its columns is refused (see :func:`_refuse_uses`)."""
    assert cfg.state is not None
    dim = state.dims[list(cfg.partitioned_joins).index(j)]
    _refuse_uses(cfg, {out for _, out in dim.join.columns} | {dim.join.matched}, where, "this partitioned join")
    joined = tuple(c for c, _ in dim.join.columns)
    return Corrects(dim.join, tuple(schemas[j.dataset].key), j.corrections // timedelta(microseconds=1)
                    if j.corrections is not None else 0, joined, dim=dim.index)


def _state_plan(cfg: EnrichConfig, parsed: StructType, schemas: Mapping[str, DatasetSchema],
                timezone: str) -> StatePlan:
    """Which broadcast joins run before the step, the partitioned ones inside it, and the step's
    output; the ``state:`` section checked against the columns it can see."""
    assert cfg.state is not None
    src = cfg.source
    # Every column a join can add, in the order the job adds them: the state section may name any of
    # them, and is refused below if it names one that cannot reach the step.
    _, with_dims = joins.resolve(cfg.partitioned_joins, schemas, parsed, timezone=timezone, source=src, time_column=_time(cfg))
    _, enriched = joins.resolve(cfg.broadcast_joins, schemas, with_dims, timezone=timezone, source=src, time_column=_time(cfg))
    spec = resolve(cfg.state, enriched, timezone=timezone, source=src)
    taken = [f for f in parsed.fieldNames() if f in STEP_COLUMNS or f.startswith(FLAT)]
    if taken:
        raise ConfigError(f"{src}: events.schema: field(s) {taken} are names the state step uses for its own "
                          f"columns ({', '.join(sorted(STEP_COLUMNS))}, {FLAT}*); rename them")
    before = _needed_by_state(cfg, schemas, parsed, with_dims, timezone)
    for j in before:
        if j.wait == "complete":  # the step holds events after these joins ran: they could not wait
            i = cfg.joins.index(j)
            raise ConfigError(f"{src}: joins[{i}].wait: complete is not possible for a join whose columns "
                              "the state: section uses (it runs before the state step, which holds the "
                              "events); use wait: none for it")
    # Each of these needs its on: columns from the events: a column of a partitioned join (added
    # inside the step) or of a join left to the join pass is named by the plan's error.
    specs, joined = joins.resolve(before, schemas, parsed, timezone=timezone, source=src, time_column=_time(cfg))
    inner = tuple(s.matched for s in specs if s.inner)
    # An inner join drops its unmatched events after the state counted them, as it does after the step.
    specs = [dataclasses.replace(s, inner=False) for s in specs]
    dim_specs, _ = joins.resolve(cfg.partitioned_joins, schemas, joined, timezone=timezone, source=src, time_column=_time(cfg))
    dims = tuple(partitioned_dim(i, j.dataset, j.topic, schemas[j.dataset], dataclasses.replace(s, inner=False),
                                 s.inner, j.history if j.as_of else None)
                 for i, (j, s) in enumerate(zip(cfg.partitioned_joins, dim_specs, strict=True)))
    inside = set(joined.fieldNames()) | {out for d in dims for _, out in d.join.columns}
    for name in cfg.state.columns:
        if name not in inside:
            where = "key" if name == cfg.state.key else f"aggregates.{name}"
            raise ConfigError(f"{src}: state.{where}: {name!r} comes from a join that cannot run before "
                              "the state step (docs/state.md)")
    passed = [StructField(f.name, f.dataType, True) for f in joined.fields]
    for d in dims:
        passed += [StructField(out, from_arrow_type(t), True)
                   for (_, out), t in zip(d.join.columns, d.join.out_types, strict=True)]
        passed.append(StructField(d.join.matched, BooleanType(), True))
        if d.join.time is not None and CLIPPED not in [f.name for f in passed]:
            passed.append(StructField(CLIPPED, BooleanType(), True))
    if cfg.waits:  # every event says whether its joins are final (enrich.state.wait)
        passed.append(StructField(PROVISIONAL, BooleanType(), True))
    calls = _check_calls(cfg, spec, [f.name for f in passed]) if cfg.calls else None
    schema = StructType(passed + output_fields(spec, calls.result_columns() if calls is not None else ()))
    if any(j.corrections is not None for j in cfg.joins):  # every row says what it is (enrich.state.corrections)
        schema = StructType([*schema.fields, StructField(KIND, StringType(), True),
                             StructField(REVISION, IntegerType(), True),
                             StructField(CAUSE, from_arrow_type(CAUSE_TYPE), True),
                             StructField(RETRACTED, BooleanType(), True)])
    rollups = _rollups(cfg, passed, enriched, specs, timezone, dims, before)
    gaps = _gaps(cfg, passed, enriched, specs, dims, spec, timezone) if cfg.gaps is not None else None
    return StatePlan(spec=spec, before=tuple(before), before_specs=tuple(specs), inner=inner, joined=joined,
                     dims=dims, passed=tuple(passed), schema=schema, calls=calls, rollups=rollups, gaps=gaps)


def _gaps(cfg: EnrichConfig, passed: list[StructField], enriched: StructType, before: Sequence[JoinSpec],
          dims: Sequence[PartitionedDim], spec: StateSpec, timezone: str) -> GapSpec:
    """The gaps against the columns the state step sees: ``expected_every``'s column, a number of
    seconds or an interval; the records carry every column the joins before and inside the step add."""
    assert cfg.gaps is not None and cfg.state is not None
    g, where = cfg.gaps, f"{cfg.source}: gaps.expected_every"
    types = {f.name: f.dataType for f in passed}
    every_us = g.every // timedelta(microseconds=1) if g.every is not None else None
    if g.every_column is not None:
        name = g.every_column
        if name not in types:
            if name in enriched.fieldNames():
                raise ConfigError(f"{where}: {name!r} comes from a join that cannot run before the state step "
                                  "(docs/gaps.md)")
            raise ConfigError(f"{where}: no such column (have: "
                              f"{', '.join(sorted(n for n in types if not n.startswith('_')))})")
        t = to_arrow_type(types[name], timezone=timezone)
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
                or pa.types.is_duration(t)):
            raise ConfigError(f"{where}: {name!r} is {types[name].simpleString()}; expected a number of seconds or "
                              "an interval")
    refs = [out for s in before for _, out in s.columns] + [out for d in dims for _, out in d.join.columns]
    taken = sorted({*refs, cfg.state.key} & RESERVED)
    if taken:
        raise ConfigError(f"{cfg.source}: gaps: column(s) {taken} (the state key, or a join's before or inside the "
                          f"state step) are named like fields of the gap records ({', '.join(sorted(RESERVED))}); "
                          "rename them with the join's prefix: or columns:")
    return GapSpec(key=cfg.state.key, key_type=spec.key_type, after=g.after, every_us=every_us, every_column=g.every_column,
                   refs=tuple((r, to_arrow_type(types[r], timezone=timezone)) for r in dict.fromkeys(refs) if r != cfg.state.key),
                   ttl_us=cfg.state.ttl // timedelta(microseconds=1), topic=cfg.events.topic)


def _rollups(cfg: EnrichConfig, passed: list[StructField], enriched: StructType,
             before: Sequence[JoinSpec], timezone: str, dims: Sequence[PartitionedDim] = (),
             joined_before: Sequence[JoinConfig] = ()) -> tuple[RollupSpec, ...]:
    """The rollups resolved against the columns the state step passes (the events' fields and the
    columns of the joins before and inside it): each is computed there. A ``fill`` whose ``by``
    columns all come from one broadcast join (``before``: its columns, at least one, and its key)
    fills by that dimension's keys (``fill_keys``). A rollup over a column a correction changes (of
    a partitioned join with corrections, ``dims``; of a join before the step with corrections,
    ``joined_before`` with ``before``, or one on its columns), or every rollup when such a join is
    inner (a correction may retract an event or bring one back), ``moves``."""
    assert cfg.state is not None
    corrected = [d for d, j in zip(dims, cfg.partitioned_joins, strict=True) if j.corrections is not None]
    moving = {out for d in corrected for _, out in d.join.columns} | {d.join.matched for d in corrected}
    every = any(d.inner for d in corrected)
    chain = join_again(before, [j.dataset for j in joined_before if j.corrections is not None])
    moving |= {o for i in chain for _, o in before[i].columns} | {before[i].matched for i in chain}
    every = every or any(joined_before[i].how == "inner" for i in chain)
    types = {f.name: f.dataType for f in passed}
    out = []
    for i, r in enumerate(cfg.rollups):
        where = f"{cfg.source}: rollups[{i}] ({r.name})"
        for name in r.columns:
            if name in types:
                continue
            key = "by" if name in r.by else f"metrics.{name}"
            if name in enriched.fieldNames():
                raise ConfigError(f"{where}.{key}: {name!r} comes from a join that cannot run before the "
                                  "state step (docs/rollups.md)")
            raise ConfigError(f"{where}.{key}: no such column (have: "
                              f"{', '.join(sorted(n for n in types if not n.startswith('_')))})")
        try:
            out.append(RollupSpec(
                name=r.name, by=r.by, by_types=tuple(to_arrow_type(types[b], timezone=timezone) for b in r.by),
                window_us=r.window // timedelta(microseconds=1),
                metrics=tuple((c, ms, to_arrow_type(types[c], timezone=timezone)) for c, ms in r.metrics),
                correct_for_us=(r.correct_for or cfg.state.ttl) // timedelta(microseconds=1), fill=r.fill,
                idle_finalize_us=r.idle_finalize // timedelta(microseconds=1) if r.idle_finalize else None,
                fill_keys=_fill_keys(r.by, before) if r.fill else None,
                gaps=r.fill and cfg.gaps is not None and r.by == (cfg.state.key,),
                moves=every or bool(moving & set(r.columns))))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return tuple(out)


def _fill_keys(by: Sequence[str], before: Sequence[JoinSpec]) -> str | None:
    """The dataset of the broadcast join whose columns (one at least) and key hold all of ``by``."""
    for s in before:
        outputs = {out for _, out in s.columns}
        if set(by) <= outputs | {e for e, _ in s.pairs} and set(by) & outputs:
            return s.dataset
    return None


def _check_calls(cfg: EnrichConfig, spec: StateSpec, passed: list[str]) -> CallStep:
    """The calls' templates against what the step sees (the columns it passes, the state fields, the
    calls' own results) and their result columns against those names."""
    state_fields = [f.name for f in spec.output_type()]
    results = [n for n, _ in call_columns(cfg.calls)]
    for c in cfg.calls:
        where = f"{cfg.source}: calls ({c.name}).body"
        for ref in c.body.refs():
            if ref.scope is None and ref.name not in passed:
                raise ConfigError(f"{where}: {ref}: no such column before the state step (have: "
                                  f"{', '.join(sorted(p for p in passed if not p.startswith('_')))})")
            if ref.scope == STATE_SCOPE and ref.name not in state_fields + results:
                raise ConfigError(f"{where}: {ref}: no such state field (have: {', '.join(state_fields + results)})")
        for col in c.columns:
            if col in passed or col in state_fields:
                raise ConfigError(f"{cfg.source}: calls ({c.name}).response: result column {col!r} is also an "
                                  "event column or a state field; rename the call or the field")
    assert cfg.state is not None
    return CallStep(cfg.calls, spec.key_type, str(cfg.checkpoint))


def _needed_by_state(cfg: EnrichConfig, schemas: Mapping[str, DatasetSchema], parsed: StructType,
                     with_dims: StructType, timezone: str) -> list[JoinConfig]:
    """The broadcast joins the state step needs, in configured order: those adding a column
    ``state:``, a call or a rollup names, and those their ``on`` columns come from."""
    assert cfg.state is not None
    broadcast = cfg.broadcast_joins
    specs, _ = joins.resolve(broadcast, schemas, with_dims, timezone=timezone, source=cfg.source, time_column=_time(cfg))
    # A join on a partitioned join's column cannot run before the step (those are added inside it):
    # what needs it is refused by name below, not by the join's on: error.
    inside = set(with_dims.fieldNames()) - set(parsed.fieldNames())
    needed, chosen = set(cfg.state.columns), set()
    needed |= {r.name for c in cfg.calls for r in c.body.refs() if r.scope is None}
    needed |= {c for r in cfg.rollups for c in r.columns}
    needed |= set(cfg.gaps.columns) if cfg.gaps is not None else set()
    for _ in range(len(specs)):
        for i, s in enumerate(specs):
            if i not in chosen and ({out for _, out in s.columns} | {s.matched}) & needed \
                    and not {e for e, _ in s.pairs} & inside:
                chosen.add(i)
                needed |= {e for e, _ in s.pairs}
    return [j for i, j in enumerate(broadcast) if i in chosen]

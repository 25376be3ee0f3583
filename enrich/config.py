"""``conf/enrich.yaml`` as frozen dataclasses; every error names the file and the key at fault."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast, get_args

from enrich.calls.config import CallConfig, parse_calls
from enrich.gaps.config import GapsConfig, parse_gaps
from enrich.rollups.config import RollupConfig, overlap, parse_rollups
from enrich.source.options import OnOffsetReset
from refstream.config import Section, allowed_values, kafka_settings, load_config_data, redact_url
from refstream.contract import default_topic
from refstream.metrics import MetricsConfig, parse_metrics

__all__ = [
    "DEFAULT_HISTORY",
    "DEFAULT_MAX_EVENTS_PER_BATCH",
    "CallConfig",
    "DatabaseOutput",
    "DatabaseWrite",
    "EnrichConfig",
    "EventSource",
    "EventsConfig",
    "JoinConfig",
    "JoinHow",
    "JoinStrategy",
    "JoinWait",
    "OnOffsetReset",
    "OutputConfig",
    "OutputKind",
    "Parser",
    "StartingOffsets",
    "StateAgg",
    "StateConfig",
    "load",
    "load_config",
    "parse",
]

#: Where a new query starts reading the events.
StartingOffsets = Literal["latest", "earliest"]
#: Which Kafka connector reads the events: this package's Python data source, or Spark's own
#: (``builtin``, when its jar is on the classpath).
EventSource = Literal["python", "builtin"]
#: How event JSON is parsed: ``auto`` with pyarrow where that is exact (:mod:`enrich.events.fastparse`), else
#: Spark's ``from_json``; ``spark`` always with ``from_json``.
Parser = Literal["auto", "spark"]
#: ``left`` keeps events without a match (nulls in the looked-up columns); ``inner`` drops them.
JoinHow = Literal["left", "inner"]
#: Where enriched events go; the key of the ``output:`` section (``database`` alone, or with ``kafka``:
#: the kind is then ``kafka`` and :attr:`OutputConfig.database` is set too).
OutputKind = Literal["kafka", "parquet", "console", "database"]
#: What ``output.database`` keeps: one row per device holding its current state, or one row per event.
DatabaseWrite = Literal["state", "events"]
#: The databases ``output.database.url`` may name (SQLAlchemy URL forms ``postgresql://``, ``mysql+pymysql://``).
DatabaseDialect = Literal["postgresql", "mysql"]
#: Where a join's dimension lives: ``broadcast`` ships every pinned version to the executors (the
#: driver holds it); ``partitioned`` keeps it in the keyed state next to the device state, hashed by
#: the same key (it needs ``state:`` and joins on ``state.key``; docs/state.md).
JoinStrategy = Literal["broadcast", "partitioned"]
#: Whether an as-of join waits for its dataset's completeness before it joins an event.
JoinWait = Literal["none", "complete"]
#: A per-device aggregate of one column (nulls ignored): the latest value, the least, the greatest, the mean.
StateAgg = Literal["last", "min", "max", "mean"]

#: Admission control when ``max_events_per_batch`` is not set: a micro-batch's memory stays bounded.
DEFAULT_MAX_EVENTS_PER_BATCH = 100_000
#: How far back from a key's newest version an as-of join keeps its versions, by default.
DEFAULT_HISTORY = timedelta(days=7)
#: How long (processing time, from when the job first read it) an event waits for completeness at most.
DEFAULT_MAX_WAIT = timedelta(minutes=15)


@dataclass(frozen=True, kw_only=True)
class EventsConfig:
    """The device event stream: one topic of JSON values described by a Spark DDL schema."""

    topic: str
    schema: str
    starting_offsets: StartingOffsets = "latest"
    required: tuple[str, ...] = ()      # event fields that must not be null (else: dead letter)
    source: EventSource = "python"
    parser: Parser = "auto"
    on_offset_reset: OnOffsetReset = "fail"
    fail_on_data_loss: bool = True      # events deleted (retention) before they were read: stop


@dataclass(frozen=True, kw_only=True)
class JoinConfig:
    """One lookup of a reference dataset; ``on`` pairs event columns with the dataset's key columns.

    A pair's key column is ``None`` when ``on:`` was a bare column name: it then matches the
    dataset's (single) key column, whatever its name, resolved once the published schema is known.
    """

    dataset: str
    topic: str
    on: tuple[tuple[str, str | None], ...]
    columns: tuple[str, ...] | None = None     # None: every non-key column
    how: JoinHow = "left"
    prefix: str = ""
    strategy: JoinStrategy = "broadcast"
    #: Join each event with the row valid at its time (``state.timestamp``), not the newest one;
    #: the dimension keeps each key's versions for ``history`` (enrich.dimension.history).
    as_of: bool = False
    history: timedelta = DEFAULT_HISTORY
    #: ``complete``: the state step holds an event until the dataset's completeness (the refresher's
    #: ``complete_as_of``) reaches its time, or ``max_wait`` expires (enrich.state.wait).
    wait: JoinWait = "none"
    max_wait: timedelta = DEFAULT_MAX_WAIT
    #: ``corrections.horizon``: a version that arrives late corrects the events the job wrote with the
    #: version before it, as far back as this behind the watermark (enrich.state.corrections); None: off.
    corrections: timedelta | None = None

    @property
    def matched_column(self) -> str:
        return f"_{self.prefix}{self.dataset}_matched"


@dataclass(frozen=True, kw_only=True)
class StateConfig:
    """The ``state:`` section: a running state per device (``key``), kept until the watermark passes
    its last event time plus ``ttl``; ``aggregates`` pairs a column with the aggregates kept of it.

    Devices are hashed into ``buckets`` groups, each one value in Spark's state store; the count is
    fixed by a checkpoint's first run (docs/state.md). An event more than ``max_future_skew`` ahead
    of the batch's time is a dead letter (None: no limit), as is one whose key (a string or binary)
    is longer than ``max_key_bytes``. A state step's worker whose task's state server does not answer
    a request within ``server_timeout`` fails its task, and the job starts the query again from its
    checkpoint."""

    key: str
    timestamp: str
    ttl: timedelta = timedelta(hours=1)
    watermark: timedelta = timedelta(minutes=5)
    max_future_skew: timedelta | None = timedelta(hours=1)
    aggregates: tuple[tuple[str, tuple[StateAgg, ...]], ...] = ()
    buckets: int = 64
    max_key_bytes: int = 1024
    server_timeout: timedelta = timedelta(minutes=2)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every event column the state reads: key, timestamp, then the aggregated columns."""
        return (self.key, self.timestamp, *[c for c, _ in self.aggregates])

    @property
    def fields(self) -> tuple[str, ...]:
        """The aggregate fields of the ``state`` struct, ``<column>_<agg>``, in configured order."""
        return tuple(f"{c}_{a}" for c, aggs in self.aggregates for a in aggs)


@dataclass(frozen=True, kw_only=True)
class DatabaseOutput:
    """``output.database``: the table the job writes exactly once (created if missing), its fence
    table ``<table>_commits``, and what a row is (:data:`DatabaseWrite`)."""

    url: str
    table: str
    write: DatabaseWrite
    dialect: DatabaseDialect
    #: The longest any statement of the job may run on the database, lock waits included.
    statement_timeout: timedelta = timedelta(seconds=30)

    @property
    def fence(self) -> str:
        """The table of the tasks' commits: (query_id, slot, batch_id)."""
        return f"{self.table}_commits"

    def describe(self) -> str:
        """Where the rows go, for plans and logs (no password)."""
        row = "one row per device (its state)" if self.write == "state" else "one row per event"
        return f"table {self.table} of {redact_url(self.url)}, {row}, exactly once per batch"


@dataclass(frozen=True, kw_only=True)
class OutputConfig:
    """The sink: ``topic`` and ``transactional_id`` are Kafka's, ``path`` Parquet's, ``rows`` the
    console's, ``database`` the database output's (alone, or with Kafka)."""

    kind: OutputKind
    topic: str | None = None
    path: Path | None = None
    transactional_id: str | None = None
    rows: int = 20               # console: rows shown per batch
    database: DatabaseOutput | None = None


@dataclass(frozen=True, kw_only=True)
class EnrichConfig:
    kafka: dict[str, str]
    events: EventsConfig
    joins: tuple[JoinConfig, ...]
    output: OutputConfig
    dead_letter_topic: str
    checkpoint: Path
    state: StateConfig | None = None
    trigger: timedelta = timedelta(seconds=1)
    max_events_per_batch: int = DEFAULT_MAX_EVENTS_PER_BATCH
    bootstrap_timeout: timedelta = timedelta(seconds=60)
    spark_conf: dict[str, str] = field(default_factory=dict)
    metrics: MetricsConfig | None = None       # /metrics of the job (None: off)
    calls: tuple[CallConfig, ...] = ()         # external calls in the state step, ordered by needs
    rollups: tuple[RollupConfig, ...] = ()     # windowed metrics after the state step (enrich.rollups)
    gaps: GapsConfig | None = None             # devices' silences, from the state step (enrich.gaps)
    source: str = "config"

    @property
    def datasets(self) -> dict[str, str]:
        """dataset -> changelog topic, in first-use order."""
        out: dict[str, str] = {}
        for j in self.joins:
            out.setdefault(j.dataset, j.topic)
        return out

    @property
    def broadcast_joins(self) -> tuple[JoinConfig, ...]:
        """The joins the driver pins and ships, in configured order (after the state step)."""
        return tuple(j for j in self.joins if j.strategy == "broadcast")

    @property
    def partitioned_joins(self) -> tuple[JoinConfig, ...]:
        """The joins kept in the keyed state, in configured order (inside the state step)."""
        return tuple(j for j in self.joins if j.strategy == "partitioned")

    @property
    def waits(self) -> dict[str, timedelta]:
        """dataset -> ``max_wait`` of the datasets whose joins wait for completeness (``wait: complete``)."""
        return {j.dataset: j.max_wait for j in self.joins if j.wait == "complete"}

    @property
    def timezone(self) -> str:
        """The time zone timestamps are read and written in without a running session (the operator
        tools, ``enrich validate``): the ``spark:`` section's ``spark.sql.session.timeZone``, else
        UTC, the job's session default (:func:`enrich.session.session_conf`). A running job takes
        its session's."""
        return self.spark_conf.get("spark.sql.session.timeZone", "UTC")

    @property
    def driver_dead_letters(self) -> bool:
        """Whether the driver writes dead letters of its own, whatever the output: the rollups' (events
        beyond a horizon) and the rollup rows and gap records an output could not take."""
        return bool(self.rollups) or self.gaps is not None

    @property
    def broadcast_datasets(self) -> dict[str, str]:
        """dataset -> changelog topic of the datasets the driver holds (broadcast joins)."""
        out: dict[str, str] = {}
        for j in self.broadcast_joins:
            out.setdefault(j.dataset, j.topic)
        return out


def load_config(path_or_mapping: str | os.PathLike[str] | Mapping[str, Any], *,
                source: str | None = None) -> EnrichConfig:
    """Read and validate a job config: a YAML file, or a mapping of the same shape (``${VAR}``
    substituted into its string values as in a file). Either gets the same checks, and
    :class:`~refstream.errors.ConfigError` names the file (for a mapping: ``source``, default
    ``config``) and the bad key."""
    data, src = load_config_data(path_or_mapping, source)
    return parse(data, src)


def load(path: str | os.PathLike[str]) -> EnrichConfig:
    """Read and validate a job config file (:func:`load_config` of a path)."""
    return load_config(path)


def parse(data: Mapping[str, Any], source: str = "config") -> EnrichConfig:
    """Validate config data already read (no ``${VAR}`` substitution: :func:`load_config` does it);
    errors name ``source`` and the key."""
    top = Section(data, "", source)
    settings = kafka_settings(top.section("kafka"))

    ev = top.section("events")
    events = EventsConfig(
        topic=ev.get("topic", str),
        schema=ev.get("schema", str),
        starting_offsets=ev.choice("starting_offsets", StartingOffsets, "latest"),
        required=tuple(ev.str_list("required", [])),
        source=ev.choice("source", EventSource, "python"),
        parser=ev.choice("parser", Parser, "auto"),
        on_offset_reset=ev.choice("on_offset_reset", OnOffsetReset, "fail"),
        fail_on_data_loss=ev.get("fail_on_data_loss", bool, True),
    )
    ev.done()

    raw_joins = top.raw("joins", [])
    if not isinstance(raw_joins, list):
        raise top.error(f"expected a list of joins, got {raw_joins!r}", "joins")
    joins = tuple(_join(Section(_yaml11_on(j), f"joins[{i}]", source)) for i, j in enumerate(raw_joins))
    seen: set[tuple[str, str]] = set()
    for i, j in enumerate(joins):
        if (j.dataset, j.prefix) in seen:
            raise top.error(f"dataset {j.dataset!r} joined twice with the same prefix; give one a "
                            "prefix: to keep their columns apart", f"joins[{i}]")
        seen.add((j.dataset, j.prefix))

    output = _output(top.section("output"))
    state = _state(top.section("state")) if top.has("state") else None
    if output.database is not None and output.database.write == "state" and state is None:
        raise top.error("write: state needs a state: section (the job keeps no device state without one); "
                        "add one or use write: events", "output.database.write")
    _check_partitioned(top, joins, state)
    _check_as_of(top, joins, state)
    calls = parse_calls(top, state is not None)
    rollups = parse_rollups(top, state is not None, functools.partial(_database, write="state"))
    gaps = parse_gaps(top, state is not None, functools.partial(_database, write="events"))
    taken = {events.topic: "events.topic", output.topic: "output.kafka.topic",
             top.get("dead_letter_topic", str): "dead_letter_topic", **{j.topic: "a join's topic" for j in joins}}
    if gaps is not None and gaps.kafka is not None:
        if gaps.kafka in taken or any(r.output.kafka == gaps.kafka for r in rollups):
            raise top.error(f"{gaps.kafka!r} is also {taken.get(gaps.kafka, 'a rollup topic')}; give the gaps a "
                            "topic of their own", "gaps.output.kafka.topic")
    dirs = {Path(top.get("checkpoint", str)).resolve(): "checkpoint"}
    if output.path is not None:
        dirs[output.path.resolve()] = "output.parquet.path"
    for i, r in enumerate(rollups):
        for d, key in dirs.items():
            if r.output.parquet is not None and overlap(r.output.parquet, d):
                raise top.error(f"{r.output.parquet} overlaps {key} {d}; give the rollup a directory of its own",
                                f"rollups[{i}].output.parquet.path")
        if r.output.kafka is not None and r.output.kafka in taken:
            raise top.error(f"{r.output.kafka!r} is also {taken[r.output.kafka]}; give the rollup a topic of its own",
                            f"rollups[{i}].output.kafka.topic")
    if output.database is not None:
        _check_database_names(top, output.database, joins, state, calls)
    # Always bounded: after downtime the backlog is read in batches of this size, not in one.
    max_events = top.get("max_events_per_batch", int, DEFAULT_MAX_EVENTS_PER_BATCH)
    if max_events <= 0:
        raise top.error("must be positive", "max_events_per_batch")
    trigger = top.duration("trigger", timedelta(seconds=1))
    spark_sec = top.section("spark", {})
    spark_conf = {str(k): str(spark_sec.raw(k)).lower() if isinstance(spark_sec.raw(k), bool)
                  else str(spark_sec.raw(k)) for k in list(spark_sec.data)}
    cfg = EnrichConfig(
        kafka=settings,
        events=events,
        joins=joins,
        output=output,
        dead_letter_topic=top.get("dead_letter_topic", str),
        checkpoint=Path(top.get("checkpoint", str)),
        state=state,
        metrics=parse_metrics(top),
        trigger=trigger,
        max_events_per_batch=max_events,
        bootstrap_timeout=top.duration("bootstrap_timeout", timedelta(seconds=60)),
        spark_conf=spark_conf,
        calls=calls,
        rollups=rollups,
        gaps=gaps,
        source=source,
    )
    top.done()
    return cfg


def _yaml11_on(data: Any) -> Any:
    # YAML 1.1 reads a bare ``on:`` key as the boolean true.
    if isinstance(data, dict) and True in data and "on" not in data:
        data = {("on" if k is True else k): v for k, v in data.items()}
    return data


def _join(sec: Section) -> JoinConfig:
    dataset = sec.get("dataset", str)
    raw_on = sec.raw("on")
    on: list[tuple[str, str | None]]
    if isinstance(raw_on, str) and raw_on:
        on = [(raw_on, None)]
    elif isinstance(raw_on, dict) and raw_on and all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in raw_on.items()):
        on = [(k, v) for k, v in raw_on.items()]
    elif isinstance(raw_on, list) and raw_on and all(isinstance(v, str) and v for v in raw_on):
        on = [(v, v) for v in raw_on]
    else:
        raise sec.error(f"expected an event column, a list of columns or a mapping "
                        f"{{event_col: key_col}}, got {raw_on!r}", "on")
    columns = sec.str_list("columns") if sec.has("columns") else None
    cfg = JoinConfig(
        dataset=dataset,
        topic=sec.get("topic", str, default_topic(dataset)),
        on=tuple(on),
        columns=tuple(columns) if columns is not None else None,
        how=sec.choice("how", JoinHow, "left"),
        prefix=sec.get("prefix", str, ""),
        strategy=sec.choice("strategy", JoinStrategy, "broadcast"),
        as_of=sec.get("as_of", bool, False),
        history=sec.duration("history", DEFAULT_HISTORY),
        wait=sec.choice("wait", JoinWait, "none"),
        max_wait=sec.duration("max_wait", DEFAULT_MAX_WAIT),
        corrections=_corrections(sec),
    )
    if cfg.history <= timedelta(0):
        raise sec.error("must be positive", "history")
    if sec.has("history") and not cfg.as_of:
        raise sec.error("applies to as_of joins only; set as_of: true or remove it", "history")
    if cfg.wait == "complete" and not cfg.as_of:
        raise sec.error("complete needs as_of: true (an event waits until the dataset is complete as of its time)",
                        "wait")
    if cfg.wait == "complete" and cfg.strategy == "partitioned":
        raise sec.error("complete applies to broadcast joins only (the driver tracks a broadcast dataset's "
                        "completeness); use strategy: broadcast or wait: none", "wait")
    if cfg.max_wait <= timedelta(0):
        raise sec.error("must be positive", "max_wait")
    if sec.has("max_wait") and cfg.wait != "complete":
        raise sec.error("applies to joins with wait: complete only; set it or remove max_wait", "max_wait")
    if cfg.corrections is not None:
        if not cfg.as_of:
            raise sec.error("corrections need as_of: true (a late version is one valid from before the events "
                            "it corrects)", "corrections")
        if cfg.corrections > cfg.history:
            raise sec.error(f"horizon {cfg.corrections} is longer than the join's history {cfg.history}: the "
                            "versions an event within the horizon was joined with would be gone", "corrections")
    sec.done()
    return cfg


def _corrections(sec: Section) -> timedelta | None:
    if sec.raw("corrections", None) is None:
        return None
    sub = sec.section("corrections")
    horizon = sub.duration("horizon")
    if horizon <= timedelta(0):
        raise sub.error("must be positive", "horizon")
    sub.done()
    return horizon


def _check_partitioned(top: Section, joins: tuple[JoinConfig, ...], state: StateConfig | None) -> None:
    """A partitioned dimension lives in the state step's buckets, hashed by ``state.key``: it needs
    the step, and its join must be on that key alone (each bucket then holds its devices' rows)."""
    strategies: dict[str, set[str]] = {}
    for j in joins:
        strategies.setdefault(j.dataset, set()).add(j.strategy)
    for i, j in enumerate(joins):
        if j.strategy != "partitioned":
            continue
        where = f"joins[{i}].strategy"
        if state is None:
            raise top.error("partitioned needs a state: section (the dimension is kept in the state step, "
                            "keyed by state.key); add one or use broadcast", where)
        if len(j.on) != 1 or j.on[0][0] != state.key:
            raise top.error(f"partitioned joins on state.key ({state.key!r}) alone, not on "
                            f"{[e for e, _ in j.on]}; use broadcast for this dataset", where)
        if len(strategies[j.dataset]) > 1:
            raise top.error(f"dataset {j.dataset!r} is joined both partitioned and broadcast; pick one", where)


def _check_as_of(top: Section, joins: tuple[JoinConfig, ...], state: StateConfig | None) -> None:
    """An as-of join looks rows up at the event's time, ``state.timestamp``: it needs the section.
    A dataset's driver or bucket copy is either a history or the latest rows, so every join of one
    dataset agrees on ``as_of`` and ``history``."""
    seen: dict[str, tuple[bool, timedelta, str, timedelta, timedelta | None]] = {}
    for i, j in enumerate(joins):
        if j.as_of and state is None:
            raise top.error("as_of needs a state: section (an event's time is its state.timestamp)",
                            f"joins[{i}].as_of")
        first = seen.setdefault(j.dataset, (j.as_of, j.history, j.wait, j.max_wait, j.corrections))
        if first != (j.as_of, j.history, j.wait, j.max_wait, j.corrections):
            raise top.error(f"dataset {j.dataset!r} is joined with different as_of/history/wait/max_wait/corrections "
                            "settings; give every join of it the same", f"joins[{i}].as_of")


def _state(sec: Section) -> StateConfig:
    key = sec.get("key", str)
    timestamp = sec.get("timestamp", str)
    if not key:
        raise sec.error("must name an event column", "key")
    if not timestamp:
        raise sec.error("must name an event column", "timestamp")
    if key == timestamp:
        raise sec.error(f"{timestamp!r} is also the key", "timestamp")
    ttl = sec.duration("ttl", timedelta(hours=1))
    if ttl <= timedelta(0):
        raise sec.error("must be positive", "ttl")
    watermark = sec.duration("watermark", timedelta(minutes=5))
    max_future_skew = sec.optional_duration("max_future_skew", timedelta(hours=1))
    buckets = sec.get("buckets", int, 64)
    if buckets <= 0:
        raise sec.error("must be positive", "buckets")
    max_key_bytes = sec.get("max_key_bytes", int, 1024)
    if max_key_bytes <= 0:
        raise sec.error("must be positive", "max_key_bytes")
    server_timeout = sec.duration("server_timeout", timedelta(minutes=2))
    if server_timeout <= timedelta(0):
        raise sec.error("must be positive", "server_timeout")
    aggs = sec.section("aggregates", {})
    aggregates = cast("list[tuple[str, tuple[StateAgg, ...]]]",
                      aggs.choice_lists("aggregate", allowed_values(StateAgg)))
    aggs.done()
    cfg = StateConfig(key=key, timestamp=timestamp, ttl=ttl, watermark=watermark, max_future_skew=max_future_skew,
                      aggregates=tuple(aggregates), buckets=buckets, max_key_bytes=max_key_bytes,
                      server_timeout=server_timeout)
    sec.done()
    return cfg


_TABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,55}")  # room for the fence table's suffix in 64 characters
_DIALECTS: dict[str, DatabaseDialect] = {"postgresql": "postgresql", "postgres": "postgresql",
                                         "postgresql+psycopg": "postgresql", "mysql": "mysql",
                                         "mysql+pymysql": "mysql", "mariadb": "mysql", "mariadb+pymysql": "mysql"}


def _database(sec: Section, write: DatabaseWrite | None = None) -> DatabaseOutput:
    """``output.database`` (``write``: fixed by the caller, a rollup's table: not read)."""
    url = sec.get("url", str)
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in _DIALECTS:
        raise sec.error("expected a postgresql://... or mysql+pymysql://... URL", "url")
    table = sec.get("table", str)
    if not _TABLE.fullmatch(table):
        raise sec.error(f"{table!r} is not a table name (letters, digits, _; at most 56 characters)", "table")
    timeout = sec.duration("statement_timeout", timedelta(seconds=30))
    if timeout <= timedelta(0):
        raise sec.error("must be positive", "statement_timeout")
    out = DatabaseOutput(url=url, table=table, write=write or sec.choice("write", DatabaseWrite), dialect=_DIALECTS[scheme],
                         statement_timeout=timeout)
    sec.done()
    return out


#: PostgreSQL's longest identifier, in bytes (NAMEDATALEN - 1): a longer name is cut short
#: silently, so the job would create one table and then look for another.
PG_NAME_BYTES = 63


def database_names_too_long(db: DatabaseOutput, columns: Sequence[str]) -> list[str]:
    """The names among ``db``'s tables and ``columns`` that PostgreSQL would cut short."""
    if db.dialect != "postgresql":
        return []
    return [n for n in (db.table, db.fence, *columns) if len(n.encode()) > PG_NAME_BYTES]


def _check_database_names(top: Section, db: DatabaseOutput, joins: Sequence[JoinConfig], state: StateConfig | None,
                          calls: Sequence[CallConfig]) -> None:
    """The table and column names the job would create that the config decides, against
    PostgreSQL's limit (the columns published schemas add are checked at the table's creation)."""
    fields = ["events", "first_seen", "last_seen", *(state.fields if state else ()),
              *(c for call in calls for c in call.columns)]
    columns = [*(j.matched_column for j in joins), *(j.prefix + c for j in joins for c in (j.columns or ()))]
    if db.write == "state":
        assert state is not None
        columns += [state.key, *fields]
    elif state is not None:
        columns += [f"state_{f}" for f in fields]
    long = database_names_too_long(db, columns)
    if long:
        raise top.error(f"PostgreSQL names are at most {PG_NAME_BYTES} bytes; the job would create "
                        f"{', '.join(repr(n) + f' ({len(n.encode())} bytes)' for n in long)}: shorten the table, "
                        "the state aggregates' columns or the joins' prefix", "output.database")


def _output(sec: Section) -> OutputConfig:
    kinds: list[OutputKind] = [k for k in get_args(OutputKind) if sec.has(k)]
    database = _database(sec.section("database")) if "database" in kinds else None
    if database is not None and kinds != ["database"]:
        if kinds != ["kafka", "database"]:
            raise sec.error("database: goes alone or with kafka:, not with parquet: or console:")
        kinds = ["kafka"]
    if len(kinds) != 1:
        raise sec.error(f"needs exactly one of {', '.join(k + ':' for k in get_args(OutputKind))}")
    kind = kinds[0]
    if kind == "database":
        sec.done()
        return OutputConfig(kind=kind, database=database)
    sub = sec.section(kind, {})
    if kind == "kafka":
        out = OutputConfig(kind=kind, topic=sub.get("topic", str),
                           transactional_id=sub.get("transactional_id", str, None), database=database)
    elif kind == "parquet":
        out = OutputConfig(kind=kind, path=Path(sub.get("path", str)))
    else:
        out = OutputConfig(kind=kind, rows=sub.get("rows", int, 20))
    sub.done()
    sec.done()
    return out

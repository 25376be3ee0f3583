"""``enrich validate [--connect] [--explain]``: what a config would run, checked without running it.

Loading the config checks every key; :func:`check_schema` has Spark parse ``events.schema`` (and checks
``events.required`` against it) as the job would at start, in a local session; :func:`connect`
reaches the broker and the topics the job reads, reporting every problem rather than the first;
:func:`explain` plans the job's pipeline (:mod:`enrich.pipeline`) against the schemas the refresher
published and prints its stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from enrich.config import EnrichConfig
from refstream import kafka
from refstream.config import format_duration
from refstream.errors import one_line

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["BROKER_TIMEOUT", "check_calls", "check_schema", "connect", "explain", "summary"]

#: How long the broker may take to answer a metadata request.
BROKER_TIMEOUT = 10.0


def summary(cfg: EnrichConfig) -> list[str]:
    """What the job would do: the events it reads, each join in order, where the output goes."""
    ev = cfg.events
    out = cfg.output
    target = {"kafka": f"Kafka topic {out.topic}", "parquet": f"Parquet files in {out.path}",
              "console": f"the console ({out.rows} rows per batch)", "database": ""}[out.kind]
    if out.database is not None:
        target = "; ".join(t for t in (out.database.describe(), target) if t)
    lines = [f"{cfg.source}: events from {ev.topic} (starting {ev.starting_offsets}, source {ev.source}, "
             f"parser {ev.parser}), broker {cfg.kafka.get('bootstrap.servers', '?')}",
             f"  schema: {ev.schema}" + (f"; required: {', '.join(ev.required)}" if ev.required else "")]
    for j in cfg.joins:
        on = ", ".join(f"{e} = {k or '<key>'}" for e, k in j.on)
        cols = ", ".join(j.columns) if j.columns is not None else "every non-key column"
        lines.append(f"  join {j.dataset} ({j.how}) from {j.topic} on {on}: {cols}"
                     + (f" as {j.prefix}*" if j.prefix else ""))
    for c in cfg.calls:  # in the order they run (needs first)
        refresh = "once" if c.refresh is None else "every event" if c.every_event else f"after {format_duration(c.refresh)}"
        lines.append(f"  call {c.name}: {c.method} {c.shown_url}, refresh {refresh}, on_error {c.on_error}"
                     + (f", after {', '.join(c.needs)}" if c.needs else "") + f": {', '.join(c.columns)}")
    lines.append(f"  output: {target}; dead letters to {cfg.dead_letter_topic}; checkpoint {cfg.checkpoint}; "
                 f"trigger {cfg.trigger.total_seconds():g}s, at most {cfg.max_events_per_batch:,} events per batch")
    return lines


def check_schema(cfg: EnrichConfig) -> str:
    """``events.schema`` parsed by Spark as the job parses it (:class:`ConfigError` naming the key
    when it is not a field list, or ``events.required`` names a field it lacks), and the calls'
    templates against it (:func:`check_calls`); its simple string.
    Uses the active SparkSession, else starts a local one and stops it."""
    from enrich.events import event_schema

    with _session():
        schema = event_schema(cfg.events.schema, cfg.events.required, cfg.source)
    check_calls(cfg, schema.fieldNames())
    return schema.simpleString()


def check_calls(cfg: EnrichConfig, fields: list[str]) -> None:
    """The calls' templates against what is known without the broker: an event column a template
    names must be one of the event ``fields`` or a column a join adds (``columns:`` with its prefix,
    or its ``_matched`` flag); a join without ``columns:`` adds columns known only from its published
    schema, so a name it may add is left to ``--explain`` and the job's start. :class:`ConfigError`
    naming the call and the column."""
    from refstream.errors import ConfigError

    known = set(fields) | {j.matched_column for j in cfg.joins}
    for j in cfg.joins:
        if j.columns is None:
            return
        known |= {j.prefix + c for c in j.columns}
    for c in cfg.calls:
        for ref in c.body.refs():
            if ref.scope is None and ref.name not in known:
                raise ConfigError(f"{cfg.source}: calls ({c.name}).body: {ref}: neither an event field nor a "
                                  f"join's column (have: {', '.join(sorted(n for n in known if not n.startswith('_')))})")


def explain(cfg: EnrichConfig) -> list[str]:
    """The job's pipeline as :meth:`enrich.pipeline.Pipeline.explain` prints it, planned against the
    schemas published on the changelog topics (read from the broker, as the job reads them at start:
    a dataset with none after :data:`BROKER_TIMEOUT` is a :class:`TransientError` naming it)."""
    from enrich.joins.partitioned import published_schema
    from enrich.pipeline import Pipeline

    with _session() as spark:
        schemas = {ds: published_schema(spark, cfg.kafka, ds, topic, BROKER_TIMEOUT)
                   for ds, topic in cfg.datasets.items()}
        timezone = cfg.timezone
        return Pipeline.build(cfg, schemas, timezone=timezone).explain()


@contextmanager
def _session() -> Iterator[SparkSession]:
    """The active SparkSession, else a local one stopped at the end."""
    from pyspark.sql import SparkSession

    from enrich.session import build_session

    active = SparkSession.getActiveSession()
    spark = active or build_session("local[1]", "refstream-enrich-validate")
    try:
        yield spark
    finally:
        if active is None:
            spark.stop()


def connect(cfg: EnrichConfig, out: Callable[[str], None]) -> list[str]:
    """Reach the broker and look up the job's topics, writing one line per check to ``out``; the
    problems found (a broker out of reach, a changelog topic not published yet), [] when none."""
    servers = cfg.kafka.get("bootstrap.servers", "?")
    try:
        # log_level 0: librdkafka's own line per reconnect attempt says nothing the one below does not.
        client = kafka.admin({**cfg.kafka, "log_level": 0}, cached=False)
        topics = client.list_topics(timeout=BROKER_TIMEOUT).topics
    except Exception as exc:  # noqa: BLE001 - KafkaException, or a settings error librdkafka refuses
        out(f"  broker {servers}: FAILED: cannot reach Kafka: {one_line(exc)}")
        return [f"broker {servers}: cannot reach Kafka: {one_line(exc)}"]
    out(f"  broker {servers}: reachable, {len(topics)} topic(s)")

    def found(topic: str) -> str | None:
        t = topics.get(topic)
        return f"{len(t.partitions)} partition(s)" if t is not None and t.error is None else None

    problems = []
    out(f"  events {cfg.events.topic}: {found(cfg.events.topic) or 'missing (the job waits for it)'}")
    for dataset, topic in cfg.datasets.items():
        parts = found(topic)
        if parts is None:
            problems.append(f"join {dataset}: changelog topic {topic} does not exist: run the refresher "
                            f"(refresh run {dataset}) before the job")
        out(f"  join {dataset}: changelog {topic}: {parts or 'MISSING'}")
    if cfg.output.kind == "kafka" and cfg.output.topic is not None:
        out(f"  output {cfg.output.topic}: {found(cfg.output.topic) or 'missing (created by the job)'}")
    return problems

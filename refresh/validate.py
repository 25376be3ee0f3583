"""``refresh validate [--connect]``: what a config would run, checked without running it.

Loading the config already checks every key (cron expressions are parsed by the scheduler at load);
this prints, per dataset, where it reads, how, when and to which topic. With ``connect`` it also
reaches each source (a SQL query for no rows; a file source's files) and the broker (its topics),
reporting every problem rather than stopping at the first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from refresh.config import DatasetConfig, RefreshConfig
from refresh.sources import open_source
from refstream import kafka
from refstream.errors import one_line

__all__ = ["BROKER_TIMEOUT", "connect", "duration", "summary"]

log = logging.getLogger(__name__)

#: How long the broker may take to answer a metadata request.
BROKER_TIMEOUT = 10.0


def summary(config: RefreshConfig) -> list[str]:
    """One line per dataset: source, mode, key, topic and trigger, as the daemon would run them."""
    lines = [f"{config.path}: {len(config.datasets)} dataset(s), broker "
             f"{config.kafka.get('bootstrap.servers', '?')}, state in {config.state_dir}"]
    for ds in config.datasets.values():
        lines.append(f"  {ds.name}: {_how(ds)} of {ds.source.describe()}, key {list(ds.key)} -> topic "
                     f"{ds.topic}; {_when(ds)}")
    return lines


def duration(td: timedelta) -> str:
    """``td`` as the config writes durations: ``1d6h``, ``30s``, ``250ms``."""
    ms = round(td.total_seconds() * 1000)
    if ms % 1000:
        return f"{ms}ms"
    out, rest = "", ms // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            out += f"{rest // size}{unit}"
            rest %= size
    return out or "0s"


def _how(ds: DatasetConfig) -> str:
    inc = ds.incremental
    if inc is None:
        return "diff"
    reconcile = f", full diff every {duration(inc.reconcile_every)}" if inc.reconcile_every else ""
    return f"incremental on {inc.column} (lag {duration(inc.lag)}{reconcile})"


def _when(ds: DatasetConfig) -> str:
    parts = []
    if ds.schedule.every is not None:
        parts.append(f"every {duration(ds.schedule.every)}")
    elif ds.schedule.cron is not None:
        from apscheduler.triggers.cron import CronTrigger

        trigger = CronTrigger.from_crontab(ds.schedule.cron)  # parsed already at load: cannot fail
        nxt = trigger.get_next_fire_time(None, datetime.now(UTC))
        parts.append(f"cron '{ds.schedule.cron}' (next {nxt:%Y-%m-%d %H:%M %Z})")
    if ds.watch:
        parts.append("on file change")
    return ", ".join(parts) or "at daemon start and on `refresh run` only"


def connect(config: RefreshConfig, out: Callable[[str], None]) -> list[str]:
    """Reach every source and the broker, writing one line per check to ``out``; the problems found
    (one line each, naming the dataset or the broker), [] when everything answered."""
    problems: list[str] = []
    for ds in config.datasets.values():
        try:
            found = open_source(ds).probe()
        except Exception as exc:  # noqa: BLE001 - every source is checked, each failure reported
            msg = one_line(exc)
            msg = msg if f"dataset {ds.name}" in msg else f"dataset {ds.name}: {msg}"
            problems.append(msg)
            out(f"  {ds.name}: source FAILED: {msg}")
        else:
            out(f"  {ds.name}: source {found}")
    servers = config.kafka.get("bootstrap.servers", "?")
    try:
        # log_level 0: librdkafka's own line per reconnect attempt says nothing the one below does not.
        client = kafka.admin({**config.kafka, "log_level": 0}, cached=False)
        topics = client.list_topics(timeout=BROKER_TIMEOUT).topics
    except Exception as exc:  # noqa: BLE001 - KafkaException, or a settings error librdkafka refuses
        problems.append(f"broker {servers}: cannot reach Kafka: {one_line(exc)}")
        out(f"  broker {servers}: FAILED: cannot reach Kafka: {one_line(exc)}")
        return problems
    out(f"  broker {servers}: reachable, {len(topics)} topic(s)")
    for ds in config.datasets.values():
        t = topics.get(ds.topic)
        state = f"{len(t.partitions)} partition(s)" if t is not None and t.error is None \
            else f"missing (created with {ds.partitions} partition(s) by the first run)"
        out(f"  {ds.name}: topic {ds.topic}: {state}")
    return problems

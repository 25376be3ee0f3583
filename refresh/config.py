"""``conf/refresh.yaml`` as frozen dataclasses.

Relative paths (``state_dir``, a file source's ``path``) are resolved against the current working
directory at load time (the directory ``refresh`` is started from, like SQLite URLs), and stored
absolute, so a later ``chdir`` changes nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from refstream.config import Section, is_off, kafka_settings, load_config_data, redact_url
from refstream.contract import TOPIC_CONFIG, check_type, default_topic
from refstream.errors import ConfigError, ContractError
from refstream.metrics import MetricsConfig, parse_metrics
from refstream.retry import RetryPolicy

__all__ = [
    "DatasetConfig",
    "FileFormat",
    "FileSourceConfig",
    "IncrementalConfig",
    "Mode",
    "RefreshConfig",
    "Schedule",
    "SourceConfig",
    "SourceKind",
    "SqlReader",
    "SqlSourceConfig",
    "default_max_age",
    "is_mysql_url",
    "load_config",
]

log = logging.getLogger(__name__)

#: How a dataset is refreshed: diff every row against the published snapshot, or read from a cursor.
Mode = Literal["diff", "incremental"]
#: What a source reads: a SQL table or query, or files.
SourceKind = Literal["sql", "files"]
FileFormat = Literal["csv", "jsonl", "parquet"]
#: What reads a MySQL/MariaDB source: ConnectorX (Arrow-native, Rust) or PyMySQL; ``auto`` takes
#: ConnectorX where it can read the URL and every column exactly, PyMySQL otherwise.
SqlReader = Literal["auto", "connectorx", "pymysql"]
_EXT_FORMATS: dict[str, FileFormat] = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
                                       ".parquet": "parquet", ".pq": "parquet"}


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """When the daemon runs a dataset: a fixed interval or a cron expression (or neither: on demand)."""

    every: timedelta | None = None
    cron: str | None = None


@dataclass(frozen=True, kw_only=True)
class SqlSourceConfig:
    """A SQL table or query (exactly one of ``table`` and ``query``) at a SQLAlchemy ``url``."""

    kind: ClassVar[SourceKind] = "sql"

    url: str
    table: str | None = None
    query: str | None = None
    chunk_rows: int = 50_000
    # None: no limit. ``connect``: establishing a connection; ``read``: the longest silence while
    # waiting for the server (PyMySQL); ``statement``: the longest a statement may run on the server
    # (MariaDB max_statement_time, MySQL max_execution_time, PostgreSQL statement_timeout; also
    # bounds lock waits).
    connect_timeout: timedelta | None = timedelta(seconds=10)
    read_timeout: timedelta | None = timedelta(minutes=10)
    statement_timeout: timedelta | None = timedelta(hours=1)
    # MySQL/MariaDB only (:data:`SqlReader`). ``read_partitions`` > 1: ConnectorX reads a table in that
    # many key ranges at once, on connections of their own (a single-column integer primary key).
    reader: SqlReader = "auto"
    read_partitions: int = 1

    def describe(self) -> str:
        return f"{redact_url(self.url)} {'table ' + self.table if self.table else 'query'}"


def is_mysql_url(url: str) -> bool:
    """Whether a SQLAlchemy URL is a MySQL/MariaDB one (``mysql+pymysql://``, ``mariadb://``...)."""
    return url.split(":", 1)[0].split("+", 1)[0].lower() in ("mysql", "mariadb")


@dataclass(frozen=True, kw_only=True)
class FileSourceConfig:
    """Files: ``path`` is a file or a glob (absolute once loaded), ``format`` from the extension unless given."""

    kind: ClassVar[SourceKind] = "files"

    path: str
    format: FileFormat
    chunk_rows: int = 50_000
    types: tuple[tuple[str, str], ...] = ()   # column -> contract type, overriding inference
    # Read only once every matching file's size and mtime stayed the same this long (a writer may
    # still be at work), waiting at most ``stable_timeout`` for it.
    stable_for: timedelta = timedelta(seconds=1)
    stable_timeout: timedelta = timedelta(seconds=60)

    def describe(self) -> str:
        return self.path


#: Where a dataset comes from.
SourceConfig = SqlSourceConfig | FileSourceConfig


@dataclass(frozen=True, kw_only=True)
class IncrementalConfig:
    """Cursor settings of ``mode: incremental``."""

    column: str
    lag: timedelta = timedelta(seconds=30)
    # How far below the watermark an integer or decimal cursor re-reads, in cursor units (ids):
    # the ``lag`` of cursors that are not times.
    numeric_lag: int = 1000
    # A full diff this often (None: never), the one read that sees hard deletes and rows whose
    # cursor is NULL.
    reconcile_every: timedelta | None = timedelta(days=1)


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    name: str
    topic: str
    key: tuple[str, ...]
    mode: Mode
    schedule: Schedule
    watch: bool
    source: SourceConfig
    incremental: IncrementalConfig | None = None   # set exactly when mode is incremental
    allow_empty: bool = False
    partitions: int = 1
    # A run deleting more than this share of the committed rows is refused (a partial source).
    max_delete_fraction: float = 0.1
    # A record stays uncompacted this long, so a restarted job finds what its checkpoint recorded.
    min_compaction_lag: timedelta = timedelta(hours=24)
    # `refresh status --check` fails when the last successful run is older than this (None: no limit).
    max_age: timedelta | None = None

    @property
    def topic_config(self) -> dict[str, str]:
        """Configuration of the changelog topic when the refresher creates it."""
        return {**TOPIC_CONFIG, "min.compaction.lag.ms": str(int(self.min_compaction_lag.total_seconds() * 1000))}


@dataclass(frozen=True, kw_only=True)
class RefreshConfig:
    path: Path              # the file loaded; for a mapping, the name its errors use
    kafka: dict[str, str]
    state_dir: Path
    datasets: dict[str, DatasetConfig]
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Names this refresher on the broker: dataset D publishes as transactional.id "<refresher_id>.D".
    refresher_id: str = "refstream-refresh"
    # The daemon serves /metrics and its status page here (None: off).
    metrics: MetricsConfig | None = None

    def dataset(self, name: str) -> DatasetConfig:
        try:
            return self.datasets[name]
        except KeyError:
            known = ", ".join(sorted(self.datasets)) or "none"
            raise ConfigError(f"{self.path}: no dataset {name!r} (known: {known})") from None

    def __hash__(self) -> int:  # dict fields: hash by identity of the file loaded
        return hash((self.path, tuple(self.datasets)))


def _abs(p: str) -> str:
    return p if os.path.isabs(p) else os.path.abspath(p)


def load_config(path_or_mapping: str | os.PathLike[str] | Mapping[str, Any], *,
                source: str | None = None) -> RefreshConfig:
    """Read and validate a refresher config: a YAML file, or a mapping of the same shape (``${VAR}``
    substituted into its string values as in a file). Either gets the same checks, and
    :class:`ConfigError` names the file (for a mapping: ``source``, default ``config``) and the bad key.
    """
    data, src = load_config_data(path_or_mapping, source)
    p = Path(src)
    root = Section(data, "", src)
    kafka = kafka_settings(root.section("kafka"))
    state_dir = Path(_abs(root.get("state_dir", str, "var/refresh")))
    retry = _retry(root.section("retry", {}))
    refresher_id = root.get("refresher_id", str, RefreshConfig.refresher_id)
    if not refresher_id.strip():
        raise root.error("must not be empty", "refresher_id")
    dsec = root.section("datasets")
    datasets: dict[str, DatasetConfig] = {}
    for name in dsec.data:
        if not isinstance(name, str) or not name or "/" in name or name.startswith(("_", ".")):
            raise dsec.error(f"bad dataset name {name!r} (letters, digits, - and _; not starting with _)")
        datasets[name] = _dataset(name, dsec.section(name))
        dsec.raw(name)
    dsec.done()
    metrics = parse_metrics(root)
    root.done()
    return RefreshConfig(path=p, kafka=kafka, state_dir=state_dir, datasets=datasets, retry=retry,
                        refresher_id=refresher_id, metrics=metrics)


def _retry(sec: Section) -> RetryPolicy:
    d = RetryPolicy()
    policy = RetryPolicy(attempts=sec.get("attempts", int, d.attempts),
                         initial=sec.duration("initial", timedelta(seconds=d.initial)).total_seconds(),
                         maximum=sec.duration("maximum", timedelta(seconds=d.maximum)).total_seconds())
    if policy.attempts < 1:
        raise sec.error("must be at least 1", "attempts")
    sec.done()
    return policy


def _dataset(name: str, sec: Section) -> DatasetConfig:
    source = _source(sec.section("source"))
    key = tuple(sec.str_list("key"))
    if len(set(key)) != len(key):
        raise sec.error(f"repeats a column: {list(key)}", "key")
    mode: Mode = sec.choice("mode", Mode, "diff")
    schedule = _schedule(sec.section("schedule", {}))
    cursor = _incremental(sec.section("incremental", {}))
    incremental = None
    if mode == "incremental":
        if not isinstance(source, SqlSourceConfig):
            raise sec.error("incremental mode needs a SQL source (files are always diffed)", "mode")
        if cursor is None:
            raise sec.error("is required in incremental mode", "incremental.column")
        incremental = cursor
    elif sec.has("incremental"):
        raise sec.error("only valid with mode: incremental", "incremental")
    watch = sec.get("watch", bool, False)
    if watch and not isinstance(source, FileSourceConfig):
        raise sec.error("only file sources can be watched", "watch")
    topic = sec.get("topic", str, default_topic(name))
    allow_empty = sec.get("allow_empty", bool, False)
    partitions = sec.get("partitions", int, 1)
    if partitions < 1:
        raise sec.error("must be at least 1", "partitions")
    max_delete_fraction = sec.get("max_delete_fraction", float, 0.1)
    if not 0.0 <= max_delete_fraction <= 1.0:
        raise sec.error(f"must be between 0 and 1, got {max_delete_fraction}", "max_delete_fraction")
    min_compaction_lag = sec.duration("min_compaction_lag", timedelta(hours=24))
    # Every run now publishes its completeness, in a heartbeat when it has no changes: an interval
    # that held heartbeats back would hold the completeness back with them. The key is still
    # accepted (its value checked), so configs that set it keep loading.
    if sec.raw("heartbeat", None) is not None:
        sec.optional_duration("heartbeat", None)
        log.warning("%s: %s is no longer used and can be removed: every run publishes its completeness "
                    "in a heartbeat record", sec.source, sec.key("heartbeat"))
    max_age = sec.duration("max_age", default_max_age(schedule))
    if max_age is not None and max_age.total_seconds() <= 0:
        raise sec.error("must be positive", "max_age")
    sec.done()
    return DatasetConfig(name=name, topic=topic, key=key, mode=mode, schedule=schedule, watch=watch,
                         source=source, incremental=incremental, allow_empty=allow_empty, partitions=partitions,
                         max_delete_fraction=max_delete_fraction, min_compaction_lag=min_compaction_lag,
                         max_age=max_age)


def default_max_age(schedule: Schedule) -> timedelta | None:
    """Three schedule intervals (for a cron expression, three of its longest gaps between two runs
    over the next ones); None for a dataset without a schedule (on demand or on file changes)."""
    if schedule.every is not None:
        return 3 * schedule.every
    if schedule.cron is not None:
        from datetime import UTC, datetime

        from apscheduler.triggers.cron import CronTrigger

        trigger = CronTrigger.from_crontab(schedule.cron, timezone=UTC)
        prev, fires, gap = None, datetime.now(UTC), timedelta(0)
        for _ in range(50):  # enough to see a daily or weekly pattern's longest gap
            nxt = trigger.get_next_fire_time(prev, fires)
            if nxt is None:
                break
            if prev is not None:
                gap = max(gap, nxt - prev)
            prev, fires = nxt, nxt
        return 3 * gap if gap else None
    return None


def _source(sec: Section) -> SourceConfig:
    chunk = sec.get("chunk_rows", int, 50_000)
    if chunk < 1:
        raise sec.error("must be at least 1", "chunk_rows")
    if sec.has("url"):
        url = sec.get("url", str)
        table, query = sec.get("table", str, None), sec.get("query", str, None)
        if (table is None) == (query is None):
            raise sec.error("give exactly one of table or query")
        d = SqlSourceConfig(url=url)
        timeouts = {f"{name}_timeout": sec.optional_duration(f"{name}_timeout", getattr(d, f"{name}_timeout"))
                    for name in ("connect", "read", "statement")}
        reader: SqlReader = sec.choice("reader", SqlReader, d.reader)
        if reader != "auto" and not is_mysql_url(url):
            raise sec.error(f"{reader!r} reads MySQL/MariaDB URLs only; leave it out (auto) for this URL", "reader")
        read_partitions = sec.get("read_partitions", int, d.read_partitions)
        if read_partitions < 1:
            raise sec.error("must be at least 1", "read_partitions")
        if read_partitions > 1 and (reader == "pymysql" or table is None or not is_mysql_url(url)):
            raise sec.error("more than 1 needs a MySQL/MariaDB table: (not a query) read by connectorx",
                            "read_partitions")
        sec.done()
        return SqlSourceConfig(url=url, table=table, query=query, chunk_rows=chunk, reader=reader,
                               read_partitions=read_partitions, **timeouts)
    if sec.has("path"):
        path = sec.get("path", str)
        fmt: FileFormat | None = sec.choice("format", FileFormat, None)
        types_sec = sec.section("types", {})
        types = []
        for col in list(types_sec.data):
            t = types_sec.get(col, str)
            try:
                check_type(t)
            except ContractError as exc:
                raise types_sec.error(str(exc), col) from None
            types.append((str(col), t))
        types_sec.done()
        stable_for = sec.duration("stable_for", timedelta(seconds=1))
        stable_timeout = sec.duration("stable_timeout", timedelta(seconds=60))
        if stable_timeout < stable_for:
            raise sec.error(f"must be at least stable_for ({stable_for.total_seconds():g}s)", "stable_timeout")
        if fmt is None:
            fmt = _EXT_FORMATS.get(os.path.splitext(path)[1].lower())
            if fmt is None:
                raise sec.error(f"cannot tell the format of {path!r} from its extension; "
                                f"set format: {' | '.join(get_args(FileFormat))}", "path")
        sec.done()
        return FileSourceConfig(path=_abs(path), format=fmt, chunk_rows=chunk, types=tuple(types),
                                stable_for=stable_for, stable_timeout=stable_timeout)
    raise sec.error("needs url (with table or query) or path")


def _schedule(sec: Section) -> Schedule:
    every = sec.duration("every", None)
    cron = sec.get("cron", str, None)
    if every is not None and cron is not None:
        raise sec.error("give either every or cron, not both")
    if every is not None and every.total_seconds() <= 0:
        raise sec.error("must be positive", "every")
    if cron is not None:
        if len(cron.split()) != 5:
            raise sec.error(f"{cron!r} is not a 5-field cron expression", "cron")
        # Parsed now by the scheduler that will run it, so a bad field fails at load, not at the
        # daemon's start (imported here: only a config with a cron expression needs it).
        from apscheduler.triggers.cron import CronTrigger

        try:
            CronTrigger.from_crontab(cron)
        except ValueError as exc:
            raise sec.error(f"{cron!r}: {exc}", "cron") from None
    sec.done()
    return Schedule(every=every, cron=cron)


def _incremental(sec: Section) -> IncrementalConfig | None:
    """The ``incremental:`` section (None without ``column``). ``reconcile.every`` (or
    ``reconcile_every``) defaults to daily; ``reconcile: off`` turns it off."""
    column = sec.get("column", str, None)
    d = IncrementalConfig(column="")
    lag = sec.duration("lag", d.lag)
    numeric_lag = sec.get("numeric_lag", int, d.numeric_lag)
    if numeric_lag < 0:
        raise sec.error("must not be negative", "numeric_lag")
    reconcile_every = d.reconcile_every
    rec = sec.raw("reconcile", None)
    if is_off(rec):
        reconcile_every = None
    elif rec is not None:
        rsec = sec.section("reconcile")
        reconcile_every = rsec.optional_duration("every", d.reconcile_every)
        rsec.done()
    elif sec.has("reconcile_every"):
        reconcile_every = sec.optional_duration("reconcile_every", d.reconcile_every)
    sec.raw("reconcile_every", None)
    sec.done()
    if column is None:
        return None
    return IncrementalConfig(column=column, lag=lag, numeric_lag=numeric_lag, reconcile_every=reconcile_every)

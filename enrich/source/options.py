"""Options of the ``refstream-kafka`` source, named as in Spark's built-in Kafka connector.

Spark hands a Python data source its options lower-cased; every error names the option at fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from refstream.errors import ConfigError

if TYPE_CHECKING:
    from enrich.source.offsets import TP

KAFKA_PREFIX = "kafka."
#: What the job does when the events topic was deleted and recreated or its offsets went backwards:
#: stop with an error, re-read the partition from its start, or skip to its end (the config's
#: ``events.on_offset_reset``, the reader's ``onOffsetReset``).
OnOffsetReset = Literal["fail", "earliest", "latest"]


def kafka_settings(options: Mapping[str, str]) -> dict[str, str]:
    """``kafka.*`` options -> librdkafka settings (prefix removed)."""
    out = {k[len(KAFKA_PREFIX):]: str(v) for k, v in options.items() if k.lower().startswith(KAFKA_PREFIX)}
    if not out.get("bootstrap.servers"):
        raise ConfigError("option kafka.bootstrap.servers is required")
    return out


def _int(options: Mapping[str, str], name: str, default: int | None, minimum: int = 1) -> int | None:
    raw = options.get(name.lower())
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"option {name}: expected an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"option {name}: must be >= {minimum}, got {value}")
    return value


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = options.get(name.lower())
    if raw is None:
        return default
    v = str(raw).strip().lower()
    if v not in ("true", "false"):
        raise ConfigError(f"option {name}: expected true or false, got {raw!r}")
    return v == "true"


def _choice(options: Mapping[str, str], name: str, choices: Any, default: str) -> Any:
    raw = options.get(name.lower())
    if raw is None:
        return default
    v = str(raw).strip().lower()
    if v not in get_args(choices):
        raise ConfigError(f"option {name}: expected one of {', '.join(get_args(choices))}, got {raw!r}")
    return v


@dataclass(frozen=True)
class SourceOptions:
    """Parsed options of the streaming source."""

    settings: dict[str, str]
    topics: tuple[str, ...]
    starting: int | dict[TP, int]
    max_offsets_per_trigger: int | None
    max_records_per_partition: int | None
    fail_on_data_loss: bool
    poll_timeout_s: float
    on_offset_reset: OnOffsetReset = "fail"
    #: Each task gets its offset range (``enrich.source.fetch.RANGE_DDL``), not the records: its
    #: next step reads them (``enrich.source.fetch.RangeReader``).
    ranges: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        opts = {k.lower(): v for k, v in options.items()}
        for unsupported in ("assign", "subscribepattern"):
            if unsupported in opts:
                raise ConfigError(f"option {unsupported} is not supported by refstream-kafka; use subscribe")
        topics = tuple(t.strip() for t in str(opts.get("subscribe", "")).split(",") if t.strip())
        if not topics:
            raise ConfigError("option subscribe is required (comma-separated topic names)")
        if len(set(topics)) != len(topics):
            raise ConfigError(f"option subscribe: topic listed twice in {opts['subscribe']!r}")
        # Here, not at the top: the job's config takes OnOffsetReset from this module, and loading a
        # config imports no Kafka client.
        from enrich.source.offsets import parse_starting_offsets

        starting = parse_starting_offsets(str(opts.get("startingoffsets", "latest")), topics)
        timeout_ms = _int(opts, "kafkaConsumer.pollTimeoutMs", 120_000)
        return cls(
            settings=kafka_settings(opts),
            topics=topics,
            starting=starting,
            max_offsets_per_trigger=_int(opts, "maxOffsetsPerTrigger", None),
            max_records_per_partition=_int(opts, "maxRecordsPerPartition", None),
            fail_on_data_loss=_bool(opts, "failOnDataLoss", True),
            poll_timeout_s=(timeout_ms or 120_000) / 1000.0,
            on_offset_reset=_choice(opts, "onOffsetReset", OnOffsetReset, "fail"),
            ranges=_bool(opts, "ranges", False),
        )

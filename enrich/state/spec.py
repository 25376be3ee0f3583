"""The ``state:`` section resolved against the enriched events' schema (event fields and the columns
the joins add): the engine's :class:`~enrich.state.engine.StateSpec`, or a config error naming the
key and column at fault."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DecimalType,
    NumericType,
    StructField,
    StructType,
    TimestampType,
)

from enrich.columns import LATE, STATE
from enrich.config import StateConfig
from enrich.state import hashing
from enrich.state.engine import StateSpec
from refstream.errors import ConfigError


def resolve(cfg: StateConfig, enriched: StructType, *, timezone: str = "UTC", source: str = "config") -> StateSpec:
    """Check the ``state:`` section against ``enriched`` and build the engine's spec."""
    types = {f.name: f.dataType for f in enriched.fields}
    have = ", ".join(sorted(types))

    def column(name: str, key: str) -> DataType:
        if name not in types:
            raise ConfigError(f"{source}: state.{key}: column {name!r} is neither an event field nor added by a "
                              f"join (have: {have})")
        return types[name]

    key_type = _arrow(column(cfg.key, "key"), timezone)
    if not hashing.supports(key_type):
        raise ConfigError(f"{source}: state.key: column {cfg.key!r} is {types[cfg.key].simpleString()}; a state key "
                          "must be a string, binary, integer, boolean, date or timestamp column")
    if not isinstance(column(cfg.timestamp, "timestamp"), TimestampType):
        raise ConfigError(f"{source}: state.timestamp: column {cfg.timestamp!r} is "
                          f"{types[cfg.timestamp].simpleString()}, not TIMESTAMP")
    for clash in (STATE, LATE):
        if clash in types:
            raise ConfigError(f"{source}: state: the state step adds column {clash!r}, which the events "
                              "already have; rename it in events.schema or set a join's prefix:")
    aggregates = []
    for name, aggs in cfg.aggregates:
        typ = column(name, f"aggregates.{name}")
        numeric = isinstance(typ, NumericType) and not isinstance(typ, DecimalType)
        if not numeric and any(a != "last" for a in aggs):
            raise ConfigError(f"{source}: state.aggregates.{name}: min, max and mean need a numeric column; "
                              f"{name!r} is {typ.simpleString()} (keep last: only)")
        aggregates.append((name, tuple(aggs), _arrow(typ, timezone)))
    return StateSpec(key=cfg.key, key_type=key_type, timestamp=cfg.timestamp,
                     ttl_us=int(cfg.ttl.total_seconds() * 10**6), aggregates=tuple(aggregates),
                     timestamp_type=pa.timestamp("us", tz=timezone))


def output_fields(spec: StateSpec, calls: Sequence[tuple[str, pa.DataType]] = ()) -> list[StructField]:
    """The Spark fields :func:`resolve`'s spec adds to every event: the ``calls`` result columns
    (``(name, arrow type)``), ``state`` (their fields at its end), then ``_late``."""
    from pyspark.sql.pandas.types import from_arrow_type

    state = pa.struct([*spec.output_type(), *[pa.field(n, t) for n, t in calls]])
    return [*[StructField(n, from_arrow_type(t), True) for n, t in calls],
            StructField(STATE, from_arrow_type(state), True), StructField(LATE, BooleanType(), False)]


def _arrow(typ: DataType, timezone: str) -> pa.DataType:
    return to_arrow_type(typ, timezone=timezone)

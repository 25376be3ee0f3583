"""The ``state:`` section checked against the enriched schema: event fields and join-added columns."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from enrich import config
from enrich.state import spec as state_spec
from refstream.errors import ConfigError

ENRICHED = StructType([
    StructField("device_id", StringType()), StructField("ts", TimestampType()),
    StructField("temperature", DoubleType()), StructField("battery", IntegerType()),
    StructField("when", StringType()),
    # added by the joins
    StructField("site_id", LongType()), StructField("price", DecimalType(12, 3)), StructField("site_name", StringType()),
])


def state(**over: object) -> config.StateConfig:
    sec = {"key": "device_id", "timestamp": "ts", **over}
    cfg = config.parse({"kafka": {"bootstrap_servers": "b:1"}, "events": {"topic": "e", "schema": "x INT"},
                        "output": {"console": {}}, "dead_letter_topic": "d", "checkpoint": "c", "state": sec})
    assert cfg.state is not None
    return cfg.state


def test_resolves_event_and_join_columns() -> None:
    spec = state_spec.resolve(state(aggregates={"temperature": ["mean", "max"], "site_name": ["last"],
                                          "site_id": ["min"]}, ttl="2h"), ENRICHED, timezone="UTC")
    assert spec.key_type == pa.string() and spec.ttl_us == 2 * 3600 * 10**6
    assert spec.aggregates == (("temperature", ("mean", "max"), pa.float64()), ("site_name", ("last",), pa.string()),
                               ("site_id", ("min",), pa.int64()))
    assert [f.name for f in spec.output_type()] == ["events", "first_seen", "last_seen", "temperature_mean",
                                                   "temperature_max", "site_name_last", "site_id_min"]
    fields = state_spec.output_fields(spec)
    assert [f.name for f in fields] == ["state", "_late"]
    assert isinstance(fields[0].dataType, StructType)
    assert fields[0].dataType["temperature_mean"].dataType == DoubleType()
    assert fields[0].dataType["first_seen"].dataType == TimestampType()


@pytest.mark.parametrize(("over", "message"), [
    ({"key": "dev"}, "state.key: column 'dev' is neither an event field nor added by a join (have: battery,"),
    ({"timestamp": "time"}, "state.timestamp: column 'time' is neither an event field"),
    ({"timestamp": "when"}, "state.timestamp: column 'when' is string, not TIMESTAMP"),
    ({"aggregates": {"humidity": ["last"]}}, "state.aggregates.humidity: column 'humidity' is neither an event field"),
    ({"aggregates": {"site_name": ["max"]}}, "state.aggregates.site_name: min, max and mean need a numeric column"),
    ({"aggregates": {"price": ["mean"]}}, "state.aggregates.price: min, max and mean need a numeric column"),
])
def test_errors_name_key_and_column(over: dict, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        state_spec.resolve(state(**over), ENRICHED, source="enrich.yaml")
    assert str(exc.value).startswith(f"enrich.yaml: {message}")


def test_refuses_events_that_already_have_the_state_columns() -> None:
    clash = StructType([*ENRICHED.fields, StructField("state", StringType())])
    with pytest.raises(ConfigError, match="adds column 'state', which the events already have"):
        state_spec.resolve(state(), clash)


@pytest.mark.parametrize("key", ["temperature", "price"])
def test_a_key_without_sparks_hash_in_the_step_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"state\.key: column '{key}' is (double|decimal\(12,3\)); a state key must "
                                          r"be a string, binary, integer, boolean, date or timestamp column"):
        state_spec.resolve(state(key=key), ENRICHED, source="x.yaml")
    assert state_spec.resolve(state(key="site_id"), ENRICHED).key_type == pa.int64()

"""A rollup's spec: its checks, and the schemas of its windows, state and rows."""

from __future__ import annotations

import pickle
from typing import get_args

import pyarrow as pa
import pytest

from enrich.rollups import engine, sketch
from enrich.rollups.spec import METRICS, NUMERIC_METRICS, Metric, RollupSpec

TS = pa.timestamp("us", tz="UTC")
MINUTE = 60 * 10**6


def spec(**changes: object) -> RollupSpec:
    kw: dict[str, object] = dict(
        name="per_device", by=("device_id", "site"), by_types=(pa.string(), pa.int32()), window_us=MINUTE,
        metrics=(("temperature", ("count", "mean", "p95", "last"), pa.float32()),
                 ("status", ("count_distinct", "last"), pa.string()),
                 ("battery", ("min", "max", "sum"), pa.int16())),
        correct_for_us=10 * MINUTE)
    kw.update(changes)
    return RollupSpec(**kw)  # type: ignore[arg-type]


def test_metrics() -> None:
    assert METRICS == get_args(Metric) == ("count", "min", "max", "mean", "sum", "last", "p50", "p95", "p99",
                                           "count_distinct")
    assert NUMERIC_METRICS == {"min", "max", "mean", "sum", "p50", "p95", "p99"}


def test_output_schema_has_the_by_columns_the_window_the_metrics_in_order_then_the_row_columns() -> None:
    assert spec().output_schema() == pa.schema([
        pa.field("device_id", pa.string()), pa.field("site", pa.int32()),
        pa.field("window_start", TS, False), pa.field("window_end", TS, False),
        pa.field("temperature_count", pa.int64()), pa.field("temperature_mean", pa.float64()),
        pa.field("temperature_p95", pa.float64()), pa.field("temperature_last", pa.float32()),
        pa.field("status_count_distinct", pa.int64()), pa.field("status_last", pa.string()),
        pa.field("battery_min", pa.int16()), pa.field("battery_max", pa.int16()),
        pa.field("battery_sum", pa.float64()),
        pa.field("_kind", pa.string(), False), pa.field("_revision", pa.int64(), False),
        pa.field("_events", pa.int64(), False), pa.field("_finalized_by", pa.string()),
        pa.field("_cause", pa.string()),
    ])


def test_window_schema_holds_only_the_accumulators_the_metrics_need() -> None:
    assert spec().window_schema() == pa.schema([
        pa.field("device_id", pa.string()), pa.field("site", pa.int32()),
        pa.field("window_start", pa.int64(), False), pa.field("_events", pa.int64(), False),
        pa.field("temperature.n", pa.int64(), False), pa.field("temperature.sum", pa.float64()),
        pa.field("temperature.last", pa.float32()), pa.field("temperature.last_ts", pa.int64()),
        pa.field("temperature.last_p", pa.int64()), pa.field("temperature.last_o", pa.int64()),
        pa.field("temperature.kll", pa.binary()),
        pa.field("status.last", pa.string()), pa.field("status.last_ts", pa.int64()),
        pa.field("status.last_p", pa.int64()), pa.field("status.last_o", pa.int64()),
        pa.field("status.set", pa.list_(pa.string()), False),
        pa.field("battery.sum", pa.float64()), pa.field("battery.min", pa.int16()),
        pa.field("battery.max", pa.int16()),
    ])
    state = engine.state_schema(spec())
    assert state.names[-2:] == ["_revision", "_final"] and state.names[:-2] == spec().window_schema().names


def test_a_spec_pickles() -> None:
    s = spec(fill=True, idle_finalize_us=5 * MINUTE)
    assert pickle.loads(pickle.dumps(s)) == s


def test_the_rank_error_is_stated() -> None:
    assert sketch.KLL_K == 200
    assert sketch.KLL_RANK_ERROR == pytest.approx(0.0133, abs=1e-4)


@pytest.mark.parametrize(("changes", "message"), [
    ({"window_us": 0}, "rollup 'per_device': the window must be positive"),
    ({"correct_for_us": -1}, "rollup 'per_device': the correction horizon must be positive"),
    ({"idle_finalize_us": 0}, "idle_finalize must be positive"),
    ({"by_types": (pa.string(),)}, r"2 by column\(s\) but 1 type\(s\)"),
    ({"by": ("site", "site")}, "by names a column twice"),
    ({"metrics": ()}, "no metrics"),
    ({"metrics": (("temperature", ("median",), pa.float64()),)},
     r"metric\(s\) \['median'\] of column 'temperature' are not among"),
    ({"metrics": (("status", ("count", "p99", "max"), pa.string()),)},
     r"rollup 'per_device': metric\(s\) \['p99', 'max'\] need a numeric column; 'status' is string"),
    ({"metrics": (("on", ("mean",), pa.bool_()),)}, "'on' is bool"),
    ({"metrics": (("t", ("count",), pa.float64()), ("t", ("max",), pa.float64()))}, "column 't' is listed twice"),
    ({"metrics": (("t", ("count", "count"), pa.float64()),)}, "column 't' lists a metric twice"),
    ({"metrics": (("t", (), pa.float64()),)}, "column 't' has no metrics"),
    ({"by": ("device_id", "window_end")}, r"\['window_end'\] would appear twice"),
    ({"by": ("device_id", "t_count"), "metrics": (("t", ("count",), pa.float64()),)}, r"\['t_count'\]"),
    ({"by": ("device_id", "_final")}, r"\['_final'\]"),
])
def test_a_bad_spec_is_refused_naming_the_rollup_and_column(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**changes)


def test_count_last_and_count_distinct_take_any_column() -> None:
    s = spec(metrics=(("status", ("count", "last", "count_distinct"), pa.string()),
                      ("seen", ("last", "count_distinct"), TS)))
    assert s.output_schema().field("seen_last").type == TS
    assert s.output_schema().field("status_count").type == pa.int64()

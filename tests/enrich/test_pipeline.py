"""The job's one plan (``enrich.pipeline``), built against published schemas without a broker: the
stages in order, where the joins run, and what it refuses (Spark parses the DDL: a session)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pyspark.sql import SparkSession

from enrich import config
from enrich.pipeline import Pipeline
from refstream.contract import Column, DatasetSchema
from refstream.errors import ConfigError

SCHEMAS = {
    "devices": DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("model_id", "string"))),
    "models": DatasetSchema("models", ("id",), (Column("id", "string"), Column("model_name", "string"))),
    "sites": DatasetSchema("sites", ("site_id",), (Column("site_id", "string"), Column("region", "string"))),
}


def cfg(schema: str = "device_id STRING, site_id STRING, ts TIMESTAMP, temp DOUBLE", **state: Any) -> config.EnrichConfig:
    return config.parse({
        "kafka": {"bootstrap_servers": "127.0.0.1:9"}, "events": {"topic": "ev", "schema": schema},
        "joins": [{"dataset": "models", "on": {"model_id": "id"}, "columns": ["model_name"]},
                  {"dataset": "sites", "on": "site_id"},
                  {"dataset": "devices", "on": "device_id", "strategy": "partitioned"}],
        "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck",
        "state": {"key": "device_id", "timestamp": "ts", "aggregates": {"temp": ["mean"], "region": ["last"]},
                  **state}}, "test.yaml")


def test_the_joins_the_state_needs_run_before_it_the_others_after(spark: SparkSession) -> None:
    p = Pipeline.build(cfg(), SCHEMAS)
    assert p.state is not None
    assert [j.dataset for j in p.state.before] == ["sites"]           # the state aggregates region
    assert [d.dataset for d in p.state.dims] == ["devices"]           # partitioned: inside the step
    assert [j.dataset for j in p.after] == ["models"]                 # on model_id, which devices adds
    assert [(s.kind, s.name) for s in p.stages()] == [
        ("read", "ev"), ("parse", "events.schema"), ("join", "sites"), ("join", "devices"),
        ("state", "keyed by device_id"), ("join", "models"), ("sink", "kafka")]
    assert p.join_pass.columns[-4:] == ("state", "_late", "model_name", "_models_matched")
    assert p.replan(dict(SCHEMAS)) == p.join_pass


def test_an_event_field_named_like_a_column_of_the_state_step_is_refused(spark: SparkSession) -> None:
    with pytest.raises(ConfigError, match=r"^test\.yaml: events\.schema: field\(s\) \['_bucket'\] are names the "
                                          r"state step uses"):
        Pipeline.build(cfg("device_id STRING, site_id STRING, ts TIMESTAMP, temp DOUBLE, _bucket INT"), SCHEMAS)


def test_as_of_joins_add_the_clipped_flag_once_wherever_they_run(spark: SparkSession) -> None:
    c = config.parse({**c_data(), "joins": [
        {"dataset": "models", "on": {"model_id": "id"}, "columns": ["model_name"], "as_of": True, "history": "1d"},
        {"dataset": "sites", "on": "site_id", "as_of": True},
        {"dataset": "devices", "on": "device_id", "strategy": "partitioned", "as_of": True}]}, "test.yaml")
    p = Pipeline.build(c, SCHEMAS)
    assert p.state is not None
    # sites (before the step) adds it; devices (inside) and models (after) set the same column
    assert p.state.joined.fieldNames()[-3:] == ["region", "_sites_matched", "_as_of_clipped"]
    assert [f.name for f in p.state.passed].count("_as_of_clipped") == 1
    assert p.join_pass.columns.count("_as_of_clipped") == 1
    assert p.join_pass.columns[-2:] == ("model_name", "_models_matched")
    lines = p.explain()
    assert any("join models (left, on model_id = id, as of ts (history 86400s)" in line for line in lines)
    assert "_as_of_clipped" in lines[-1]
    assert all(s.time == "ts" for s in p.join_pass.specs) and p.state.dims[0].history is not None
    assert not any("_as_of_clipped" in line for line in Pipeline.build(cfg(), SCHEMAS).explain())


def test_a_waiting_join_adds_provisional_and_cannot_run_before_the_step(spark: SparkSession) -> None:
    c = config.parse({**c_data(), "joins": [
        {"dataset": "devices", "on": "device_id", "columns": ["model_id"]},
        {"dataset": "models", "on": {"model_id": "id"}, "columns": ["model_name"], "as_of": True, "wait": "complete",
         "max_wait": "2m"},
        {"dataset": "sites", "on": "site_id"}]}, "test.yaml")
    p = Pipeline.build(c, SCHEMAS)
    assert p.state is not None and [f.name for f in p.state.passed][-1] == "_provisional"
    assert "_provisional" in p.join_pass.columns
    assert any("holds events until models is complete as of their time (at most 120s)" in line
               for line in p.explain())
    assert "_provisional" not in Pipeline.build(cfg(), SCHEMAS).join_pass.columns
    # sites' region is aggregated: its join runs before the step, which holds the events
    before = config.parse({**c_data(), "joins": [
        {"dataset": "sites", "on": "site_id", "as_of": True, "wait": "complete"}]}, "test.yaml")
    with pytest.raises(ConfigError, match=r"^test\.yaml: joins\[0\]\.wait: complete is not possible for a join "
                                          r"whose columns the state: section uses"):
        Pipeline.build(before, SCHEMAS)


def c_data() -> dict[str, Any]:
    return {"kafka": {"bootstrap_servers": "127.0.0.1:9"},
            "events": {"topic": "ev", "schema": "device_id STRING, site_id STRING, ts TIMESTAMP, temp DOUBLE"},
            "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck",
            "state": {"key": "device_id", "timestamp": "ts", "aggregates": {"temp": ["mean"], "region": ["last"]}}}


def with_rollups(*rollups: dict[str, Any]) -> config.EnrichConfig:
    data = {"kafka": {"bootstrap_servers": "127.0.0.1:9"},
            "events": {"topic": "ev", "schema": "device_id STRING, site_id STRING, ts TIMESTAMP, temp DOUBLE"},
            "joins": [{"dataset": "models", "on": {"model_id": "id"}, "columns": ["model_name"]},
                      {"dataset": "sites", "on": "site_id"},
                      {"dataset": "devices", "on": "device_id", "strategy": "partitioned"}],
            "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck",
            "state": {"key": "device_id", "timestamp": "ts", "ttl": "2h"},
            "rollups": [{"output": {"parquet": {"path": f"rollups/{r['name']}"}}, **r} for r in rollups]}
    return config.parse(data, "test.yaml")


def test_a_rollup_by_a_join_column_moves_its_join_before_the_state_step(spark: SparkSession) -> None:
    p = Pipeline.build(with_rollups(
        {"name": "region_1h", "by": ["region"], "window": "1h", "metrics": {"temp": ["mean", "p95"]}},
        {"name": "device_1m", "by": ["device_id"], "window": "1m", "correct_for": "10m",
         "metrics": {"temp": ["max"], "model_id": ["count_distinct"]}}), SCHEMAS)
    assert p.state is not None
    assert [j.dataset for j in p.state.before] == ["sites"]           # the rollup groups by region
    assert [(s.kind, s.name) for s in p.stages()][4:7] == [
        ("state", "keyed by device_id"), ("rollup", "region_1h"), ("rollup", "device_1m")]
    region, device = p.state.rollups
    assert region.correct_for_us == 2 * 3600 * 10**6                  # the default: state.ttl
    assert (device.window_us, device.correct_for_us) == (60 * 10**6, 600 * 10**6)
    assert [str(t) for t in region.by_types] == ["string"]
    assert "by region per 3600s window, temp mean/p95, corrected for 7200s" in p.stages()[5].where


def test_a_fill_by_a_joins_columns_fills_by_its_dimensions_keys(spark: SparkSession) -> None:
    """fill: by a broadcast join's columns (its key beside them allowed): every key of that dimension;
    by an event column, or by the join's key alone: the keys with events."""
    metrics = {"temp": ["mean"]}
    p = Pipeline.build(with_rollups(
        {"name": "region", "by": ["region"], "window": "1h", "metrics": metrics, "fill": True},
        {"name": "site", "by": ["site_id", "region"], "window": "1h", "metrics": metrics, "fill": True},
        {"name": "device", "by": ["device_id"], "window": "1m", "metrics": metrics, "fill": True},
        {"name": "both", "by": ["device_id", "region"], "window": "1m", "metrics": metrics, "fill": True},
        {"name": "unfilled", "by": ["region"], "window": "1m", "metrics": metrics}), SCHEMAS)
    assert p.state is not None
    assert [(r.fill_keys, r.needs_ticks) for r in p.state.rollups] == [
        ("sites", True), ("sites", True), (None, False), (None, False), (None, False)]


def test_a_rollup_column_the_state_step_cannot_see_is_refused(spark: SparkSession) -> None:
    # model_name comes from models, which joins on a column of the partitioned devices join.
    with pytest.raises(ConfigError, match=r"^test\.yaml: rollups\[0\] \(m\)\.by: 'model_name' comes from a join "
                                          r"that cannot run before the state step"):
        Pipeline.build(with_rollups({"name": "m", "by": ["model_name"], "window": "1m",
                                     "metrics": {"temp": ["mean"]}}), SCHEMAS)
    with pytest.raises(ConfigError, match=r"^test\.yaml: rollups\[0\] \(m\)\.metrics\.humidity: no such column"):
        Pipeline.build(with_rollups({"name": "m", "by": ["device_id"], "window": "1m",
                                     "metrics": {"humidity": ["mean"]}}), SCHEMAS)
    with pytest.raises(ConfigError, match=r"rollups\[0\] \(m\): rollup 'm': metric\(s\) \['mean'\] need a numeric "
                                          r"column; 'site_id' is string"):
        Pipeline.build(with_rollups({"name": "m", "by": ["device_id"], "window": "1m",
                                     "metrics": {"site_id": ["mean"]}}), SCHEMAS)


GAP_SCHEMAS = {**SCHEMAS, "sites": DatasetSchema("sites", ("site_id",), (
    Column("site_id", "string"), Column("region", "string"), Column("every_s", "float64"),
    Column("note", "string")))}


def with_gaps(every: str) -> config.EnrichConfig:
    data = {"kafka": {"bootstrap_servers": "127.0.0.1:9"},
            "events": {"topic": "ev", "schema": "device_id STRING, site_id STRING, ts TIMESTAMP, temp DOUBLE"},
            "joins": [{"dataset": "models", "on": {"model_id": "id"}, "columns": ["model_name"]},
                      {"dataset": "sites", "on": "site_id", "columns": ["region", "every_s"]},
                      {"dataset": "devices", "on": "device_id", "strategy": "partitioned"}],
            "output": {"kafka": {"topic": "out"}}, "dead_letter_topic": "dlq", "checkpoint": "ck",
            "state": {"key": "device_id", "timestamp": "ts", "ttl": "2h"},
            "gaps": {"expected_every": every, "output": {"kafka": {"topic": "gaps"}}}}
    return config.parse(data, "test.yaml")


def test_gaps_by_a_join_column_move_its_join_before_the_step_and_carry_the_joins_columns(
        spark: SparkSession) -> None:
    p = Pipeline.build(with_gaps("every_s"), GAP_SCHEMAS)
    assert p.state is not None and p.state.gaps is not None
    assert [j.dataset for j in p.state.before] == ["sites"]
    g = p.state.gaps
    assert (g.key, g.every_us, g.every_column, g.after, g.ttl_us, g.topic) == (
        "device_id", None, "every_s", 3.0, 2 * 3600 * 10**6, "ev")
    # the before-join's columns and the partitioned join's, the device's reference columns
    assert [n for n, _ in g.refs] == ["region", "every_s", "model_id"]
    assert [(s.kind, s.name) for s in p.stages()][5] == ("gaps", "after 3 x every_s")
    assert p.state.rollups == ()
    marked = with_gaps("every_s")
    marked = dataclasses.replace(marked, rollups=with_rollups(
        {"name": "device", "by": ["device_id"], "window": "1m", "metrics": {"ts": ["count"]}, "fill": True},
        {"name": "unfilled", "by": ["device_id"], "window": "1m", "metrics": {"temp": ["max"]}},
        {"name": "by_site", "by": ["device_id", "site_id"], "window": "1m", "metrics": {"temp": ["max"]},
         "fill": True}).rollups)
    m = Pipeline.build(marked, GAP_SCHEMAS)
    assert m.state is not None
    # _gap: a filled rollup by the device alone; a metric over a timestamp column planned (it failed before)
    assert [(r.name, r.gaps) for r in m.state.rollups] == [("device", True), ("unfilled", False), ("by_site", False)]
    assert str(m.state.rollups[0].metrics[0][2]) == "timestamp[us, tz=UTC]"
    fixed = Pipeline.build(with_gaps("45s"), GAP_SCHEMAS)
    assert fixed.state is not None and fixed.state.gaps is not None
    assert (fixed.state.gaps.every_us, fixed.state.before) == (45 * 10**6, ())


def test_a_gaps_column_the_step_cannot_see_or_not_a_number_is_refused(spark: SparkSession) -> None:
    with pytest.raises(ConfigError, match=r"^test\.yaml: gaps\.expected_every: 'model_name' comes from a join that "
                                          r"cannot run before the state step"):
        Pipeline.build(with_gaps("model_name"), GAP_SCHEMAS)
    with pytest.raises(ConfigError, match=r"^test\.yaml: gaps\.expected_every: no such column"):
        Pipeline.build(with_gaps("interval"), GAP_SCHEMAS)
    with pytest.raises(ConfigError, match=r"^test\.yaml: gaps\.expected_every: 'region' is string; expected a "
                                          r"number of seconds or an interval"):
        Pipeline.build(with_gaps("region"), GAP_SCHEMAS)
    # A reference column named like a record's field would overwrite it (a join's prefix: renames it).
    named = {**GAP_SCHEMAS, "sites": DatasetSchema("sites", ("site_id",), (
        Column("site_id", "string"), Column("region", "string"), Column("every_s", "float64"),
        Column("kind", "string")))}
    cfg_kind = with_gaps("every_s")
    cfg_kind = dataclasses.replace(cfg_kind, joins=tuple(
        dataclasses.replace(j, columns=("region", "every_s", "kind")) if j.dataset == "sites" else j
        for j in cfg_kind.joins))
    with pytest.raises(ConfigError, match=r"^test\.yaml: gaps: column\(s\) \['kind'\] .* are named like fields of "
                                          r"the gap records"):
        Pipeline.build(cfg_kind, named)

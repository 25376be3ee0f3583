from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

import enrich
from enrich import config
from refstream.errors import ConfigError

BASE = {
    "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "events": {"topic": "ev", "schema": "device_id STRING, ts TIMESTAMP"},
    "joins": [{"dataset": "devices", "on": "device_id", "columns": ["model_id", "site_id"]},
              {"dataset": "sites", "on": {"site_id": "id"}, "how": "inner", "topic": "t.sites"}],
    "output": {"kafka": {"topic": "out"}},
    "dead_letter_topic": "dlq",
    "checkpoint": "var/cp",
    "trigger": "500ms",
    "max_events_per_batch": 1000,
}


def test_parse_full_shape() -> None:
    cfg = config.parse(BASE, "enrich.yaml")
    assert cfg.kafka == {"bootstrap.servers": "127.0.0.1:9092"}
    assert cfg.events.starting_offsets == "latest"
    assert cfg.joins[0].topic == "ref.devices" and cfg.joins[0].on == (("device_id", None),)
    assert cfg.joins[0].columns == ("model_id", "site_id") and cfg.joins[0].how == "left"
    assert cfg.joins[1].on == (("site_id", "id"),) and cfg.joins[1].how == "inner"
    assert cfg.joins[1].topic == "t.sites" and cfg.joins[1].columns is None
    assert cfg.datasets == {"devices": "ref.devices", "sites": "t.sites"}
    assert cfg.output.kind == "kafka" and cfg.output.topic == "out"
    assert cfg.trigger == timedelta(milliseconds=500) and cfg.max_events_per_batch == 1000
    assert cfg.checkpoint == Path("var/cp")
    # Bounded memory without any setting: admission control is on by default.
    assert config.parse({k: v for k, v in BASE.items() if k != "max_events_per_batch"}).max_events_per_batch == 100_000


@pytest.mark.parametrize(("patch", "message"), [
    ({"joins": [{"dataset": "d", "on": 3}]}, "joins[0].on"),
    ({"joins": [{"dataset": "d", "on": "x", "how": "outer"}]}, "joins[0].how: 'outer' is not one of"),
    ({"output": {"kafka": {"topic": "o"}, "console": {}}}, "output: needs exactly one of"),
    ({"output": {"parquet": {}}}, "output.parquet.path: is required"),
    ({"trigger": "soon"}, "trigger: 'soon' is not a duration"),
    ({"events": {"topic": "e", "schema": "x INT", "starting_offsets": "middle"}}, "events.starting_offsets"),
    ({"events": {"topic": "e", "schema": "x INT", "sheme": 1}}, "events: unknown key(s): sheme"),
    ({"max_events_per_batch": 0}, "max_events_per_batch: must be positive"),
    ({"joins": [{"dataset": "d", "on": "x"}, {"dataset": "d", "on": "y"}]}, "joined twice"),
    ({"kafka": {"security.protocol": "SSL"}}, "kafka.bootstrap_servers: is required"),
    ({"events": {"topic": "e", "schema": "x INT", "source": "jar"}}, "events.source: 'jar' is not one of"),
    ({"events": {"topic": "e", "schema": "x INT", "on_offset_reset": "skip"}},
     "events.on_offset_reset: 'skip' is not one of fail, earliest, latest"),
    ({"events": {"schema": "x INT"}}, "events.topic: is required"),
    ({"joins": {"dataset": "d"}}, "joins: expected a list of joins"),
    ({"joins": [{"dataset": "d", "on": "x", "colums": ["a"]}]}, "joins[0]: unknown key(s): colums"),
    ({"joins": [{"dataset": "d", "on": "x", "columns": [1, 2]}]}, "joins[0].columns: expected a list of names"),
    ({"output": {"kafka": {}}}, "output.kafka.topic: is required"),
    ({"dead_letter_topic": None}, "dead_letter_topic: is required"),
    ({"checkpoint": 3}, "checkpoint: expected str"),
    ({"triger": "1s"}, "<top>: unknown key(s): triger"),
    ({"spark": ["spark.driver.memory"]}, "spark: must be a mapping"),
    ({"joins": [{"dataset": "d", "on": "x", "strategy": "local"}]}, "joins[0].strategy: 'local' is not one of"),
    ({"joins": [{"dataset": "d", "on": "x", "strategy": "partitioned"}]},
     "joins[0].strategy: partitioned needs a state: section"),
    ({"joins": [{"dataset": "d", "on": "x", "strategy": "partitioned"}], "state": {"key": "d", "timestamp": "ts"}},
     "joins[0].strategy: partitioned joins on state.key ('d') alone, not on ['x']"),
    ({"joins": [{"dataset": "d", "on": ["d", "e"], "strategy": "partitioned"}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].strategy: partitioned joins on state.key ('d') alone"),
    ({"joins": [{"dataset": "d", "on": "d", "strategy": "partitioned"}, {"dataset": "d", "on": "e", "prefix": "p"}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].strategy: dataset 'd' is joined both partitioned and"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True}]},
     "joins[0].as_of: as_of needs a state: section (an event's time is its state.timestamp)"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": "yes"}], "state": {"key": "d", "timestamp": "ts"}},
     "joins[0].as_of: expected bool"),
    ({"joins": [{"dataset": "d", "on": "x", "history": "1d"}]}, "joins[0].history: applies to as_of joins only"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "history": "0s"}], "state": {"key": "d", "timestamp": "ts"}},
     "joins[0].history: must be positive"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "history": "long"}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].history: 'long' is not a duration"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True}, {"dataset": "d", "on": "e", "prefix": "p"}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[1].as_of: dataset 'd' is joined with different as_of"),
    ({"joins": [{"dataset": "d", "on": "x", "wait": "complete"}], "state": {"key": "d", "timestamp": "ts"}},
     "joins[0].wait: complete needs as_of: true"),
    ({"joins": [{"dataset": "d", "on": "d", "as_of": True, "wait": "complete", "strategy": "partitioned"}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].wait: complete applies to broadcast joins only"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "wait": "always"}], "state": {"key": "d", "timestamp": "ts"}},
     "joins[0].wait: 'always' is not one of none, complete"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "max_wait": "1m"}], "state": {"key": "d", "timestamp": "ts"}},
     "joins[0].max_wait: applies to joins with wait: complete only"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "wait": "complete", "max_wait": "0s"}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].max_wait: must be positive"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "wait": "complete", "max_wait": "soon"}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].max_wait: 'soon' is not a duration"),
    ({"joins": [{"dataset": "d", "on": "x", "corrections": {"horizon": "1h"}}], "state": {"key": "d", "timestamp": "ts"}},
     "joins[0].corrections: corrections need as_of: true"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "corrections": {"horizon": "0s"}}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].corrections.horizon: must be positive"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "corrections": {}}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].corrections.horizon: is required"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "corrections": {"horizon": "1h", "max": 3}}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].corrections: unknown key(s): max"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "history": "1h", "corrections": {"horizon": "2h"}}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].corrections: horizon 2:00:00 is longer than the join's history"),
    ({"joins": [{"dataset": "d", "on": "d", "strategy": "partitioned", "corrections": {"horizon": "1h"}}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[0].corrections: corrections need as_of: true"),
    ({"joins": [{"dataset": "d", "on": "x", "as_of": True, "corrections": {"horizon": "1h"}},
                {"dataset": "d", "on": "e", "prefix": "p", "as_of": True}],
      "state": {"key": "d", "timestamp": "ts"}}, "joins[1].as_of: dataset 'd' is joined with different"),
    ({"state": {"timestamp": "ts"}}, "state.key: is required"),
    ({"state": {"key": "device_id"}}, "state.timestamp: is required"),
    ({"state": {"key": "ts", "timestamp": "ts"}}, "state.timestamp: 'ts' is also the key"),
    ({"state": {"key": "d", "timestamp": "ts", "ttl": "0s"}}, "state.ttl: must be positive"),
    ({"state": {"key": "d", "timestamp": "ts", "ttl": "soon"}}, "state.ttl: 'soon' is not a duration"),
    ({"state": {"key": "d", "timestamp": "ts", "watermark": "x"}}, "state.watermark: 'x' is not a duration"),
    ({"state": {"key": "d", "timestamp": "ts", "buckets": 0}}, "state.buckets: must be positive"),
    ({"state": {"key": "d", "timestamp": "ts", "server_timeout": "0s"}}, "state.server_timeout: must be positive"),
    ({"state": {"key": "d", "timestamp": "ts", "aggregates": {"t": ["median"]}}},
     "state.aggregates.t: 'median' is not one of last, min, max, mean"),
    ({"state": {"key": "d", "timestamp": "ts", "aggregates": {"t": []}}}, "state.aggregates.t: expected a list"),
    ({"state": {"key": "d", "timestamp": "ts", "aggregates": {"t": ["min", "min"]}}},
     "state.aggregates.t: an aggregate is listed twice"),
    ({"state": {"key": "d", "timestamp": "ts", "aggregates": ["t"]}}, "state.aggregates: must be a mapping"),
    ({"state": {"key": "d", "timestamp": "ts", "tll": "1h"}}, "state: unknown key(s): tll"),
    ({"state": {"key": "d", "timestamp": "ts", "max_future_skew": "soon"}},
     "state.max_future_skew: 'soon' is not a duration"),
    ({"state": {"key": "d", "timestamp": "ts", "max_future_skew": True}},
     "state.max_future_skew: True is not a duration"),
])
def test_errors_name_the_key(patch: dict, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config.parse({**BASE, **patch}, "enrich.yaml")
    assert message in str(exc.value)
    assert str(exc.value).startswith("enrich.yaml: ")


def test_as_of_join() -> None:
    cfg = config.parse({**BASE, "state": {"key": "d", "timestamp": "ts"},
                        "joins": [{"dataset": "d", "on": "x", "as_of": True, "history": "2d"},
                                  {"dataset": "e", "on": "x", "as_of": True}, {"dataset": "f", "on": "x"}]})
    assert [(j.as_of, j.history) for j in cfg.joins] == [(True, timedelta(days=2)), (True, timedelta(days=7)),
                                                         (False, timedelta(days=7))]


def test_corrections_horizon() -> None:
    cfg = config.parse({**BASE, "state": {"key": "d", "timestamp": "ts"},
                        "joins": [{"dataset": "d", "on": "x", "as_of": True, "corrections": {"horizon": "24h"}},
                                  {"dataset": "e", "on": "x", "as_of": True}]})
    assert [j.corrections for j in cfg.joins] == [timedelta(hours=24), None]


def test_wait_for_completeness() -> None:
    cfg = config.parse({**BASE, "state": {"key": "d", "timestamp": "ts"},
                        "joins": [{"dataset": "d", "on": "x", "as_of": True, "wait": "complete", "max_wait": "2m"},
                                  {"dataset": "e", "on": "x", "as_of": True, "wait": "complete"},
                                  {"dataset": "f", "on": "x", "as_of": True}]})
    assert [(j.wait, j.max_wait) for j in cfg.joins] == [("complete", timedelta(minutes=2)),
                                                         ("complete", timedelta(minutes=15)),
                                                         ("none", timedelta(minutes=15))]
    assert cfg.waits == {"d": timedelta(minutes=2), "e": timedelta(minutes=15)}


def test_state_section() -> None:
    assert config.parse(BASE).state is None
    assert {j.strategy for j in config.parse(BASE).joins} == {"broadcast"}
    cfg = config.parse({**BASE, "state": {"key": "device_id", "timestamp": "ts",
                                          "aggregates": {"temperature": ["last", "min", "max", "mean"],
                                                         "battery": "last"}}})
    assert cfg.state is not None
    assert cfg.state.ttl == timedelta(hours=1) and cfg.state.watermark == timedelta(minutes=5)
    assert cfg.state.buckets == 64
    assert cfg.state.aggregates == (("temperature", ("last", "min", "max", "mean")), ("battery", ("last",)))
    assert cfg.state.fields == ("temperature_last", "temperature_min", "temperature_max", "temperature_mean",
                                "battery_last")
    assert cfg.state.columns == ("device_id", "ts", "temperature", "battery")
    part = config.parse({**BASE, "state": {"key": "device_id", "timestamp": "ts"},
                         "joins": [{"dataset": "devices", "on": "device_id", "strategy": "partitioned"},
                                   {"dataset": "sites", "on": "site_id"}]})
    assert [j.dataset for j in part.partitioned_joins] == ["devices"]
    assert [j.dataset for j in part.broadcast_joins] == ["sites"] and list(part.broadcast_datasets) == ["sites"]
    assert list(part.datasets) == ["devices", "sites"]
    cfg = config.parse({**BASE, "state": {"key": "device_id", "timestamp": "ts", "ttl": "30m", "watermark": 0,
                                          "buckets": 8}})
    assert cfg.state is not None and cfg.state.aggregates == ()
    assert (cfg.state.ttl, cfg.state.watermark, cfg.state.buckets) == (timedelta(minutes=30), timedelta(0), 8)


@pytest.mark.parametrize(("value", "skew"), [(..., timedelta(hours=1)), ("10m", timedelta(minutes=10)),
                                             (90, timedelta(seconds=90)), ("off", None), (False, None),
                                             ("0s", None)])
def test_state_max_future_skew(value: object, skew: timedelta | None) -> None:
    """How far ahead of the job's clock an event may be: a duration, ``off`` (YAML reads a bare off
    as false) or 0 to turn the check off; 1h when absent."""
    state = {"key": "device_id", "timestamp": "ts", **({} if value is ... else {"max_future_skew": value})}
    cfg = config.parse({**BASE, "state": state})
    assert cfg.state is not None and cfg.state.max_future_skew == skew
    assert yaml.safe_load("max_future_skew: off") == {"max_future_skew": False}


def test_env_substitution_and_shipped_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP", "broker:1234")
    cfg = config.load(Path(__file__).parents[2] / "conf" / "enrich.yaml")
    assert cfg.kafka["bootstrap.servers"] == "broker:1234"
    assert [j.dataset for j in cfg.joins] == ["devices", "models", "sites"]  # what conf/refresh.yaml publishes


def test_unset_environment_variable_names_file_and_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_SUCH_BOOTSTRAP", raising=False)
    path = tmp_path / "enrich.yaml"
    path.write_text("events: {topic: e, schema: 'x INT'}\nkafka:\n  bootstrap_servers: ${NO_SUCH_BOOTSTRAP}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: environment variable NO_SUCH_BOOTSTRAP is not set"):
        config.load(path)


# The Python API: enrich.load_config(mapping) applies exactly the checks a YAML file gets.

def test_a_mapping_loads_as_the_same_yaml_file_does(tmp_path: Path) -> None:
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert enrich.load_config(BASE, source=str(path)) == config.load(path) == enrich.load_config(path)
    assert enrich.load_config(BASE).source == "config"
    assert enrich.load_config(BASE).trigger == timedelta(milliseconds=500)


@pytest.mark.parametrize(("patch", "error"), [
    ({"triger": "1s"}, "<top>: unknown key(s): triger"),
    ({"events": {"topic": "e", "schema": "x INT", "sheme": 1}}, "events: unknown key(s): sheme"),
    ({"joins": [{"dataset": "d", "on": "x", "colums": ["a"]}]}, "joins[0]: unknown key(s): colums"),
    ({"checkpoint": 3}, "checkpoint: expected str, got 3"),
    ({"max_events_per_batch": "lots"}, "max_events_per_batch: expected int, got 'lots'"),
    ({"trigger": "soon"}, "trigger: 'soon' is not a duration"),
    ({"output": {"kafka": {"topic": ["o"]}}}, "output.kafka.topic: expected str, got ['o']"),
])
def test_a_bad_mapping_fails_with_the_message_of_the_same_yaml_file(tmp_path: Path, patch: dict,
                                                                    error: str) -> None:
    data = {**BASE, **patch}
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as from_file:
        enrich.load_config(path)
    with pytest.raises(ConfigError) as named:
        enrich.load_config(data, source=str(path))
    with pytest.raises(ConfigError) as unnamed:
        enrich.load_config(data)
    message = str(from_file.value)
    assert message.startswith(f"{path}: {error}") and "\n" not in message
    assert str(named.value) == message
    assert str(unnamed.value) == "config" + message.removeprefix(str(path))


def test_a_mapping_gets_the_environment_substitution_of_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_BOOTSTRAP", "broker:1234")
    monkeypatch.delenv("API_TRIGGER", raising=False)
    data = {**BASE, "kafka": {"bootstrap_servers": "${API_BOOTSTRAP}"}, "trigger": "${API_TRIGGER:-2s}",
            "max_events_per_batch": "${API_MAX_EVENTS:-500}",
            "joins": [{"dataset": "devices", "on": "device_id", "prefix": "${API_PREFIX:-}"}]}
    cfg = enrich.load_config(data)
    assert cfg.kafka == {"bootstrap.servers": "broker:1234"}
    assert cfg.trigger == timedelta(seconds=2) and cfg.max_events_per_batch == 500  # then typed, as from a file
    assert cfg.joins[0].prefix == ""
    monkeypatch.delenv("API_BOOTSTRAP")
    with pytest.raises(ConfigError, match=r"^config: kafka.bootstrap_servers: environment variable API_BOOTSTRAP "
                                          r"is not set$"):
        enrich.load_config(data)
    with pytest.raises(ConfigError, match=r"^config: top level must be a mapping or a file path, got list"):
        enrich.load_config([BASE])  # type: ignore[arg-type]


def test_enrich_load_config_does_not_import_pyspark() -> None:
    # In a child process: this test session has imported pyspark already (under a second).
    code = ("import sys, enrich\n"
            "cfg = enrich.load_config({'kafka': {'bootstrap_servers': 'h:1'}, 'events': {'topic': 'e', "
            "'schema': 'x INT'}, 'output': {'console': {}}, 'dead_letter_topic': 'd', 'checkpoint': 'c'})\n"
            "assert cfg.output.kind == 'console'\n"
            "assert 'pyspark' not in sys.modules, sorted(m for m in sys.modules if m.startswith('pyspark'))\n"
            "assert enrich.EnrichJob.__name__ == 'EnrichJob' and 'pyspark' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


STATE = {"key": "device_id", "timestamp": "ts"}


def test_output_database_alone_or_with_kafka(monkeypatch: pytest.MonkeyPatch) -> None:
    db = {"url": "postgresql://root@127.0.0.1:5432/test", "table": "device_state", "write": "state"}
    cfg = config.parse({**BASE, "state": STATE, "output": {"database": db}})
    assert cfg.output.kind == "database" and cfg.output.topic is None
    assert cfg.output.database == config.DatabaseOutput(url=db["url"], table="device_state", write="state",
                                                        dialect="postgresql")
    assert cfg.output.database.fence == "device_state_commits"
    both = config.parse({**BASE, "output": {"database": {**db, "url": "mysql+pymysql://root@h/test",
                                                         "write": "events"}, "kafka": {"topic": "o"}}})
    assert both.output.kind == "kafka" and both.output.topic == "o"
    assert both.output.database is not None and both.output.database.dialect == "mysql"
    # ${VAR} in the URL, as in every other value.
    monkeypatch.setenv("DB_PASSWORD", "s3cret")
    loaded = config.load_config({**BASE, "state": STATE, "output": {"database": {
        **db, "url": "postgresql://app:${DB_PASSWORD}@db:5432/x"}}})
    assert loaded.output.database is not None and loaded.output.database.url == "postgresql://app:s3cret@db:5432/x"
    assert "s3cret" not in loaded.output.database.describe()


def test_output_database_statement_timeout_is_a_duration() -> None:
    db = {"url": "postgresql://h/d", "table": "t", "write": "events"}
    assert config.parse({**BASE, "output": {"database": db}}).output.database.statement_timeout == timedelta(seconds=30)
    got = config.parse({**BASE, "output": {"database": {**db, "statement_timeout": "1500ms"}}}).output.database
    assert got is not None and got.statement_timeout == timedelta(milliseconds=1500)


def test_postgresql_names_over_63_bytes_are_refused_at_load() -> None:
    """PostgreSQL cuts longer names short silently: the job would create one table and look for another."""
    db = {"url": "postgresql://h/d", "table": "t" * 56, "write": "events"}
    with pytest.raises(ConfigError, match=r"output\.database: PostgreSQL names are at most 63 bytes; the job would "
                                          r"create 't{56}_commits' \(64 bytes\)"):
        config.parse({**BASE, "output": {"database": db}}, "enrich.yaml")
    long = "temperature_of_the_device_measured_at_its_outer_casing_now"    # 58 bytes: its _mean is 63, _last 63
    state = {**STATE, "aggregates": {long: ["mean", "max"]}}
    ok = config.parse({**BASE, "state": state, "output": {"database": {**db, "table": "s", "write": "state"}}})
    assert ok.output.database is not None
    with pytest.raises(ConfigError, match=rf"would create 'state_{long}_mean' \(69 bytes\), 'state_{long}_max'"):
        config.parse({**BASE, "state": state, "output": {"database": {**db, "table": "s"}}})
    joined = {**BASE, "joins": [{"dataset": "devices", "on": "device_id", "columns": ["model_id"], "prefix": "p" * 60}]}
    with pytest.raises(ConfigError, match=r"would create '_p{60}devices_matched' \(76 bytes\), 'p{60}model_id'"):
        config.parse({**joined, "output": {"database": {**db, "table": "s"}}})
    # MariaDB's limit is 64 characters, which the table's pattern keeps.
    assert config.parse({**BASE, "output": {"database": {**db, "url": "mysql+pymysql://root@h/d"}}}).output.database


@pytest.mark.parametrize(("output", "state", "message"), [
    ({"database": {"url": "postgresql://h/d", "table": "t", "write": "rows"}}, STATE,
     "output.database.write: 'rows' is not one of state, events"),
    ({"database": {"url": "postgresql://h/d", "table": "t"}}, STATE, "output.database.write: is required"),
    ({"database": {"url": "postgresql://h/d", "table": "t", "write": "state"}}, None,
     "output.database.write: write: state needs a state: section"),
    ({"database": {"url": "sqlite:///x.db", "table": "t", "write": "events"}}, None,
     "output.database.url: expected a postgresql://... or mysql+pymysql://... URL"),
    ({"database": {"url": "postgresql://h/d", "table": "a-b", "write": "events"}}, None,
     "output.database.table: 'a-b' is not a table name"),
    ({"database": {"url": "postgresql://h/d", "table": "t", "write": "events"}, "parquet": {"path": "p"}}, None,
     "output: database: goes alone or with kafka:"),
    ({"database": {"url": "postgresql://h/d", "table": "t", "write": "events", "mode": "x"}}, None,
     "output.database: unknown key(s): mode"),    ({"database": {"url": "postgresql://h/d", "table": "t", "write": "events", "statement_timeout": "soon"}}, None,
     "output.database.statement_timeout: "),
    ({"database": {"url": "postgresql://h/d", "table": "t", "write": "events", "statement_timeout": "0s"}}, None,
     "output.database.statement_timeout: must be positive"),
])
def test_output_database_errors_name_the_key(output: dict, state: dict | None, message: str) -> None:
    data = {**BASE, "output": output, **({"state": state} if state else {})}
    with pytest.raises(ConfigError) as exc:
        config.parse(data, "enrich.yaml")
    assert message in str(exc.value) and str(exc.value).startswith("enrich.yaml: ")

"""``enrich validate [--connect]`` and the CLI's ``--version`` / ``--log-format``: the config checked
(Spark parses ``events.schema`` as the job does) and what would run shown, without running the job."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enrich.cli import main
from refstream.kafka import ensure_topic
from tests.timing import bound

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """\
kafka: {{bootstrap_servers: "{bootstrap}"}}
events: {{topic: {events}, schema: "{schema}", required: [device_id]}}
joins:
  - {{dataset: devices, topic: {devices}, on: device_id, columns: [site_id]}}
  - {{dataset: sites, topic: {sites}, on: {{site_id: id}}, how: inner, prefix: s_}}
output: {{kafka: {{topic: out}}}}
dead_letter_topic: dlq
checkpoint: {checkpoint}
"""
SCHEMA = "device_id STRING, ts TIMESTAMP, temperature DOUBLE"


def write(tmp_path: Path, *, bootstrap: str = "127.0.0.1:9", schema: str = SCHEMA, events: str = "ev",
          devices: str = "ref.devices", sites: str = "ref.sites") -> Path:
    p = tmp_path / "enrich.yaml"
    p.write_text(CONFIG.format(bootstrap=bootstrap, schema=schema, events=events, devices=devices, sites=sites,
                               checkpoint=tmp_path / "ck"))
    return p


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"enrich {importlib.metadata.version('refstream')}"


def test_validate_prints_the_plan_and_the_schema_spark_parsed(spark, tmp_path, capsys):
    p = write(tmp_path)
    assert main(["validate", "--config", str(p)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{p}: events from ev (starting latest, source python, parser auto), broker 127.0.0.1:9",
        f"  schema: {SCHEMA}; required: device_id",
        "  join devices (left) from ref.devices on device_id = <key>: site_id",
        "  join sites (inner) from ref.sites on site_id = id: every non-key column as s_*",
        f"  output: Kafka topic out; dead letters to dlq; checkpoint {tmp_path / 'ck'}; trigger 1s, at most "
        f"100,000 events per batch",
        "  events schema parsed by Spark: struct<device_id:string,ts:timestamp,temperature:double>",
        f"{p}: valid (broker not contacted: --connect does)",
    ]
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(("schema", "error"), [
    ("device_id STRING, ts TIMESTAMPX", "events.schema: 'device_id STRING, ts TIMESTAMPX' is not a Spark DDL schema"),
    ("id STRING, ts TIMESTAMP", "events.required: ['device_id'] not in events.schema"),
])
def test_a_schema_spark_refuses_exits_1_naming_the_key(spark, tmp_path, capsys, schema, error):
    p = write(tmp_path, schema=schema)
    assert main(["validate", "--config", str(p)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"enrich: invalid: {p}: {error}") and len(err.splitlines()) == 1


def test_connect_finds_the_changelog_topics_the_job_needs(spark, kafka, unique, tmp_path, capsys):
    events, devices, sites = unique("ev"), unique("ref.devices"), unique("ref.sites")
    ensure_topic(kafka, devices, partitions=2)
    p = write(tmp_path, bootstrap=kafka["bootstrap.servers"], events=events, devices=devices, sites=sites)
    assert main(["validate", "--config", str(p), "--connect"]) == 1
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[-5:] == [f"  events {events}: missing (the job waits for it)",
                        f"  join devices: changelog {devices}: 2 partition(s)",
                        f"  join sites: changelog {sites}: MISSING",
                        *[line for line in out if line.startswith("  output out: ")],
                        f"{p}: invalid"]
    assert captured.err.strip() == (f"enrich: join sites: changelog topic {sites} does not exist: run the "
                                    f"refresher (refresh run sites) before the job")
    ensure_topic(kafka, sites)
    assert main(["validate", "--config", str(p), "--connect"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{p}: valid"


def test_connect_to_no_broker_exits_1(spark, tmp_path, capsys):
    p = write(tmp_path)
    assert main(["validate", "--config", str(p), "--connect"]) == 1
    assert capsys.readouterr().err.startswith("enrich: broker 127.0.0.1:9: cannot reach Kafka: ")


def test_json_log_format(tmp_path):
    """A failure under --debug is logged as one JSON record carrying the traceback."""
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run([sys.executable, "-m", "enrich", "run", "--config", str(missing), "--debug",
                           "--log-format", "json"], capture_output=True, text=True, timeout=bound(120),
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert proc.returncode == 2
    *logged, last = proc.stderr.splitlines()
    assert last == f"enrich: error: config file {missing} not found"
    records = [json.loads(line) for line in logged]
    assert [(r["level"], r["logger"], r["message"]) for r in records] == [("ERROR", "enrich", "enrich failed")]
    assert "Traceback" in records[0]["exc"] and "ConfigError" in records[0]["exc"]


EXPLAINED = """\
kafka: {{bootstrap_servers: "{bootstrap}"}}
events: {{topic: {events}, schema: "device_id STRING, site_id STRING, ts TIMESTAMP, temp DOUBLE"}}
joins:
  - {{dataset: models, topic: {models}, on: {{model_id: id}}, columns: [model_name], how: inner}}
  - {{dataset: sites, topic: {sites}, on: site_id}}
  - {{dataset: devices, topic: {devices}, on: device_id, columns: [model_id], strategy: partitioned}}
output: {{kafka: {{topic: out}}}}
dead_letter_topic: dlq
checkpoint: {checkpoint}
state: {{key: device_id, timestamp: ts, buckets: 8, aggregates: {{temp: [mean], region: [last]}}}}
"""


def test_explain_prints_the_plan_in_order_with_the_columns_each_stage_adds(spark, kafka, unique, tmp_path, capsys):
    from refstream.contract import Column, DatasetSchema
    from tests.enrich.helpers import changelog, publish

    topics = {n: unique(f"ref.{n}") for n in ("models", "sites", "devices")}
    publish(kafka, topics["models"], changelog(DatasetSchema("models", ("id",), (
        Column("id", "string"), Column("model_name", "string"), Column("vendor", "string")))))
    publish(kafka, topics["sites"], changelog(DatasetSchema("sites", ("site_id",), (
        Column("site_id", "string"), Column("region", "string"), Column("city", "string")))))
    publish(kafka, topics["devices"], changelog(DatasetSchema("devices", ("device_id",), (
        Column("device_id", "string"), Column("model_id", "string")))))
    p = tmp_path / "enrich.yaml"
    events = unique("ev")
    p.write_text(EXPLAINED.format(bootstrap=kafka["bootstrap.servers"], events=events, checkpoint=tmp_path / "ck",
                                  **topics))
    assert main(["validate", "--config", str(p), "--explain"]) == 0
    out = capsys.readouterr().out.splitlines()
    plan = out[out.index(f"{p}: the job's plan, in order"):-1]
    # The state aggregates region: its join runs before the step; models joins on a column the
    # partitioned join adds inside the step, so it runs in the join pass, after the state.
    assert plan[1:] == [
        f"  1. read {events} (Kafka, starting latest, at most 100,000 events per batch)",
        "  2. parse events.schema (pyarrow where exact, else from_json): + device_id, site_id, ts, temp",
        "  3. join sites (left, on site_id = site_id, broadcast, in the plan before the state step): + region, city, "
        "_sites_matched",
        "  4. join devices (left, on device_id = device_id, partitioned, in the state step): + model_id, "
        "_devices_matched",
        "  5. state keyed by device_id (8 buckets, ttl 3600s, watermark 300s): + state, _late",
        "  6. join models (inner, on model_id = id, broadcast, in the join pass): + model_name, _models_matched",
        "  7. sink kafka (Kafka topic out, exactly once per batch; dead letters to dlq)",
        "  output columns: device_id, site_id, ts, temp, region, city, _sites_matched, model_id, _devices_matched, "
        "state, _late, model_name, _models_matched",
    ]
    assert out[-1] == f"{p}: valid"
    from enrich import config
    from enrich.validate import summary

    assert not set(summary(config.load(p))) & set(out), "the plan is printed once, as the stages"
    assert not (tmp_path / "ck").exists(), "validate writes no checkpoint"


def test_explain_names_a_join_the_published_schema_refuses(spark, kafka, unique, tmp_path, capsys):
    from refstream.contract import Column, DatasetSchema
    from tests.enrich.helpers import changelog, publish

    devices, sites = unique("ref.devices"), unique("ref.sites")
    publish(kafka, devices, changelog(DatasetSchema("devices", ("device_id",), (
        Column("device_id", "string"), Column("owner", "string")))))
    publish(kafka, sites, changelog(DatasetSchema("sites", ("id",), (Column("id", "string"),))))
    p = write(tmp_path, bootstrap=kafka["bootstrap.servers"], events=unique("ev"), devices=devices, sites=sites)
    assert main(["validate", "--config", str(p), "--explain"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"enrich: {p}: joins[0] (devices): columns: ['site_id'] not in the published schema "
                   "['device_id', 'owner']")


CALLS = """\
kafka: {{bootstrap_servers: "127.0.0.1:9"}}
events: {{topic: ev, schema: "{schema}"}}
joins:
  - {{dataset: devices, topic: ref.devices, on: device_id, columns: [site_id], prefix: d_}}
{more_joins}
state: {{key: device_id, timestamp: ts}}
calls:
  - {{name: risk, url: "http://127.0.0.1:9/risk", body: {{site: "{{{column}}}", t: "{{temperature}}"}},
     response: {{score: double}}}}
output: {{kafka: {{topic: out}}}}
dead_letter_topic: dlq
checkpoint: {checkpoint}
"""


@pytest.mark.parametrize(("column", "more_joins", "valid"), [
    ("d_site_id", "", True),                      # a join's column, prefixed
    ("_d_devices_matched", "", True),             # a join's matched flag
    ("site_id", "", False),                       # the join adds it as d_site_id only
    ("sitee", "", False),                         # a typo
    ("sitee", "  - {dataset: sites, topic: ref.sites, on: {d_site_id: id}}", True),  # may come from sites
])
def test_validate_checks_what_a_call_template_names_without_the_broker(spark, tmp_path, capsys, column, more_joins,
                                                                      valid):
    """A template naming neither an event field nor a join's column is refused offline, naming the
    call and the column; a join without ``columns:`` may add any column, which only its published
    schema (``--explain``, the job's start) can tell."""
    p = tmp_path / "enrich.yaml"
    p.write_text(CALLS.format(schema=SCHEMA, more_joins=more_joins, column=column, checkpoint=tmp_path / "ck"))
    assert main(["validate", "--config", str(p)]) == (0 if valid else 1)
    err = capsys.readouterr().err.strip()
    if not valid:
        assert err == (f"enrich: invalid: {p}: calls (risk).body: {{{column}}}: neither an event field nor a join's "
                       "column (have: d_site_id, device_id, temperature, ts)")

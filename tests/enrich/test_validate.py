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
                           "--log-format", "json"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert proc.returncode == 2
    *logged, last = proc.stderr.splitlines()
    assert last == f"enrich: error: config file {missing} not found"
    records = [json.loads(line) for line in logged]
    assert [(r["level"], r["logger"], r["message"]) for r in records] == [("ERROR", "enrich", "enrich failed")]
    assert "Traceback" in records[0]["exc"] and "ConfigError" in records[0]["exc"]

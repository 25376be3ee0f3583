"""``refresh validate [--connect]``: the config checked and what would run shown, without running it."""

from __future__ import annotations

from pathlib import Path

from refresh.cli import main
from tests.refresh.conftest import execute

CONFIG = """\
kafka: {{bootstrap_servers: "{bootstrap}"}}
state_dir: {state}
datasets:
  devices:
    source: {{url: "{url}", table: {table}}}
    key: [id]
    schedule: {{every: 90m}}
  models:
    source: {{url: "{url}", query: "SELECT id, u FROM {table}"}}
    key: id
    mode: incremental
    incremental: {{column: u, lag: 5s, reconcile: {{every: 1d}}}}
    schedule: {{cron: "0 3 * * mon-fri"}}
  sites:
    source: {{path: "{csv}"}}
    key: [site_id]
    watch: true
    topic: {topic}
"""


def write(tmp_path: Path, *, bootstrap: str = "127.0.0.1:9", url: str | None = None, table: str = "t",
          csv: Path | None = None, topic: str = "ref.sites") -> Path:
    p = tmp_path / "refresh.yaml"
    p.write_text(CONFIG.format(bootstrap=bootstrap, state=tmp_path / "state", table=table, topic=topic,
                               url=url or f"sqlite:///{tmp_path / 'ref.db'}", csv=csv or tmp_path / "sites.csv"))
    return p


def test_validate_prints_what_would_run_without_contacting_anything(tmp_path, capsys):
    p = write(tmp_path)  # neither the database, the file nor the broker exists
    assert main(["--config", str(p), "validate"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{p}: 3 dataset(s), broker 127.0.0.1:9, state in {tmp_path / 'state'}"
    assert out[1] == (f"  devices: diff of sqlite:///{tmp_path / 'ref.db'} table t, key ['id'] -> topic "
                      f"ref.devices; every 1h30m")
    assert out[2].startswith(f"  models: incremental on u (lag 5s, full diff every 1d) of sqlite:///"
                             f"{tmp_path / 'ref.db'} query, key ['id'] -> topic ref.models; cron '0 3 * * mon-fri' "
                             f"(next ")
    assert out[3] == f"  sites: diff of {tmp_path / 'sites.csv'}, key ['site_id'] -> topic ref.sites; on file change"
    assert out[4] == f"{p}: valid (sources and broker not contacted: --connect does)"
    assert not (tmp_path / "state").exists()


def test_an_invalid_config_exits_1_naming_the_key(tmp_path, capsys):
    p = write(tmp_path)
    p.write_text(p.read_text().replace("0 3 * * mon-fri", "0 3 * * mon-fry"))
    assert main(["--config", str(p), "validate"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (f"refresh: invalid: {p}: datasets.models.schedule.cron: '0 3 * * mon-fry': "
                                    f"Invalid weekday name \"fry\"")
    assert main(["--config", str(tmp_path / "nope.yaml"), "validate"]) == 1
    assert capsys.readouterr().err.strip() == f"refresh: invalid: config file {tmp_path / 'nope.yaml'} not found"


def test_connect_reaches_every_source_and_the_broker(tmp_path, mysql_engine, mysql_url, kafka, unique, capsys):
    table, topic = unique("val"), unique("ref.sites")
    execute(mysql_engine, f"CREATE TABLE {table} (id INT PRIMARY KEY, u INT)")
    csv = tmp_path / "sites.csv"
    csv.write_text("site_id,name\ns-1,Lyon\n")
    p = write(tmp_path, bootstrap=kafka["bootstrap.servers"], url=mysql_url, table=table, csv=csv, topic=topic)
    assert main(["--config", str(p), "run", "sites"]) == 0  # its topic exists now
    capsys.readouterr()
    assert main(["--config", str(p), "validate", "--connect"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4:] == [
        "  devices: source reachable, columns id, u",
        "  models: source reachable, columns id, u",
        f"  sites: source 1 file(s), {csv.stat().st_size} bytes",
        *[line for line in out if line.startswith(f"  broker {kafka['bootstrap.servers']}: reachable, ")],
        "  devices: topic ref.devices: missing (created with 1 partition(s) by the first run)",
        "  models: topic ref.models: missing (created with 1 partition(s) by the first run)",
        f"  sites: topic {topic}: 1 partition(s)",
        f"{p}: valid",
    ]


def test_connect_reports_every_problem_and_exits_1(tmp_path, mysql_url, capsys):
    p = write(tmp_path, url=mysql_url, table="no_such_table")  # no CSV file, nothing on port 9
    assert main(["--config", str(p), "validate", "--connect"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1] == f"{p}: invalid"
    err = captured.err.splitlines()
    assert len(err) == 4, err
    assert err[0].startswith("refresh: dataset devices: probe on mysql+pymysql://") and "no_such_table" in err[0]
    assert err[1].startswith("refresh: dataset models: probe on mysql+pymysql://") and "no_such_table" in err[1]
    assert err[2] == f"refresh: dataset sites: file {tmp_path / 'sites.csv'} not found"
    assert err[3].startswith("refresh: broker 127.0.0.1:9: cannot reach Kafka: ")

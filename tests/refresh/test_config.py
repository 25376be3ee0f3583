"""conf/refresh.yaml parsing: defaults, paths, and errors that name the key."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

import refresh
from refresh.config import SqlSourceConfig, load_config
from refstream.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, datasets: str, top: str = "") -> Path:
    p = tmp_path / "refresh.yaml"
    p.write_text(f"kafka:\n  bootstrap_servers: 127.0.0.1:9\n  security.protocol: PLAINTEXT\n{top}datasets:\n{datasets}")
    return p


def test_full_example_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REF_DB_URL", "mysql+pymysql://u:secret@db/ref")
    p = write(tmp_path, """\
  devices:
    source: {url: "mysql+pymysql://root@127.0.0.1:3306/refdata", table: devices}
    key: [device_id]
    schedule: {every: 6h}
    topic: ref.devices
  models:
    source: {url: "${REF_DB_URL}", query: "SELECT * FROM device_models"}
    key: [model_id, rev]
    mode: incremental
    incremental: {column: last_update, lag: 30s, reconcile: {every: 24h}}
    schedule: {cron: "0 */6 * * *"}
  sites:
    source: {path: data/sites.csv}
    key: site_id
    watch: true
    allow_empty: true
""", "state_dir: var/refresh\n")
    cfg = load_config(p)
    assert cfg.kafka == {"bootstrap.servers": "127.0.0.1:9", "security.protocol": "PLAINTEXT"}
    assert cfg.state_dir == tmp_path / "var" / "refresh"
    d, m, s = cfg.datasets["devices"], cfg.datasets["models"], cfg.datasets["sites"]
    assert (d.mode, d.key, d.topic, d.schedule.every, d.schedule.cron) == ("diff", ("device_id",), "ref.devices",
                                                                          timedelta(hours=6), None)
    assert d.source.kind == "sql" and d.source.table == "devices" and not d.watch and not d.allow_empty
    assert m.topic == "ref.models" and m.key == ("model_id", "rev") and m.schedule.cron == "0 */6 * * *"
    assert (m.incremental.column, m.incremental.lag, m.incremental.reconcile_every) == (
        "last_update", timedelta(seconds=30), timedelta(hours=24))
    assert m.source.query == "SELECT * FROM device_models" and "secret" not in m.source.describe()
    assert s.source.kind == "files" and s.source.format == "csv" and s.watch and s.allow_empty
    assert s.source.path == str(tmp_path / "data" / "sites.csv")  # relative to the working directory
    assert s.schedule.every is None and s.schedule.cron is None


@pytest.mark.parametrize(("incremental", "every"), [
    ("{column: u}", timedelta(days=1)),                        # on by default: daily
    ("{column: u, reconcile: off}", None),
    ("{column: u, reconcile: {every: off}}", None),
    ("{column: u, reconcile_every: 'off'}", None),
    ("{column: u, reconcile: {every: 6h}}", timedelta(hours=6)),
    ("{column: u, reconcile_every: 2h}", timedelta(hours=2)),
])
def test_reconcile_is_daily_unless_turned_off(tmp_path: Path, incremental: str, every: timedelta | None) -> None:
    cfg = load_config(write(tmp_path, "  d:\n    source: {url: 'sqlite://', table: t}\n    key: [id]\n"
                                      f"    mode: incremental\n    incremental: {incremental}\n"))
    inc = cfg.datasets["d"].incremental
    assert inc is not None and inc.reconcile_every == every and inc.numeric_lag == 1000


def test_sql_timeouts_default_and_turn_off(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "  a:\n    source: {url: 'sqlite://', table: t}\n    key: [id]\n"
                                      "  b:\n    source: {url: 'sqlite://', table: t, connect_timeout: 2s, "
                                      "read_timeout: 90, statement_timeout: off}\n    key: [id]\n"))
    a, b = cfg.datasets["a"].source, cfg.datasets["b"].source
    assert isinstance(a, SqlSourceConfig) and isinstance(b, SqlSourceConfig)
    assert (a.connect_timeout, a.read_timeout, a.statement_timeout) == (
        timedelta(seconds=10), timedelta(minutes=10), timedelta(hours=1))
    assert (b.connect_timeout, b.read_timeout, b.statement_timeout) == (
        timedelta(seconds=2), timedelta(seconds=90), None)


def test_sql_reader_defaults_to_auto_and_is_checked(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "  a:\n    source: {url: 'mysql+pymysql://h/db', table: t}\n    key: [id]\n"
                                      "  b:\n    source: {url: 'mariadb+pymysql://h/db', table: t, reader: pymysql}\n"
                                      "    key: [id]\n"
                                      "  c:\n    source: {url: 'mysql://h/db', table: t, reader: connectorx, "
                                      "read_partitions: 4}\n    key: [id]\n"))
    a, b, c = (cfg.datasets[n].source for n in "abc")
    assert isinstance(a, SqlSourceConfig) and isinstance(b, SqlSourceConfig) and isinstance(c, SqlSourceConfig)
    assert (a.reader, a.read_partitions, b.reader, c.reader, c.read_partitions) == (
        "auto", 1, "pymysql", "connectorx", 4)


@pytest.mark.parametrize(("datasets", "error"), [
    ("  d:\n    source: {url: 'mysql://h/db', table: t, reader: fast}\n    key: [id]\n",
     "datasets.d.source.reader: 'fast' is not one of auto, connectorx, pymysql"),
    ("  d:\n    source: {url: 'sqlite://', table: t, reader: connectorx}\n    key: [id]\n",
     "datasets.d.source.reader: 'connectorx' reads MySQL/MariaDB URLs only"),
    ("  d:\n    source: {url: 'mysql://h/db', query: 'SELECT 1', read_partitions: 2}\n    key: [id]\n",
     "datasets.d.source.read_partitions: more than 1 needs a MySQL/MariaDB table"),
    ("  d:\n    source: {url: 'mysql://h/db', table: t, read_partitions: 0}\n    key: [id]\n",
     "datasets.d.source.read_partitions: must be at least 1"),
    ("  d:\n    source: {path: a.csv}\n    key: [id]\n    mode: incremental\n",
     "datasets.d.mode: incremental mode needs a SQL source"),
    ("  d:\n    source: {url: 'sqlite://', table: t}\n    key: [id]\n    mode: incremental\n",
     "datasets.d.incremental.column: is required in incremental mode"),
    ("  d:\n    source: {url: 'sqlite://', table: t}\n    key: [id]\n    watch: true\n",
     "datasets.d.watch: only file sources can be watched"),
    ("  d:\n    source: {url: 'sqlite://', table: t, query: 'SELECT 1'}\n    key: [id]\n",
     "datasets.d.source: give exactly one of table or query"),
    ("  d:\n    source: {path: a.txt}\n    key: [id]\n", "datasets.d.source.path: cannot tell the format"),
    ("  d:\n    source: {path: a.csv}\n    key: [id]\n    schedule: {every: 6x}\n",
     "datasets.d.schedule.every: '6x' is not a duration"),
    ("  d:\n    source: {path: a.csv}\n    key: [id]\n    schedule: {every: 1h, cron: '* * * * *'}\n",
     "datasets.d.schedule: give either every or cron"),
    # Cron expressions are parsed by APScheduler at load: a bad field fails here, not at the daemon's start.
    ("  d:\n    source: {path: a.csv}\n    key: [id]\n    schedule: {cron: '61 * * * *'}\n",
     "datasets.d.schedule.cron: '61 \\* \\* \\* \\*': Error validating expression"),
    ("  d:\n    source: {path: a.csv}\n    key: [id]\n    schedule: {cron: '0 0 * * mon-fry'}\n",
     "datasets.d.schedule.cron: '0 0 \\* \\* mon-fry':"),
    ("  d:\n    source: {path: a.csv}\n    key: [id]\n    schedule: {cron: '0 0 * *'}\n",
     "datasets.d.schedule.cron: '0 0 \\* \\*' is not a 5-field cron expression"),
    ("  d:\n    source: {path: a.csv}\n    key: [id]\n    schedul: {every: 1h}\n",
     "datasets.d: unknown key\\(s\\): schedul"),
    ("  d:\n    source: {path: a.csv}\n", "datasets.d.key: is required"),
    ("  d:\n    source: {path: a.csv, types: {id: int32}}\n    key: [id]\n",
     "datasets.d.source.types.id: unknown column type 'int32'"),
    ("  _x:\n    source: {path: a.csv}\n    key: [id]\n", "bad dataset name '_x'"),
    ("  d:\n    source: {url: 'sqlite://', table: t, statement_timeout: soon}\n    key: [id]\n",
     "datasets.d.source.statement_timeout: 'soon' is not a duration"),
    ("  d:\n    source: {url: 'sqlite://', table: t}\n    key: [id]\n    mode: incremental\n"
     "    incremental: {column: id, numeric_lag: -1}\n", "datasets.d.incremental.numeric_lag: must not be negative"),
])
def test_errors_name_the_key(tmp_path: Path, datasets: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(write(tmp_path, datasets))


def test_shipped_example_loads() -> None:
    cfg = load_config(ROOT / "conf" / "refresh.yaml")
    assert set(cfg.datasets) >= {"devices", "models", "sites"}
    assert cfg.datasets["models"].mode == "incremental"


# The Python API: refresh.load_config(mapping) applies exactly the checks a YAML file gets.

def mapping_config() -> dict:
    return {
        "kafka": {"bootstrap_servers": "127.0.0.1:9", "security.protocol": "PLAINTEXT"},
        "state_dir": "var/refresh",
        "datasets": {
            "devices": {"source": {"url": "sqlite:///ref.db", "table": "devices", "read_timeout": "90s"},
                        "key": ["device_id"], "schedule": {"every": "6h"}, "heartbeat": "off"},
            "sites": {"source": {"path": "data/sites.csv"}, "key": "site_id", "watch": True},
        },
    }


def yaml_file(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "api.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_a_mapping_loads_as_the_same_yaml_file_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = yaml_file(tmp_path, mapping_config())
    from_mapping = refresh.load_config(mapping_config(), source=str(path))
    assert from_mapping == load_config(path)
    assert from_mapping.datasets["devices"].schedule.every == timedelta(hours=6)
    assert from_mapping.state_dir == tmp_path / "var" / "refresh"  # relative to the working directory, too
    assert refresh.load_config(mapping_config()).path == Path("config")


@pytest.mark.parametrize(("change", "error"), [
    (lambda c: c["datasets"]["devices"]["source"].update(tabel="x"),
     "datasets.devices.source: unknown key(s): tabel"),
    (lambda c: c.update(retires={"attempts": 3}), "<top>: unknown key(s): retires"),
    (lambda c: c["datasets"]["devices"].update(partitions="many"),
     "datasets.devices.partitions: expected int, got 'many'"),
    (lambda c: c["datasets"]["devices"]["schedule"].update(every="6x"),
     "datasets.devices.schedule.every: '6x' is not a duration"),
    (lambda c: c["datasets"]["sites"].update(watch="yes"), "datasets.sites.watch: expected bool, got 'yes'"),
    (lambda c: c.update(kafka=["127.0.0.1:9"]), "kafka: must be a mapping, got list"),
])
def test_a_bad_mapping_fails_with_the_message_of_the_same_yaml_file(tmp_path: Path, change: Any, error: str) -> None:
    data = mapping_config()
    change(data)
    path = yaml_file(tmp_path, data)
    with pytest.raises(ConfigError) as from_file:
        load_config(path)
    with pytest.raises(ConfigError) as named:
        refresh.load_config(data, source=str(path))
    with pytest.raises(ConfigError) as unnamed:
        refresh.load_config(data)
    message = str(from_file.value)
    assert message.startswith(f"{path}: {error}") and "\n" not in message
    assert str(named.value) == message
    assert str(unnamed.value) == "config" + message.removeprefix(str(path))


def test_a_mapping_gets_the_environment_substitution_of_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_BROKER", "broker:9092")
    monkeypatch.setenv("API_DB_URL", "mysql+pymysql://u:p#w: d@db/ref")  # '#' and ': ' come through as set
    monkeypatch.delenv("API_EVERY", raising=False)
    data = mapping_config()
    data["kafka"]["bootstrap_servers"] = "${API_BROKER}"
    data["datasets"]["devices"]["source"]["url"] = "${API_DB_URL}"
    data["datasets"]["devices"]["schedule"]["every"] = "${API_EVERY:-30m}"  # substituted, then a duration
    data["datasets"]["devices"]["partitions"] = "${API_PARTITIONS:-3}"
    cfg = refresh.load_config(data)
    devices = cfg.datasets["devices"]
    assert cfg.kafka["bootstrap.servers"] == "broker:9092"
    assert isinstance(devices.source, SqlSourceConfig) and devices.source.url == "mysql+pymysql://u:p#w: d@db/ref"
    assert devices.schedule.every == timedelta(minutes=30) and devices.partitions == 3
    assert data["kafka"]["bootstrap_servers"] == "${API_BROKER}"  # the caller's mapping is left as it was
    monkeypatch.delenv("API_BROKER")
    with pytest.raises(ConfigError, match=r"^config: kafka.bootstrap_servers: environment variable API_BROKER "
                                          r"is not set$"):
        refresh.load_config(data)

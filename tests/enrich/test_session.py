"""What ``enrich run`` asks of Spark: the UI on unless the config's ``spark:`` section turns it off,
and the executors' Python from ``spark.pyspark.python``. Checked on the settings the session is
built from (no JVM); tests/enrich/test_cluster_packed.py runs the latter on a cluster."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

import enrich.session
from enrich import config
from enrich.cli import main
from enrich.session import session_conf

BASE = {
    "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "events": {"topic": "ev", "schema": "device_id STRING"},
    "output": {"kafka": {"topic": "out"}},
    "dead_letter_topic": "dlq",
    "checkpoint": "cp",
}


class Built(Exception):
    """Raised by the fake session builder: the job stops there."""


def built_by_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spark: dict[str, object] | None = None,
                 master: str = "local[1]") -> dict:
    """The arguments ``enrich run`` builds its session with, for a config with this ``spark:`` section."""
    path = tmp_path / "enrich.yaml"
    path.write_text(yaml.safe_dump({**BASE, **({"spark": spark} if spark is not None else {})}))
    seen: dict = {}

    def fake(master: str | None, app_name: str, conf: Mapping[str, str], *, ui: bool = False) -> None:
        seen.update(conf=session_conf(conf, ui=ui, master=master), master=master)
        raise Built

    monkeypatch.setattr(enrich.session, "build_session", fake)
    assert main(["run", "--config", str(path), "--master", master]) == 1
    return seen


def test_enrich_run_leaves_the_ui_on_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Unset, Spark's own default applies: the UI is on (and a spark-defaults.conf may say otherwise).
    assert "spark.ui.enabled" not in built_by_run(tmp_path, monkeypatch)["conf"]
    assert "spark.ui.enabled" not in built_by_run(tmp_path, monkeypatch, {"spark.driver.memory": "2g"})["conf"]


def test_the_config_turns_the_ui_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = built_by_run(tmp_path, monkeypatch, {"spark.ui.enabled": False, "spark.ui.port": 4050})["conf"]
    assert (conf["spark.ui.enabled"], conf["spark.ui.port"]) == ("false", "4050")


def test_sessions_other_than_the_job_run_without_ui() -> None:
    """Tests, ``enrich validate`` and the benchmarks build their sessions with the default."""
    assert session_conf()["spark.ui.enabled"] == "false"
    assert session_conf({"spark.ui.enabled": "true"})["spark.ui.enabled"] == "true"


def test_spark_pyspark_python_is_what_the_workers_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """PySpark reads the workers' Python from PYSPARK_PYTHON only: the session puts the setting there."""
    monkeypatch.setenv("PYSPARK_PYTHON", "/usr/bin/python3")
    started: dict[str, str] = {}

    class Builder:
        def appName(self, _name: str) -> Builder:
            return self

        def master(self, _m: str) -> Builder:
            return self

        def config(self, k: str, v: str) -> Builder:
            started[k] = v
            return self

        def getOrCreate(self) -> None:
            started["PYSPARK_PYTHON"] = os.environ["PYSPARK_PYTHON"]
            raise Built

    monkeypatch.setattr(enrich.session.SparkSession, "builder", Builder())
    cfg = config.parse({**BASE, "spark": {"spark.pyspark.python": "./env/bin/python"}})
    with pytest.raises(Built):
        enrich.session.build_session("local[1]", "t", cfg.spark_conf)
    assert started["PYSPARK_PYTHON"] == started["spark.executorEnv.PYSPARK_PYTHON"] == "./env/bin/python"


def test_on_a_cluster_the_driver_jvm_compiles_with_c1_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver runs no task there; in local mode its JVM is the executor and keeps both compilers."""
    key = "spark.driver.extraJavaOptions"
    assert key not in built_by_run(tmp_path, monkeypatch)["conf"]
    assert built_by_run(tmp_path, monkeypatch, master="spark://m:7077")["conf"][key] == "-XX:TieredStopAtLevel=1"
    # A user's own options are kept, and their own compiler setting wins.
    conf = built_by_run(tmp_path, monkeypatch, {key: "-Dx=1"}, master="spark://m:7077")["conf"]
    assert conf[key] == "-Dx=1 -XX:TieredStopAtLevel=1"
    conf = built_by_run(tmp_path, monkeypatch, {key: "-XX:TieredStopAtLevel=4"}, master="spark://m:7077")["conf"]
    assert conf[key] == "-XX:TieredStopAtLevel=4"


@pytest.mark.parametrize(("master", "partitions"), [
    ("local", "1"), ("local[2]", "2"), ("local[3,4]", "3"), ("local[*]", str(os.cpu_count() or 1)),
    ("local[*,2]", str(os.cpu_count() or 1)), ("spark://h:7077", "4"), ("local-cluster[2,1,1024]", "4"), (None, "4")])
def test_a_local_master_gets_a_shuffle_partition_per_task_slot(master: str | None, partitions: str) -> None:
    # State partitions beyond a local master's slots run in waves, each paying its per-batch costs.
    assert session_conf({}, master=master)["spark.sql.shuffle.partitions"] == partitions
    assert session_conf({"spark.sql.shuffle.partitions": "8"}, master=master)["spark.sql.shuffle.partitions"] == "8"

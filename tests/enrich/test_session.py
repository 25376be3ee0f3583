"""What ``enrich run`` asks of Spark: the UI on unless the config's ``spark:`` section turns it off,
and the executors' Python from ``spark.pyspark.python``. Checked on the settings the session is
built from (no JVM); tests/e2e/test_cluster_packed.py runs the latter on a cluster. The UI's
actions and address, and the job's defaults under ``spark-submit``, are checked on real drivers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import psutil
import pyspark
import pytest
import yaml
from pyspark.sql import SparkSession

import enrich.session
from enrich import config
from enrich.cli import main
from enrich.session import CLUSTER_PARTITIONS, QUIETED_LOGGERS, SHUFFLE_PARTITIONS, UI_DEFAULTS, session_conf
from tests.timing import bound

ROOT = Path(__file__).resolve().parents[2]

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


# A driver that builds its session as `enrich run` does and prints what Spark made of it: the given
# keys' values, and where its UI listens. Argument: JSON {"master", "conf", "keys"}.
PROBE = """
import json, socket, subprocess, sys, urllib.parse, urllib.request
import psutil
from enrich.session import build_session

arg = json.loads(sys.argv[1])
spark = build_session(arg["master"], "refstream-session-probe", arg["conf"], ui=True)
out = {"conf": {k: spark.conf.get(k, None) for k in arg["keys"]}}
url = spark.sparkContext.uiWebUrl
if url:
    port = urllib.parse.urlsplit(url).port
    out["listen"] = sorted({c.laddr.ip for c in psutil.net_connections("inet")
                            if c.status == psutil.CONN_LISTEN and c.laddr.port == port})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
        out["loopback_status"] = r.status
    hosts = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    out["others"] = {}
    for ip in (h for h in hosts if ":" not in h and not h.startswith("127.")):
        try:
            socket.create_connection((ip, port), timeout=5).close()
            out["others"][ip] = "connected"
        except OSError as exc:
            out["others"][ip] = type(exc).__name__
print("PROBE " + json.dumps(out), flush=True)
spark.stop()
"""


def probe(tmp_path: Path, argv: list[str], master: str | None, conf: dict[str, str], keys: list[str],
          env: Mapping[str, str] | None = None) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    arg = json.dumps({"master": master, "conf": conf, "keys": keys})
    full = {k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_IP"}
    full.update(PYTHONPATH=str(ROOT), **(env or {}))
    done = subprocess.run([*argv, str(script), arg], cwd=tmp_path, env=full, capture_output=True, text=True,
                          timeout=bound(300))
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")]
    return json.loads(line.removeprefix("PROBE "))


@pytest.mark.integration  # starts a JVM
def test_the_ui_kills_nothing_and_a_local_driver_listens_on_loopback_only(tmp_path: Path) -> None:
    """Anyone who reaches the UI could kill the micro-batch (and so the job) or stall executors: those
    actions are off, and a local master's UI is not reachable from other machines at all."""
    keys = [*UI_DEFAULTS, "spark.ui.enabled"]
    # tests/spark-conf's spark-defaults.conf turns the UI off: the config's spark: section turns it on.
    got = probe(tmp_path, [sys.executable], "local[1]",
                {"spark.ui.enabled": "true", "spark.ui.threadDumpsEnabled": "true"}, keys)
    assert got["conf"] == {"spark.ui.killEnabled": "false", "spark.ui.heapHistogramEnabled": "false",
                           "spark.ui.threadDumpsEnabled": "true",  # a user's setting wins
                           "spark.ui.enabled": "true"}, got
    assert got["loopback_status"] == 200, got
    assert got["listen"] and set(got["listen"]) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, got
    # This machine's other addresses (if any) refuse the UI's port.
    assert all(r == "ConnectionRefusedError" for r in got["others"].values()), got


@pytest.mark.integration  # runs spark-submit
def test_spark_submit_settings_win_over_the_jobs_defaults(tmp_path: Path) -> None:
    """Under spark-submit the JVM holds its --conf and spark-defaults.conf before the job builds its
    session: a default fills only a key that holds nothing (shuffle partitions are kept by a stateful
    checkpoint for life)."""
    # The tests' drivers compile with C1 only (tests/spark-conf): given here too, as this spark-submit
    # reads no tests' defaults, and the options are not among the keys checked.
    submit = [str(Path(pyspark.__file__).parent / "bin" / "spark-submit"), "--master", "local[1]",
              "--driver-java-options", "-XX:TieredStopAtLevel=1"]
    keys = [SHUFFLE_PARTITIONS, "spark.sql.execution.arrow.pyspark.enabled"]
    got = probe(tmp_path, [*submit, "--conf", f"{SHUFFLE_PARTITIONS}=7"], None, {}, keys)
    assert got["conf"] == {SHUFFLE_PARTITIONS: "7", "spark.sql.execution.arrow.pyspark.enabled": "true"}, got
    # Without a --conf the job's default applies, and a spark-defaults.conf setting wins as well.
    conf_dir = tmp_path / "spark-conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text("spark.ui.enabled false\n"
                                                  "spark.sql.execution.arrow.pyspark.enabled false\n")
    got = probe(tmp_path, submit, None, {}, keys, env={"SPARK_CONF_DIR": str(conf_dir)})
    assert got["conf"] == {SHUFFLE_PARTITIONS: str(CLUSTER_PARTITIONS),
                           "spark.sql.execution.arrow.pyspark.enabled": "false"}, got


def test_a_default_yields_to_a_preset_key() -> None:
    preset = {SHUFFLE_PARTITIONS: "7", "spark.ui.killEnabled": "true", "spark.ui.enabled": "true"}
    conf = session_conf({}, master="local[2]", preset=preset)
    # The preset values are Spark's already: the builder does not repeat them.
    assert SHUFFLE_PARTITIONS not in conf and "spark.ui.killEnabled" not in conf and "spark.ui.enabled" not in conf
    assert conf["spark.ui.threadDumpsEnabled"] == "false" and conf["spark.sql.session.timeZone"] == "UTC"
    # The config's spark: section still wins over both.
    assert session_conf({SHUFFLE_PARTITIONS: "3"}, preset=preset)[SHUFFLE_PARTITIONS] == "3"


def test_the_state_servers_missing_value_warnings_are_held_back(spark: SparkSession) -> None:
    """Every read of a state value that is not there logs a WARN in Spark's state server: the session
    holds that logger to ERROR (the job's own level is WARN)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    for name in QUIETED_LOGGERS:
        assert jvm.org.apache.logging.log4j.LogManager.getLogger(name).getLevel().toString() == "ERROR"


def test_the_session_starts_no_python_process_to_look_for_data_source_packages(spark: SparkSession) -> None:
    """Spark looks for Python data sources in installed packages at the first data source registered,
    with a PySpark daemon that stays up beside the JVM: the job's sessions skip that lookup (the
    other tests read through the job's own source in such sessions)."""
    from enrich import source

    source.register(spark)
    gateway = spark.sparkContext._gateway
    assert gateway is not None
    jvm = psutil.Process(gateway.proc.pid)  # type: ignore[attr-defined]
    children = []
    for child in jvm.children():
        try:
            children.append(" ".join(child.cmdline()))
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # another test's worker, exited since
            continue
    assert not [c for c in children if "lookup_data_sources" in c], children


def test_a_collects_results_come_through_a_unix_socket_no_local_client_can_take(spark: SparkSession) -> None:
    """The JVM serves a collect()'s rows on a socket that accepts one connection. On a TCP port of
    127.0.0.1, any local client that connects first (a Kafka client redialling a stopped broker whose
    port the JVM was given) takes it, and the driver is refused: PySpark's UnboundLocalError 'sockfile'.
    The job's sessions use Unix sockets, which have no port to collide with."""
    from pyspark.serializers import BatchedSerializer, CPickleSerializer
    from pyspark.util import _load_from_socket

    frame = spark.range(3)
    served = frame._jdf.collectToPython()  # what DataFrame.collect() reads from
    assert isinstance(served[0], str) and Path(served[0]).exists(), served[0]   # a socket file, not a port
    with _load_from_socket(served, BatchedSerializer(CPickleSerializer())) as stream:
        assert [r.id for r in stream] == [0, 1, 2]


def test_a_job_writes_its_checkpoint_files_through_the_file_system_api(spark: SparkSession) -> None:
    """Hadoop's FileContext asks a local file's link status by running ``readlink`` (dozens of
    processes a micro-batch): the job's queries use Spark's FileSystem-based checkpoint manager,
    unless the session names one of its own."""
    from refstream import compat

    key = compat.SPARK_CHECKPOINT_FILES
    before = spark.conf.get(key, None)
    try:
        spark.conf.unset(key)
        name = compat.spark_local_checkpoint_files(spark)
        assert name is not None and name.endswith(".FileSystemBasedCheckpointFileManager")
        assert spark.conf.get(key) == name
        spark.conf.set(key, "org.example.Mine")
        assert compat.spark_local_checkpoint_files(spark) is None
        assert spark.conf.get(key) == "org.example.Mine"
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)

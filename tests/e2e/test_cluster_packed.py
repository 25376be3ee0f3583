"""The job on a standalone cluster whose workers do not have the job's Python environment: the
recipe of docs/deployment.md ("On a Spark cluster"), run as written. The executors' Python workers
write the output, and no task sends event rows to the driver.

The wheel is built and installed with the `enrich` extra into a fresh venv, ``env``, which
``venv-pack`` packs (without PySpark's jars: the executors run their worker's Spark). The driver
runs ``env/bin/enrich run`` from the directory holding ``env``; the config ships the archive with
``spark.archives: refstream-env.tar.gz#env`` and names ``./env/bin/python`` as the Python of the
Python workers, which resolves to ``env`` on the driver and to the unpacked archive in each
executor's directory. The workers are started with an empty venv as their ``PYSPARK_PYTHON`` and
without the test's ``PYTHONPATH``: neither PySpark, pandas nor refstream can be imported there, so
the job completes only through the archive. Its own cluster fixture (not the session's ``cluster``) for
that reason: the workers' environment is the point.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from refstream.contract import Column, DatasetSchema
from tests.conftest import spark_defaults_less
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.enrich.process import write_config
from tests.enrich.spark_cluster import SPARK_HOME, both_executors, master_state, standalone_cluster
from tests.timing import bound

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("refstream", "refresh", "enrich", "demo")
SCHEMA = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
#: What the executors do not need from the packed env: PySpark's jars (their worker's Spark runs them).
EXCLUDE_JARS = "lib/python*/site-packages/pyspark/jars/*"

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # builds and packs a venv, starts a cluster


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without what points at the development venv or the checkout."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def run(argv: list[str | Path], cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=bound(timeout))
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    """A deployment directory as docs/deployment.md's recipe leaves it: ``env`` (the venv the driver runs)
    and ``refstream-env.tar.gz`` (the same venv, packed, for the executors)."""
    src, wheels, deploy = tmp_path / "src", tmp_path / "wheels", tmp_path / "deploy"
    src.mkdir()
    deploy.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    timings = {}
    t0 = time.monotonic()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, "./src"], tmp_path)
    (wheel,) = wheels.glob("refstream-*.whl")
    timings["wheel"] = time.monotonic() - t0
    # The recipe's commands, from the deployment directory.
    run([sys.executable, "-m", "venv", "env"], deploy)
    run(["env/bin/pip", "install", "-q", "-c", ROOT / "constraints.txt", f"{wheel}[enrich]"], deploy)
    timings["venv"] = time.monotonic() - t0 - timings["wheel"]
    run([Path(sys.executable).with_name("venv-pack"), "-p", "env", "-o", "refstream-env.tar.gz",
         "--exclude", EXCLUDE_JARS, "-q"], deploy)
    timings["pack"] = time.monotonic() - t0 - timings["wheel"] - timings["venv"]
    size = (deploy / "refstream-env.tar.gz").stat().st_size
    print(f"packed env: {size / 1e6:.0f} MB; " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    return deploy


@pytest.fixture
def bare_cluster(tmp_path: Path) -> Iterator[tuple[str, int, Path]]:
    """A master and two one-core workers whose Python is an empty venv (and no PYTHONPATH):
    ``(master URL, master UI port, that venv's python)``."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, env=clean_env())
    python = bare / "bin" / "python"
    with standalone_cluster(tmp_path, clean_env(PYSPARK_PYTHON=str(python)), cwd=tmp_path) as (master, ui):
        yield master, ui, python


def driver_jvm_args(pid: int, timeout: float = 300) -> list[str]:
    """The command line of the JVM the job's process ``pid`` started (its driver)."""
    deadline = time.monotonic() + bound(timeout)
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                args = [a.decode() for a in (stat.parent / "cmdline").read_bytes().split(b"\0") if a]
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid and args and args[0].endswith("java"):
                return args
        time.sleep(0.2)
    raise AssertionError(f"process {pid} started no JVM in {timeout}s")


def python_workers(under: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """(executable as started, working directory) -> (module, PYTHONPATH) of the PySpark Python
    processes (``python -m pyspark.<module>``) whose working directory is under ``under``."""
    found = {}
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd, cwd = p.info["cmdline"] or [], p.info["cwd"] or ""
        module = next((a for a in cmd[1:] if a.startswith("pyspark.")), None)
        if cwd.startswith(str(under)) and module:
            try:
                found[cmd[0], cwd] = module, p.environ().get("PYTHONPATH", "")
            except psutil.Error:
                found[cmd[0], cwd] = module, "?"
    return found


def test_job_on_workers_without_its_environment_runs_from_the_shipped_archive(
        deploy: Path, bare_cluster: tuple[str, int, Path], kafka: dict[str, str],
        unique: Callable[[str], str], tmp_path: Path) -> None:
    master, ui, bare_python = bare_cluster
    for lib in ("pyspark", "pandas", "pyarrow", "enrich"):  # what the workers' own Python lacks
        probe = subprocess.run([str(bare_python), "-c", f"import {lib}"], cwd=tmp_path, env=clean_env(),
                               capture_output=True)
        assert probe.returncode != 0, f"{lib} is importable by the workers' Python: the test proves nothing"

    total = 2000
    events_dir = tmp_path / "eventlog"
    events_dir.mkdir()
    cfg = write_config(deploy / "enrich.yaml", kafka, unique, spark={
        "spark.archives": "refstream-env.tar.gz#env",      # unpacked as ./env in each executor's directory
        "spark.pyspark.python": "./env/bin/python",       # the Python workers' interpreter, there and here
        "spark.executor.memory": "512m", "spark.driver.memory": "1g",
        "spark.driver.host": "127.0.0.1", "spark.sql.shuffle.partitions": "2", **both_executors(),
        "spark.eventLog.enabled": "true", "spark.eventLog.dir": events_dir.as_uri(),
        "spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "false"})
    publish(kafka, cfg["joins"][0]["topic"], changelog(SCHEMA, [{"device_id": f"d{i}", "owner": f"o{i}"}
                                                                for i in range(5)]))
    produce_events(kafka, cfg["events"]["topic"], [{"device_id": f"d{i % 6}", "n": i} for i in range(total)],
                   partitions=2)
    log = tmp_path / "job.log"
    # The tests' spark-defaults.conf gives every driver C1 only: this one must get it from the job
    # (DRIVER_JIT), so it runs with that file less that line.
    env = clean_env(**spark_defaults_less("spark.driver.defaultJavaOptions", tmp_path / "spark-defaults.conf"))
    t0 = time.monotonic()
    proc = subprocess.Popen(["env/bin/enrich", "run", "--config", "enrich.yaml", "--master", master,
                             "--available-now"], cwd=deploy, env=env, stdout=open(log, "ab"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)
    jvm = driver_jvm_args(proc.pid)
    workers: dict[tuple[str, str], tuple[str, str]] = {}
    driver: dict[tuple[str, str], tuple[str, str]] = {}
    try:
        while proc.poll() is None and time.monotonic() - t0 < bound(500):
            workers.update(python_workers(tmp_path / "work"))
            driver.update(python_workers(deploy))
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(bound(30))
    print(f"job: {time.monotonic() - t0:.0f}s; executors' Python: {workers}; driver's: {driver}")
    assert proc.returncode == 0, log.read_text()[-4000:]
    assert "-XX:TieredStopAtLevel=1" in jvm, jvm  # enrich.session.DRIVER_JIT

    rows = [json.loads(m.value()) for m in read_all(kafka, cfg["output"]["kafka"]["topic"])]
    assert sorted(r["n"] for r in rows) == list(range(total))
    assert all(r["owner"] == f"o{r['n'] % 6}" for r in rows if r["n"] % 6 < 5)
    assert all(r["_devices_matched"] is False for r in rows if r["n"] % 6 == 5)
    apps = master_state(ui)["completedapps"] + master_state(ui)["activeapps"]
    assert any(a["name"] == "refstream-enrich" for a in apps), "the job did not run on the cluster"

    # The executors' Python workers ran ./env/bin/python in their executor's directory, where Spark
    # unpacked the archive: the installed wheel, without PySpark's jars.
    assert workers, "no Python worker seen on the executors"
    assert {exe for exe, _ in workers} == {"./env/bin/python"}, workers
    # PySpark's own Python code comes from the worker's Spark, which Spark puts first on their path.
    zip_ = str(SPARK_HOME / "python" / "lib" / "pyspark.zip")
    assert all(path.startswith(zip_) for _, path in workers.values()), workers
    executor_dirs = {Path(cwd) for _, cwd in workers}
    assert {d.parent.parent.name for d in executor_dirs} == {"work0", "work1"}, executor_dirs
    for d in executor_dirs:
        (site,) = (d / "env" / "lib").glob("python3*/site-packages")
        assert (site / "enrich" / "job.py").is_file() and (site / "pandas").is_dir(), d
        assert (site / "pyspark").is_dir() and not (site / "pyspark" / "jars").exists(), d
    # The driver starts Python workers too: there the same path is its ``env``.
    assert ("./env/bin/python", str(deploy)) in driver, driver
    # ... and the executors wrote the output: every task's writer is a process in an executor's directory.
    writers = [w for line in log.read_text().splitlines() if "writers: " in line
               for w in line.split("writers: ", 1)[1].split(", ")]
    assert len(writers) >= 4, log.read_text()[-3000:]  # 2 batches of 1000 events, 2 tasks each
    assert {Path(w.split(" in ", 1)[1].split(":", 2)[2]) for w in writers} <= executor_dirs, writers
    assert str(proc.pid) not in {w.split(" in ", 1)[1].split(":")[1] for w in writers}

    # What reached the driver: Spark records every task's serialized result size. Event rows of a
    # 1000-event batch are tens of kilobytes; a row of counts is a few hundred bytes plus metrics.
    ends = [json.loads(line) for f in events_dir.rglob("*") if f.is_file() for line in f.read_text().splitlines()
            if '"SparkListenerTaskEnd"' in line]
    sizes = [e["Task Metrics"]["Result Size"] for e in ends if e.get("Task Metrics")]
    assert len(sizes) >= 4 and max(sizes) < 8_000, sorted(sizes)[-5:]

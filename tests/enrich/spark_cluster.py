"""A real standalone Spark cluster for tests: a master and two one-core workers started with
pyspark's ``bin/spark-class``, stopped (process groups, TERM then KILL) when the test is done, or
for the ``cluster`` fixture (tests/enrich/conftest.py) when the session is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyspark

from demo.broker import free_port
from tests.timing import bound

SPARK_HOME = Path(pyspark.__file__).parent


def both_executors() -> dict[str, str]:
    """A job's Spark settings that make it use both one-core workers: two cores in all, and no task
    before both executors have registered (Spark's own wait, bounded). With two tasks per stage, the
    second task can only run on the other worker, whichever executor came up first: a test may then
    assert that both wrote, which otherwise depends on how fast each executor starts."""
    return {"spark.cores.max": "2", "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": f"{bound(300):.0f}s"}


def master_state(ui: int) -> dict:
    """The master's view (workers, applications) from its web UI's JSON."""
    with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=bound(5)) as r:
        return json.loads(r.read())


@dataclass(frozen=True)
class Cluster:
    """A running cluster: its master's URL and UI port, and ``workdir`` (logs; ``work0``, ``work1``:
    the workers' work dirs, where each application's executors run in ``workN/APP-ID/EXECUTOR-ID``)."""

    master: str
    ui: int
    workdir: Path

    def apps(self) -> list[dict]:
        """The applications the master has seen, running or done."""
        state = master_state(self.ui)
        return [*state["activeapps"], *state["completedapps"]]

    def executor_logs(self, worker: int, app_id: str) -> list[Path]:
        """The stderr files of ``app_id``'s executors on worker ``worker`` (0 or 1)."""
        return list((self.workdir / f"work{worker}" / app_id).glob("*/stderr"))


@contextmanager
def standalone_cluster(workdir: Path, env: Mapping[str, str], cwd: Path | None = None) -> Iterator[tuple[str, int]]:
    """``(master URL, master UI port)`` of a cluster whose processes run with ``env`` (plus
    SPARK_HOME, SPARK_LOCAL_IP, no worker cleanup and C1 only); logs and work dirs ``work0``, ``work1`` in
    ``workdir``."""
    full = {**env, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_WORKER_OPTS": "-Dspark.worker.cleanup.enabled=false",
            # C1 only, as the tests' drivers and executors (tests/spark-conf): less CPU to start.
            "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1"}

    def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen([str(SPARK_HOME / "bin" / "spark-class"), *args], env=full, cwd=cwd,
                                stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                start_new_session=True)

    def wait_for(ready: Callable[[dict], bool], what: str) -> None:
        deadline = time.monotonic() + bound(120)
        while True:
            try:
                if ready(master_state(ui)):
                    return
            except (OSError, ValueError):  # not up yet
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"the cluster did not come up ({what}): "
                                     + (workdir / "master.log").read_text()[-2000:])
            time.sleep(1)

    port, ui = free_port(), free_port()
    procs = [spawn(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                    "--webui-port", str(ui)], workdir / "master.log")]
    try:
        # The workers start once the master holds its ports: a worker's UI, on a port of the
        # system's choosing, once took the master's UI port while both were starting.
        wait_for(lambda state: "aliveworkers" in state, "the master")
        for i in range(2):
            procs.append(spawn(["org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                                "--host", "127.0.0.1", "--cores", "1", "--memory", "1g", "--webui-port", "0",
                                "--work-dir", str(workdir / f"work{i}")], workdir / f"worker{i}.log"))
        wait_for(lambda state: state.get("aliveworkers") == 2, "two workers")
        yield f"spark://127.0.0.1:{port}", ui
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(bound(20))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(bound(10))

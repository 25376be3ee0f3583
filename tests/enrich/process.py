"""The job as a process of its own (``python -m enrich run``, or through the kill hook): its config,
its start, a run to the end, a SIGKILL mid-stream; shared by the tests that need a real process
(kills, restarts, clusters)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.timing import bound

SCHEMA = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
ROOT = Path(__file__).resolve().parents[2]

def write_config(path: Path, kafka: dict[str, str], unique: Callable[[str], str], **extra: object) -> dict:
    cfg = {
        "kafka": {"bootstrap_servers": kafka["bootstrap.servers"]},
        "events": {"topic": unique("events"), "schema": "device_id STRING, n INT", "starting_offsets": "earliest"},
        "joins": [{"dataset": "devices", "topic": unique("ref.devices"), "on": "device_id"}],
        "output": {"kafka": {"topic": unique("enriched")}},
        "dead_letter_topic": unique("dlq"),
        "checkpoint": str(path.parent / "checkpoint"),
        "trigger": "300ms",
        "max_events_per_batch": 1000,
        "spark": {"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "2"},
        **extra,
    }
    path.write_text(yaml.safe_dump(cfg))
    return cfg


def start_job(config: Path, log: Path, *extra: str, master: str = "local[2]", kill: str | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``enrich run`` as a process of its own (``env``: more environment); ``kill``: through the kill
    hook (tests/enrich/kill.py) with this spec."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **(env or {})}
    entry = ["tests.enrich.kill", kill] if kill is not None else ["enrich"]
    return subprocess.Popen([sys.executable, "-m", *entry, "run", "--config", str(config), "--master", master,
                             *extra], cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


def wait_until(what: str, done: Callable[[], bool], timeout: float, log: Path) -> None:
    """Poll ``done()`` until it holds; past ``timeout`` (stretched to the machine) fail with the
    job's ``log``."""
    deadline = time.monotonic() + bound(timeout)
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s: {log.read_text()[-3000:]}")
        time.sleep(0.2)


def committed_count(kafka: dict[str, str], topic: str) -> int:
    return len(read_all(kafka, topic))


def seed(kafka: dict[str, str], cfg: dict, total: int) -> None:
    """Ten devices on the changelog, then ``total`` events over twelve device ids (two unmatched)."""
    publish(kafka, cfg["joins"][0]["topic"], changelog(SCHEMA, [{"device_id": f"d{i}", "owner": f"o{i}"}
                                                                for i in range(10)]))
    produce_events(kafka, cfg["events"]["topic"], [{"device_id": f"d{i % 12}", "n": i} for i in range(total)],
                   partitions=2)


def run_then_kill(config: Path, log: Path, ready: Callable[[], bool], *, poll: float = 0.5,
                  timeout: float = 240) -> None:
    """Start the job, wait until ``ready()``, then SIGKILL its whole process group: a crash mid-stream."""
    proc = start_job(config, log)
    try:
        deadline = time.monotonic() + bound(timeout)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"job exited early ({proc.returncode}): {log.read_text()[-3000:]}")
            if ready():
                break
            time.sleep(poll)
        else:
            raise AssertionError(f"no output within {timeout:.0f}s: {log.read_text()[-3000:]}")
        os.killpg(proc.pid, signal.SIGKILL)  # driver, JVM and workers
        proc.wait(bound(30))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(bound(30))


def run_job(config: Path, log: Path) -> int:
    proc = start_job(config, log, "--available-now")
    return proc.wait(bound(300))

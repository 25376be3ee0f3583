"""Exactly-once effect across a crash: SIGKILL the job (a ``python -m enrich run`` process group:
driver, JVM and Python workers) mid-stream, restart it, and compare the output with the input one
for one (read_committed: no loss, no duplicates)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, produce_events, publish, read_all
from tests.timing import bound

SCHEMA = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration  # starts `python -m enrich run` (Spark) itself


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


def test_sigkill_then_restart_gives_each_event_once(kafka: dict[str, str], unique: Callable[[str], str],
                                                     tmp_path: Path) -> None:
    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique)
    total = 4000
    seed(kafka, cfg, total)
    out_topic = cfg["output"]["kafka"]["topic"]
    log = tmp_path / "job.log"
    run_then_kill(config, log, lambda: committed_count(kafka, out_topic) >= 1000)
    before = committed_count(kafka, out_topic)
    assert before < total, "the job should have been killed mid-stream"

    proc = start_job(config, log, "--available-now")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    got = Counter(json.loads(m.value())["n"] for m in read_all(kafka, out_topic))
    assert set(got) == set(range(total)), f"lost: {sorted(set(range(total)) - set(got))[:20]}"
    assert [n for n, c in got.items() if c > 1] == [], "duplicates after the restart"
    rows = {json.loads(m.value())["n"]: json.loads(m.value()) for m in read_all(kafka, out_topic)}
    assert rows[5]["owner"] == "o5" and rows[11]["_devices_matched"] is False


def test_sigkill_then_restart_parquet_output_has_each_event_once(kafka: dict[str, str],
                                                                  unique: Callable[[str], str],
                                                                  tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "out"
    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique, output={"parquet": {"path": str(out)}})
    total = 4000
    seed(kafka, cfg, total)
    log = tmp_path / "job.log"
    run_then_kill(config, log, lambda: len(list(out.glob("batch_id=*"))) >= 1, poll=0.2)
    done_before = len(list(out.glob("batch_id=*")))
    assert done_before * 1000 < total, "the job should have been killed mid-stream"

    proc = start_job(config, log, "--available-now")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    # Readers see whole batches only: the batch directories, never the staging area.
    ns: Counter[int] = Counter()
    for d in sorted(out.glob("batch_id=*")):
        ns.update(pq.read_table(d).column("n").to_pylist())
    assert set(ns) == set(range(total)), f"lost: {sorted(set(range(total)) - set(ns))[:20]}"
    assert [n for n, c in ns.items() if c > 1] == [], "duplicates after the restart"


def test_a_python_worker_killed_inside_its_transaction_leaves_each_event_once(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """The task of slot 0 in batch 1 kills its Python worker after sending its records and before
    its commit (test hook); Spark runs the task again (local[2,4]: up to 4 attempts), whose producer
    fences the dead one's transaction."""

    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique)
    total = 3000
    seed(kafka, cfg, total)
    bad = [b"{broken %d" % i for i in range(40)]
    produce_events(kafka, cfg["events"]["topic"], bad, partitions=2)
    flag = tmp_path / "killed"
    log = tmp_path / "job.log"
    proc = start_job(config, log, "--available-now", master="local[2,4]", kill=f"1:0:{flag}")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    assert flag.exists(), "the hook did not fire"
    assert "Python worker exited unexpectedly" in log.read_text() or "crashed" in log.read_text()
    got = Counter(json.loads(m.value())["n"] for m in read_all(kafka, cfg["output"]["kafka"]["topic"]))
    assert set(got) == set(range(total)), f"lost: {sorted(set(range(total)) - set(got))[:20]}"
    assert [n for n, c in got.items() if c > 1] == [], "duplicates after the task was killed"
    dead = Counter(m.value() for m in read_all(kafka, cfg["dead_letter_topic"]))
    assert dead == Counter(bad)


def run_job(config: Path, log: Path) -> int:
    proc = start_job(config, log, "--available-now")
    return proc.wait(bound(300))


def test_recreated_events_topic_stops_the_job_until_on_offset_reset_says_what_to_do(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    from tests.enrich.source.test_kafka import recreate

    config = tmp_path / "enrich.yaml"
    cfg = write_config(config, kafka, unique)
    events, out_topic = cfg["events"]["topic"], cfg["output"]["kafka"]["topic"]
    seed(kafka, cfg, 20)
    log = tmp_path / "job.log"
    assert run_job(config, log) == 0, log.read_text()[-3000:]
    assert committed_count(kafka, out_topic) == 20
    # While the job is stopped the events topic is deleted and recreated (offsets from 0 again).
    recreate(kafka, events, partitions=2)
    produce_events(kafka, events, [{"device_id": "d1", "n": 100 + i} for i in range(5)], partitions=2)
    assert run_job(config, log) == 1
    errors = [line for line in log.read_text().splitlines() if line.startswith("enrich: error: ")]
    assert errors and f"enrichment query failed: topic {events} partition " in errors[-1], errors
    assert committed_count(kafka, out_topic) == 20  # nothing skipped, nothing re-read
    cfg["events"]["on_offset_reset"] = "earliest"
    config.write_text(yaml.safe_dump(cfg))
    assert run_job(config, log) == 0, log.read_text()[-3000:]
    got = sorted(json.loads(m.value())["n"] for m in read_all(kafka, out_topic))
    assert got == list(range(20)) + [100 + i for i in range(5)]

"""Exactly-once effect across a crash: SIGKILL the job (a ``python -m enrich run`` process group:
driver, JVM and Python workers) mid-stream, restart it, and compare the output with the input one
for one (read_committed: no loss, no duplicates)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.enrich.helpers import produce_events, read_all
from tests.enrich.process import (
    committed_count,
    run_job,
    run_then_kill,
    seed,
    start_job,
    wait_until,
    write_config,
)
from tests.timing import bound

pytestmark = pytest.mark.integration  # starts `python -m enrich run` (Spark) itself


def test_sigkill_then_restart_gives_each_event_once(kafka: dict[str, str], unique: Callable[[str], str],
                                                     tmp_path: Path) -> None:
    config = tmp_path / "enrich.yaml"
    # Batches of 1,000 every 2 s: the kill at 1,000 written lands with most of the 4,000 still to
    # come, however fast the machine (every 300 ms, a quick run had written all before it landed).
    cfg = write_config(config, kafka, unique, trigger="2s")
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
    cfg = write_config(config, kafka, unique, output={"parquet": {"path": str(out)}}, trigger="2s")  # as above
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


def test_a_broker_that_stops_answering_under_the_running_job_loses_and_repeats_nothing(
        unique: Callable[[str], str], tmp_path: Path) -> None:
    """The job's broker (a private one) freezes (SIGSTOP) for 40 s while the job has events to read,
    longer than librdkafka's request timeouts, and then answers again: the job waits for it and goes
    on. The freeze lands before the batch of those events or in it (a batch in flight waits in its
    writer), so a second freeze lands while the job is idle: its triggers plan no batch (one warning)
    until the broker answers. Each event is written once."""
    from demo.broker import EmbeddedBroker

    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        kafka = {"bootstrap.servers": broker.bootstrap}
        config = tmp_path / "enrich.yaml"
        cfg = write_config(config, kafka, unique)
        seed(kafka, cfg, 300)
        out_topic, log = cfg["output"]["kafka"]["topic"], tmp_path / "job.log"
        proc = start_job(config, log)
        try:
            wait_until("the first 300 events written", lambda: proc.poll() is not None
                       or committed_count(kafka, out_topic) >= 300, 300, log)
            assert proc.poll() is None, log.read_text()[-3000:]
            produce_events(kafka, cfg["events"]["topic"], [{"device_id": f"d{i % 12}", "n": i}
                                                           for i in range(300, 600)], partitions=2)
            assert broker.proc is not None
            os.kill(broker.proc.pid, signal.SIGSTOP)
            time.sleep(40)
            os.kill(broker.proc.pid, signal.SIGCONT)
            wait_until("the events of the first freeze written", lambda: proc.poll() is not None
                       or committed_count(kafka, out_topic) >= 600, 300, log)
            assert proc.poll() is None, log.read_text()[-3000:]
            warned = log.read_text().count("the broker does not answer")  # by the first freeze, or not
            os.kill(broker.proc.pid, signal.SIGSTOP)
            try:
                wait_until("an idle trigger's warning", lambda: proc.poll() is not None
                           or log.read_text().count("the broker does not answer") > warned, 90, log)
            finally:
                os.kill(broker.proc.pid, signal.SIGCONT)
            produce_events(kafka, cfg["events"]["topic"], [{"device_id": f"d{i % 12}", "n": i}
                                                           for i in range(600, 900)], partitions=2)
            wait_until("every event written", lambda: proc.poll() is not None
                       or committed_count(kafka, out_topic) >= 900, 300, log)
            assert proc.poll() is None, log.read_text()[-3000:]
            assert "the broker answers again after" in log.read_text()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the driver only: it stops the query, then the JVM
                proc.wait(bound(60))
        got = Counter(json.loads(m.value())["n"] for m in read_all(kafka, out_topic))
        assert set(got) == set(range(900)), f"lost: {sorted(set(range(900)) - set(got))[:20]}"
        assert [n for n, c in got.items() if c > 1] == [], "duplicates"

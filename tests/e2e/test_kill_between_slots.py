"""The job SIGKILLed while one slot of a micro-batch has committed its Kafka transaction and another
has not, then restarted, three times over (``REFSTREAM_KILLS``, default 3): every event once in the
read_committed output.

Each start runs through the kill hook (tests/enrich/kill.py, ``job:``): the first slot with records
to write in a batch after the one killed last waits until another slot's ledger shows that batch
committed, then sends its records and kills every process of the job inside its transaction. The
restart replays the batch: the committed slot must skip it by its ledger, the other write it once
(on the test broker its killed attempt's records show to read_committed readers, and the slot leaves
them out). Stateless, the cheapest job with two slots a batch: the events topic has two partitions,
each batch reads both. (The soak, bench/soak.py, kills a job with state at random moments.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from enrich.ops.batches import Checkpoint
from enrich.sinks.kafka.ledger import Entry
from enrich.sinks.kafka.tasks import slot_id
from refstream import kafka as rkafka
from refstream.contract import Column, DatasetSchema
from tests.enrich.helpers import changelog, ledger_entry, produce_events, publish, read_all, read_settled
from tests.enrich.kill import read_note, session_pids
from tests.enrich.process import start_job, write_config
from tests.timing import bound

# Each start of the job takes 20-25 s on a quiet machine (Spark, then the replayed batch's first tasks),
# 40-60 s under the suite's load: four starts, 11 CPU seconds each. REFSTREAM_KILLS=20 for a longer
# look while changing the sink's protocol.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

DEVICES = DatasetSchema("devices", ("device_id",), (Column("device_id", "string"), Column("owner", "string")))
KILLS = int(os.environ.get("REFSTREAM_KILLS", "3"))
PER_BATCH = 100
TOTAL = PER_BATCH * 8 * KILLS  # 8 batches a kill: the kills and their replays use about 4 each


def slot_entry(kafka: dict[str, str], note: dict[str, Any], slot: int) -> Entry:
    """What the ledger of ``slot`` says, in the query a kill hook's ``note`` describes."""
    return ledger_entry(kafka, note["ledger_topic"], slot_id(note["base_id"], slot), note["scope"])


def lost_report(kafka: dict[str, str], topic: str, lost: set[int]) -> str:
    """Where the events missing from the read_committed output are: among the records a
    read_uncommitted reader sees (partition, offset), or nowhere."""
    time.sleep(5)
    committed = read_all(kafka, topic)
    again = {json.loads(m.value())["n"] for m in committed}
    ends: dict[str, dict[int | None, int]] = {"committed": {}, "uncommitted": {}}
    for m in committed:
        ends["committed"][m.partition()] = max(ends["committed"].get(m.partition(), -1), m.offset() or 0)
    seen: dict[int, list[tuple[int | None, int | None]]] = {}
    for m in rkafka.read_to_end({**kafka, "isolation.level": "read_uncommitted"}, topic, timeout=bound(20)):
        ends["uncommitted"][m.partition()] = max(ends["uncommitted"].get(m.partition(), -1), m.offset() or 0)
        n = json.loads(m.value())["n"]
        if n in lost:
            seen.setdefault(n, []).append((m.partition(), m.offset()))
    return (f"lost {len(lost)}: {sorted(lost)[:10]}..{sorted(lost)[-5:]}; read_committed 5 s later still lacks "
            f"{len(lost - again)}; last offsets {ends}; read_uncommitted has {len(seen)} of them, e.g. "
            f"{sorted(seen.items())[:6]}; nowhere: {sorted(lost - set(seen))[:10]}")


def seeded(config: Path, kafka: dict[str, str], unique: Callable[[str], str], total: int) -> dict[str, Any]:
    """A stateless job's config (batches of ``PER_BATCH``), ``d1`` on its changelog and ``total`` events
    over twelve devices on two partitions."""
    cfg = write_config(config, kafka, unique, max_events_per_batch=PER_BATCH)
    publish(kafka, cfg["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "d1", "owner": "o1"}]))
    produce_events(kafka, cfg["events"]["topic"], [{"device_id": f"d{i % 12}", "n": i} for i in range(total)],
                   partitions=2)
    return cfg


def test_kills_between_two_slots_commits_leave_each_event_once(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    config = tmp_path / "enrich.yaml"
    cfg = seeded(config, kafka, unique, TOTAL)
    out_topic = cfg["output"]["kafka"]["topic"]
    checkpoint = Path(cfg["checkpoint"])
    log = tmp_path / "job.log"

    killed: list[int] = []
    for k in range(KILLS):
        flag = tmp_path / f"killed-{k}"
        after = killed[-1] + 1 if killed else 0
        proc = start_job(config, log, "--available-now", kill=f"job:{after}+:*:{flag}")
        rc = proc.wait(bound(300))
        note = read_note(flag) if flag.exists() else None
        assert rc == -signal.SIGKILL and note is not None, f"kill {k}: exit {rc}, no kill: {log.read_text()[-3000:]}"
        assert note["other"] is not None, f"kill {k}: no other slot committed batch {note['batch']}: {note}"
        assert note["session"] == proc.pid
        batch = note["batch"]
        assert batch >= after
        # The whole job is gone (PySpark's daemons and workers included), and the crash left the
        # batch committed in one slot's ledger, begun and not committed in the other's, not in Spark's.
        deadline = time.monotonic() + bound(10)
        while session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session_pids(proc.pid) == [], "a process of the killed job survived"

        for slot, committed in ((note["other"], True), (note["slot"], False)):
            entry = slot_entry(kafka, note, slot)
            assert (entry.committed is not None and entry.committed >= batch) == committed, (slot, entry)
            if not committed:
                assert entry.begun == batch, (slot, entry)
        last = Checkpoint(checkpoint).last_committed()
        assert last is None or last < batch
        killed.append(batch)

    proc = start_job(config, log, "--available-now")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    rows = [json.loads(m.value()) for m in read_settled(kafka, out_topic, TOTAL)]
    got = Counter(r["n"] for r in rows)
    assert set(got) == set(range(TOTAL)), lost_report(kafka, out_topic, set(range(TOTAL)) - set(got))
    assert [n for n, c in got.items() if c > 1] == [], f"written twice: {sorted(n for n, c in got.items() if c > 1)[:20]}"
    assert {r["owner"] for r in rows if r["device_id"] == "d1"} == {"o1"}
    assert read_all(kafka, cfg["dead_letter_topic"]) == []
    # Each killed batch was replayed, and the slot that had committed it skipped it.
    text = log.read_text()
    for batch in killed:
        skipped = [int(n) for n in re.findall(rf"batch {batch}: \d+ records .*? \((\d+) skipped as committed", text)]
        assert skipped and max(skipped) >= 1, f"batch {batch}: no replay skipped a committed slot ({skipped})"


def test_identical_events_on_two_partitions_are_two_records_whatever_fails_between_them(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """A gateway's retried send: the same key and payload on both partitions, read by the two slots of
    one batch. One slot begins, then the other; the first, having sent its first records, is killed
    inside its transaction while the other writes and commits. Its retry counts the records already
    in the log past where it began as its own (the test broker shows its aborted ones), and must not
    count the other slot's: every event twice in the output, none more, none less."""
    from confluent_kafka import Producer

    config = tmp_path / "enrich.yaml"
    # The writers get their rows 50 at a time: the killed attempt has sent a part of its records only.
    cfg = write_config(config, kafka, unique, max_events_per_batch=1000,
                       spark={"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "2",
                              "spark.sql.execution.arrow.maxRecordsPerBatch": "50"})
    publish(kafka, cfg["joins"][0]["topic"], changelog(DEVICES, [{"device_id": "d1", "owner": "o1"}]))
    events = cfg["events"]["topic"]
    rkafka.ensure_topic(kafka, events, partitions=2)
    p = Producer(dict(kafka))
    for i in range(200):
        for part in (0, 1):
            p.produce(events, key=f"d{i % 12}".encode(), value=json.dumps({"device_id": f"d{i % 12}", "n": i}).encode(),
                      partition=part)
    p.flush(30)
    log, flag = tmp_path / "job.log", tmp_path / "killed"
    proc = start_job(config, log, "--available-now", master="local[2,4]", kill=f"race:0+:*:{flag}")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    assert flag.exists(), "the hook did not fire"
    # The retried slot found the batch begun by its killed attempt and counted what the log held.
    assert "the previous attempt began and its commit is not seen" in log.read_text(), log.read_text()[-3000:]
    rows = [json.loads(m.value()) for m in read_settled(kafka, cfg["output"]["kafka"]["topic"], 400)]
    got = Counter(r["n"] for r in rows)
    assert got == Counter({i: 2 for i in range(200)}), {n: c for n, c in got.items() if c != 2}
    # Each record says where its event was read: both partitions of every payload.
    assert {(r["n"], r["_partition"]) for r in rows} == {(i, part) for i in range(200) for part in (0, 1)}
    assert all(r["_topic"] == events and isinstance(r["_offset"], int) for r in rows)


def test_a_pending_batch_whose_ledgers_expired_is_refused_naming_the_cause_and_the_way_out(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """The job dies with a batch committed in one slot and not in Spark; while it is stopped the broker
    drops its writers' ledger offsets (offsets.retention.minutes). The
    restart cannot tell which slots wrote the batch: it refuses, naming the batch, the cause and how
    to go on, and writes nothing."""
    config = tmp_path / "enrich.yaml"
    cfg = seeded(config, kafka, unique, 400)
    log, flag = tmp_path / "job.log", tmp_path / "killed"
    proc = start_job(config, log, "--available-now", kill=f"job:1+:*:{flag}")
    assert proc.wait(bound(300)) == -signal.SIGKILL, log.read_text()[-3000:]
    note = read_note(flag)
    assert note is not None and note["other"] is not None, note
    committed = Checkpoint(Path(cfg["checkpoint"])).last_committed()
    # The ledgers' offsets gone, as the broker drops them: the test broker deletes no group that had
    # transactional commits, so the checkpoint's writers are pointed at groups that hold nothing (a
    # ledger's group is its writer's id and the recorded scope).
    from enrich.checkpoint import CheckpointLayout

    record = CheckpointLayout(Path(cfg["checkpoint"])).sink_identity
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "scope": kept["scope"] + "-expired"}))
    proc = start_job(config, log, "--available-now")
    assert proc.wait(bound(300)) != 0
    errors = [line for line in log.read_text().splitlines() if line.startswith("enrich: ")]
    assert errors and f"batch {note['batch']} of the checkpoint" in errors[-1], log.read_text()[-3000:]
    assert "offsets.retention.minutes" in errors[-1] and "--from-savepoint" in errors[-1], errors[-1]
    # Nothing written: the batch is still pending (its killed slot's transaction stays open until
    # the broker's timeout, which the refused start did not fence).
    assert Checkpoint(Path(cfg["checkpoint"])).last_committed() == committed


def test_a_slot_sent_back_then_killed_with_the_job_in_the_same_batch_writes_each_event_once(
        kafka: dict[str, str], unique: Callable[[str], str], tmp_path: Path) -> None:
    """Two unfinished attempts at one slot's batch: the first kills its worker after sending its
    records (Spark runs the task again), the second sends its records and kills the whole job. The
    restart's attempt must count what both left in the log (the test broker shows aborted records):
    it begins where the first began, not where the second did."""
    config = tmp_path / "enrich.yaml"
    cfg = seeded(config, kafka, unique, 400)
    log, flag = tmp_path / "job.log", tmp_path / "killed"
    proc = start_job(config, log, "--available-now", master="local[2,4]", kill=f"retry:1+:*:{flag}")
    assert proc.wait(bound(300)) == -signal.SIGKILL, log.read_text()[-3000:]
    assert Path(f"{flag}.again").exists(), "the task Spark ran again did not kill the job"
    proc = start_job(config, log, "--available-now")
    assert proc.wait(bound(300)) == 0, log.read_text()[-3000:]
    got = Counter(json.loads(m.value())["n"] for m in read_settled(kafka, cfg["output"]["kafka"]["topic"], 400))
    assert got == Counter(range(400)), {n: c for n, c in got.items() if c != 1}

"""The executors' Kafka writer (``enrich.sinks.kafka.tasks``): one transaction per Spark task, with a
ledger per slot; on real Spark (local) and the real broker."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pyspark.sql import DataFrame, SparkSession

from enrich.sinks.kafka.ledger import ensure_ledger
from enrich.sinks.kafka.tasks import RESULT_DDL, TaskWriter, slot_id
from enrich.sinks.kafka.writer import written_ends
from refstream.kafka import ensure_topic
from tests.enrich.helpers import ledger_entry, open_transaction, read_settled

ROWS = "key BINARY, value BINARY, _error STRING, _key BINARY, _value BINARY, _topic STRING, _partition INT, _offset BIGINT"


def rows(spark: SparkSession, n: int, parts: int = 2) -> DataFrame:
    """``n`` output rows over ``parts`` tasks; every seventh a dead letter."""
    data = []
    for i in range(n):
        bad, part = i % 7 == 3, i * parts // n
        key = b"p%d-k%d" % (part, i % 5)  # as a keyed producer leaves them: a key in one partition
        data.append((key, None if bad else b'{"n":%d}' % i, "broken" if bad else None,
                     key if bad else None, b"raw-%d" % i if bad else None, "events", part, i))
    return spark.createDataFrame(spark.sparkContext.parallelize(data, parts), ROWS)  # contiguous slices


def write(df: DataFrame, writer: TaskWriter) -> list[dict]:
    return [r.asDict() for r in df.mapInArrow(writer, RESULT_DDL).collect()]


@pytest.fixture
def topics(kafka: dict[str, str], unique) -> tuple[str, str, str]:
    out, dlq = unique("tasks-out"), unique("tasks-dlq")
    ensure_topic(kafka, out, partitions=3)
    ensure_topic(kafka, dlq)
    return out, dlq, ensure_ledger(kafka, out)


def committed(kafka: dict[str, str], ledger: str, tid: str, scope: str) -> int | None:
    """The batch the ledger of ``tid`` (in ``scope``) says was committed last."""
    return ledger_entry(kafka, ledger, tid, scope).committed


def test_each_task_commits_its_rows_and_dead_letters_once_per_batch(spark: SparkSession, kafka: dict[str, str],
                                                                    unique, topics) -> None:
    out, dlq, markers = topics
    base = unique("tid")
    df = rows(spark, 700)

    def writer(batch_id: int, scope: str = "q1") -> TaskWriter:
        return TaskWriter(kafka, out, dlq, markers, base, scope, batch_id)

    first = write(df, writer(0))
    assert sorted(r["slot"] for r in first) == [0, 1] and not any(r["skipped"] for r in first)
    assert sum(r["records"] for r in first) == 600 and sum(r["dead_letters"] for r in first) == 100
    assert {r["transactional_id"] for r in first} == {slot_id(base, 0), slot_id(base, 1)}
    # The batch again (a replay, or a task re-run): every slot finds it in its ledger and writes nothing.
    again = write(df, writer(0))
    assert all(r["skipped"] and r["records"] == 0 for r in again)
    good = [json.loads(m.value())["n"] for m in read_settled(kafka, out, 600)]
    assert sorted(good) == [i for i in range(700) if i % 7 != 3]
    dead = read_settled(kafka, dlq, 100)
    assert sorted(m.value() for m in dead) == sorted(b"raw-%d" % i for i in range(700) if i % 7 == 3)
    assert all(dict(m.headers())["error"] == b"broken" for m in dead)
    # Order within a key is the order of the events (one key, one output partition, one task).
    by_key: dict[bytes, list[int]] = {}
    for m in read_settled(kafka, out, 600):
        by_key.setdefault(m.key(), []).append(json.loads(m.value())["n"])
    assert all(ns == sorted(ns) for ns in by_key.values())
    # One ledger per slot: it says which batch the slot committed.
    assert [committed(kafka, markers, slot_id(base, slot), "q1") for slot in (0, 1)] == [0, 0]
    # The next batch is written; a fresh query (another scope) starting again at batch 0 is too.
    assert sum(r["records"] for r in write(df, writer(1))) == 600
    assert sum(r["records"] for r in write(df, writer(0, scope="q2"))) == 600
    # Every record the four writes left in the log, read uncommitted: no transaction of this test
    # aborts, so that is 1800 exactly when no batch was written twice or lost (the tasks reported
    # their commits above). In some runs of the whole suite (never alone, in about 30 runs) the test broker
    # kept the records of the later commits from read_committed readers for good (batch 0's 600
    # alone visible after 90 s), as it keeps a partition's records behind another producer's open
    # transaction elsewhere; batch 0's read_committed checks above stand.
    uncommitted = {**kafka, "isolation.level": "read_uncommitted"}
    assert len(read_settled(uncommitted, out, 1800)) == 1800


def test_an_empty_task_opens_no_transaction(spark: SparkSession, kafka: dict[str, str], unique, topics) -> None:
    out, dlq, markers = topics
    base = unique("tid")
    df = rows(spark, 20).where("_partition = 0")  # the task of slot 1 gets no row
    res = {r["slot"]: r for r in write(df, TaskWriter(kafka, out, dlq, markers, base, "q", 0))}
    assert sorted(res) == [0, 1] and res[0]["records"] > 0
    assert res[1]["records"] == 0 and not res[1]["skipped"]
    assert committed(kafka, markers, slot_id(base, 1), "q") is None
    assert committed(kafka, markers, slot_id(base, 0), "q") == 0


def test_a_task_with_rows_left_to_from_json_writes_nothing_and_asks_for_its_slot(
        spark: SparkSession, kafka: dict[str, str], unique, topics) -> None:
    """Slot 1 meets a row the fast parser left to from_json after writing some of its rows: it aborts
    and asks for the slot; the slot written again from the exact rows (same batch id) gives each
    row once, also on a broker that shows aborted transactions."""
    from pyspark.sql import functions as F

    out, dlq, markers = topics
    base = unique("tid")
    n = 40_000  # slot 1's rows span several Arrow batches: the slow row comes after some were sent
    exact = rows(spark, n)
    fast = exact.withColumn("_slow", F.col("_offset") == n - 5).withColumn(
        "value", F.when(F.col("_offset") == n - 5, F.lit(None)).otherwise(F.col("value")))
    writer = TaskWriter(kafka, out, dlq, markers, base, "q", 0)
    first = {r["slot"]: r for r in write(fast, writer)}
    assert first[0]["records"] > 0 and not first[0]["redo"]
    assert first[1]["redo"] and first[1]["records"] == 0
    again = {r["slot"]: r for r in write(exact.where(F.spark_partition_id() == 1), writer)}
    assert again[0]["records"] == 0 and not again[0]["skipped"]   # an empty task
    expect_good, expect_dead = [i for i in range(n) if i % 7 != 3], [i for i in range(n) if i % 7 == 3]
    good = sorted(json.loads(m.value())["n"] for m in read_settled(kafka, out, len(expect_good)))
    assert good == expect_good
    assert len(read_settled(kafka, dlq, len(expect_dead))) == len(expect_dead)
    assert again[1]["records"] > 0 and not again[1]["redo"]


def test_a_task_begins_past_another_writer_s_open_transaction(spark: SparkSession, kafka: dict[str, str], unique,
                                                              topics) -> None:
    """The ends a task records in its ledger when it begins (nothing of the attempt lies before them)
    are the written ends, past the records of another writer's open transaction: found without
    waiting for that transaction to end."""
    out, dlq, markers = topics
    base = unique("tid")
    other = open_transaction(kafka, unique("other"), [(out, 0, b"open-%d" % i) for i in range(50)])
    try:
        assert written_ends(kafka, [out])[(out, 0)] == 50
        res = write(rows(spark, 70), TaskWriter(kafka, out, dlq, markers, base, "q", 0))
        assert sum(r["records"] for r in res) == 60
    finally:
        other.abort_transaction(30)
    for slot in (0, 1):
        entry = ledger_entry(kafka, markers, slot_id(base, slot), "q", [(out, 0)])
        assert (entry.begun, entry.committed) == (0, 0) and entry.ends[(out, 0)] >= 50, entry


def test_a_slot_finds_its_commit_while_other_transactions_are_open(spark: SparkSession, kafka: dict[str, str],
                                                                   unique, topics) -> None:
    """Another transaction open on the ledger topic - where a commit marker of a shared topic held
    a slot's own commit back from it (the writers of another job, a killed worker's transaction until
    its timeout) - began before the batch: a slot's own commit is found all the same, and a replay or
    retry of the batch writes nothing again. (The test broker also hides a committed transaction
    behind an older one open on a partition it wrote, so a transaction on the output's partitions
    would hide the batch itself from every reader there; Apache Kafka does not.)"""
    import threading

    out, dlq, ledger = topics
    base = unique("tid")
    other = open_transaction(kafka, unique("other"), [(ledger, part, b"open") for part in range(2)])
    try:
        df = rows(spark, 140)
        first = write(df, TaskWriter(kafka, out, dlq, ledger, base, "q", 7))
        assert sum(r["records"] for r in first) == 120 and not any(r["skipped"] for r in first)
        again = write(df, TaskWriter(kafka, out, dlq, ledger, base, "q", 7))
        assert all(r["skipped"] and r["records"] == 0 for r in again), again
        # Two attempts at the next batch at once (a retry beside a speculative copy): the later one
        # fences the other, which fails; whatever each did, a further retry writes nothing again.
        failed: list[BaseException] = []

        def attempt() -> None:
            try:
                write(df, TaskWriter(kafka, out, dlq, ledger, base, "q", 8))
            except Exception as exc:  # noqa: BLE001 - a fenced attempt fails, as a Spark task would
                failed.append(exc)

        runs = [threading.Thread(target=attempt) for _ in range(2)]
        for t in runs:
            t.start()
        for t in runs:
            t.join(240)
        write(df, TaskWriter(kafka, out, dlq, ledger, base, "q", 8))  # a further retry
    finally:
        other.abort_transaction(30)
    # Every event once per batch, as a read_committed consumer sees them (a broker that shows the
    # fenced attempt's aborted records shows them once: the later attempt did not write them again).
    got = Counter(json.loads(m.value())["n"] for m in read_settled(kafka, out, 240))
    assert set(got.values()) == {2} and len(got) == 120, "each event once per batch"


def test_the_slot_setups_kept_probe_gives_what_a_new_probe_gives_and_follows_the_settings(
        kafka: dict[str, str], topics) -> None:
    """A Python worker keeps one end-offset probe between its tasks' slot setups: its ends are a new
    probe's, records written since included; a call with other settings closes it and keeps a new one."""
    from enrich.sinks.kafka import writer
    from refstream.kafka import producer

    out, dlq, _ = topics
    p = producer(kafka)

    def produce(n: int) -> None:
        for i in range(n):
            p.produce(out, b"v%d" % i, partition=i % 3)
        p.flush(30)

    produce(30)
    assert written_ends(kafka, [out, dlq], kept=True) == written_ends(kafka, [out, dlq])
    kept = writer._KEPT["probe"][1]
    produce(7)
    got = written_ends(kafka, [out, dlq], kept=True)
    assert got == written_ends(kafka, [out, dlq]) and sum(got.values()) == 37
    assert writer._KEPT["probe"][1] is kept  # the same consumer, not a new one per call
    other = {**kafka, "client.id": "another"}
    assert written_ends(other, [out, dlq], kept=True) == got
    assert writer._KEPT["probe"][1] is not kept and kept._consumer is None  # closed
